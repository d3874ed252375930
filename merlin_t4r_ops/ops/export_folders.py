"""The operator's folders in an export's ``ensemble/`` directory; an export replaces earlier ones.

``Ensemble.export`` calls every operator's ``save_artifacts`` into one directory, from the
runtime's ``export(ensemble, path)``. The folders this export writes are those of the
operators in *that graph*: :func:`replacing_earlier_exports` finds the ensemble on the stack
(Merlin hands an operator the path only), takes the artifact folder of each of its operators,
and removes every other folder this package wrote there (``t4r_model_<12 hex>`` of
``PredictT4RPyTorch`` or ``item_vocabulary_<12 hex>`` of ``DecodeItemIds``, holding our
``manifest.json``), file by file: nothing else in the directory is touched, not even a
stranger's file inside one of our folders. Called outside an export (``save_artifacts``
by hand), it removes nothing.

Operators over one model share one folder (:mod:`~merlin_t4r_ops.ops.shared_model`); the
first of them in the graph writes it, and :func:`saved_by_an_earlier_operator` tells the
others.
"""

import contextlib
import json
import re
import uuid
from pathlib import Path
from typing import Iterator, List, Optional

from merlin.dag import postorder_iter_nodes
from merlin.systems.dag import Ensemble

from merlin_t4r_ops.ops.artifacts import MANIFEST_NAME, MODEL_FILES
from merlin_t4r_ops.ops.call_stack import search_callers
from merlin_t4r_ops.ops.vocabulary import VOCABULARY_FILES

__all__ = ["new_folder_name", "replacing_earlier_exports", "saved_by_an_earlier_operator",
           "MODEL_PREFIX", "VOCABULARY_PREFIX"]

MODEL_PREFIX = "t4r_model_"
VOCABULARY_PREFIX = "item_vocabulary_"
_STAMP = "export.json"  # the folders of the export that wrote this one
_MAX_FRAMES = 16  # save_artifacts, contextlib, and the runtime's export are a few frames up
# Each kind of folder and the files this package writes into it.
_FILES = {MODEL_PREFIX: (*MODEL_FILES, MANIFEST_NAME, _STAMP),
          VOCABULARY_PREFIX: (*VOCABULARY_FILES, MANIFEST_NAME, _STAMP)}
_FOLDER = re.compile(f"({'|'.join(_FILES)})[0-9a-f]{{12}}")


def new_folder_name(prefix: str = MODEL_PREFIX) -> str:
    """A fresh folder name for one operator's artifacts (``prefix`` names their kind)."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def _operators_of_the_graph(name: str) -> Optional[List]:
    """The operators of the ensemble being exported, in the order its runtime saves them
    (postorder), or ``None``.

    ``Ensemble.export`` and every runtime's ``export`` hold the ``ensemble`` in their frame;
    the graph found must hold the operator that saves into ``name``.
    """

    def operators_of(names):
        ensemble = names.get("ensemble")
        if not isinstance(ensemble, Ensemble):
            return None
        nodes = postorder_iter_nodes(ensemble.graph.output_node, flatten_subgraphs=True)
        operators = [node.op for node in nodes]
        return operators if name in {_folder_of(op) for op in operators} else None

    return search_callers(operators_of, _MAX_FRAMES)


def _folder_of(operator) -> Optional[str]:
    return getattr(operator, "_artifact_dir", None)


def saved_by_an_earlier_operator(operator) -> bool:
    """Whether an operator before ``operator`` in the ensemble being exported saves the same
    folder (operators over one model share it): then ``operator`` writes nothing.

    ``False`` outside an export, and for the first operator of the folder.
    """
    name = _folder_of(operator)
    sharing = [op for op in _operators_of_the_graph(name) or () if _folder_of(op) == name]
    return any(op is operator for op in sharing) and sharing[0] is not operator


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

    Nothing is removed if saving fails, or outside an ``Ensemble.export``.
    """
    artifact_path = Path(artifact_path)
    folder = artifact_path / name
    yield folder
    operators = _operators_of_the_graph(name)
    keep = None if operators is None else {_folder_of(op) for op in operators} - {None}
    (folder / _STAMP).write_text(json.dumps({"export": sorted(keep or [name])}))
    if keep is None:
        return
    for other in sorted(artifact_path.iterdir()):
        if _is_ours(other) and other.name not in keep:
            _remove(other)
