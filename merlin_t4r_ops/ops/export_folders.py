"""The operator's folders in an export's ``ensemble/`` directory; an export replaces earlier ones.

``Ensemble.export`` calls every operator's ``save_artifacts`` into one directory and writes
``ensemble.pkl`` only after the last of them. While an export runs, ``ensemble.pkl`` is
therefore still the previous export's, and its SHA-256 names the export in progress (its
*generation*): every operator of this package in one ensemble sees the same one, whereas a
folder left by an earlier export carries an earlier one. Each folder records its generation
in ``export.json``, and a folder this package wrote (``t4r_model_<12 hex>`` of
``PredictT4RPyTorch`` or ``item_vocabulary_<12 hex>`` of ``DecodeItemIds``, holding our
``manifest.json``) whose generation differs is removed, file by file: nothing else in the
directory is touched, not even a stranger's file inside one of our folders.
"""

import contextlib
import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Iterator, Optional

from merlin_t4r_ops.ops.artifacts import MANIFEST_NAME, MODEL_FILES
from merlin_t4r_ops.ops.vocabulary import VOCABULARY_FILES

__all__ = ["new_folder_name", "replacing_earlier_exports", "MODEL_PREFIX", "VOCABULARY_PREFIX"]

MODEL_PREFIX = "t4r_model_"
VOCABULARY_PREFIX = "item_vocabulary_"
_STAMP = "export.json"
_ENSEMBLE_PICKLE = "ensemble.pkl"
# Each kind of folder and the files this package writes into it.
_FILES = {MODEL_PREFIX: (*MODEL_FILES, MANIFEST_NAME, _STAMP),
          VOCABULARY_PREFIX: (*VOCABULARY_FILES, MANIFEST_NAME, _STAMP)}
_FOLDER = re.compile(f"({'|'.join(_FILES)})[0-9a-f]{{12}}")


def new_folder_name(prefix: str = MODEL_PREFIX) -> str:
    """A fresh folder name for one operator's artifacts (``prefix`` names their kind)."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def _generation(artifact_path: Path) -> str:
    try:
        return hashlib.sha256((artifact_path / _ENSEMBLE_PICKLE).read_bytes()).hexdigest()
    except FileNotFoundError:
        return "first export"


def _generation_of(folder: Path) -> Optional[str]:
    try:
        return json.loads((folder / _STAMP).read_text())["generation"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # written before export.json existed, or damaged


def _is_ours(folder: Path) -> bool:
    return (
        bool(_FOLDER.fullmatch(folder.name))
        and folder.is_dir()
        and not folder.is_symlink()
        and (folder / MANIFEST_NAME).is_file()
    )


def _remove(folder: Path) -> None:
    ours = _FILES[_FOLDER.fullmatch(folder.name).group(1)]
    for name in ours:
        (folder / name).unlink(missing_ok=True)
    for staging in folder.glob(".*.*"):  # left by an interrupted atomic write
        if any(staging.name.startswith(f".{name}.") for name in ours):
            staging.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # someone else's file is in it: leave both
        folder.rmdir()


@contextlib.contextmanager
def replacing_earlier_exports(artifact_path, name: str) -> Iterator[Path]:
    """Yield ``artifact_path / name`` to save into; then remove earlier exports' folders.

    Nothing is removed if saving fails.
    """
    artifact_path = Path(artifact_path)
    generation = _generation(artifact_path)
    folder = artifact_path / name
    yield folder
    (folder / _STAMP).write_text(json.dumps({"generation": generation}))
    for other in sorted(artifact_path.iterdir()):
        if _is_ours(other) and _generation_of(other) != generation:
            _remove(other)
