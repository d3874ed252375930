"""The operator's folders in an export's ``ensemble/`` directory; an export replaces earlier ones.

``Ensemble.export`` calls every operator's ``save_artifacts`` into one directory and writes
``ensemble.pkl`` only after the last of them. While an export runs, ``ensemble.pkl`` is
therefore still the previous export's, and its SHA-256 names the export in progress (its
*generation*): every ``PredictT4RPyTorch`` of one ensemble sees the same one, whereas a
folder left by an earlier export carries an earlier one. Each folder records its generation
in ``export.json``, and a folder this package wrote (``t4r_model_<12 hex>`` holding our
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

__all__ = ["new_folder_name", "replacing_earlier_exports"]

_PREFIX = "t4r_model_"
_FOLDER = re.compile(_PREFIX + r"[0-9a-f]{12}")
_STAMP = "export.json"
_ENSEMBLE_PICKLE = "ensemble.pkl"
_OURS = (*MODEL_FILES, MANIFEST_NAME, _STAMP)


def new_folder_name() -> str:
    """A fresh folder name for one operator's artifacts."""
    return f"{_PREFIX}{uuid.uuid4().hex[:12]}"


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
    for name in _OURS:
        (folder / name).unlink(missing_ok=True)
    for staging in folder.glob(".*.*"):  # left by an interrupted atomic write
        if any(staging.name.startswith(f".{name}.") for name in _OURS):
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
