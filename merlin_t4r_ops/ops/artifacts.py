"""Checked artifacts: named files with a manifest of their sizes and SHA-256, each read once.

:func:`write_checked` writes a set of named files and then ``manifest.json``, which records
each file's size and SHA-256. :func:`read_checked` reads the manifest and each file **once**,
checks the bytes it read and returns those very bytes, so what is checked is what is loaded:
no file is hashed in one read and loaded from another. Only plain file names that the caller
lists are accepted; a manifest naming ``../x``, ``/etc/passwd`` or any other file is refused
before anything it names is opened.

A model is saved on top of them as two files:

* ``weights.pt``: the ``state_dict``, loaded with ``torch.load(weights_only=True)``;
* ``module.pt``: the module's structure (:func:`~merlin_t4r_ops.ops.skeleton.model_skeleton`),
  with no weights and nothing a forward pass left behind.

The checks catch truncated copies, bit rot and files swapped after export. They do not make a
model repository safe to take from strangers: Triton runs the repository's ``model.py`` and
Merlin unpickles ``ensemble.pkl``, so a repository is trusted code.
"""

import hashlib
import io
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Dict, Sequence

import cloudpickle
import torch

from merlin_t4r_ops.errors import ArtifactError
from merlin_t4r_ops.ops.skeleton import model_skeleton

__all__ = [
    "write_checked",
    "read_checked",
    "save_model",
    "load_model",
    "MANIFEST_NAME",
    "MODEL_FILES",
]

MANIFEST_NAME = "manifest.json"
MODULE_NAME = "module.pt"
WEIGHTS_NAME = "weights.pt"
MODEL_FILES = (MODULE_NAME, WEIGHTS_NAME)
_FORMAT_VERSION = 1


def _check_name(name, where: str) -> str:
    """``name`` if it is a plain file name of the directory, else :class:`ArtifactError`."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..", MANIFEST_NAME)
        or name != os.path.basename(name)
        or "\\" in name
        or "\0" in name
        or name.startswith(".")  # staging files of _atomic_write start with a dot
    ):
        raise ArtifactError(
            f"{where} names {name!r}, which is not a plain file name inside the directory"
        )
    return name


def _atomic_write(path: Path, data: bytes) -> None:
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        # mkstemp creates 0600; Triton may run as another user than the exporter, and
        # Merlin's own files (config.pbtxt, ensemble.pkl) are world-readable too.
        os.fchmod(handle, 0o644)
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def write_checked(directory, files: Dict[str, bytes]) -> None:
    """Write ``files`` (name to bytes) into ``directory``, then their manifest.

    Each file is replaced atomically and the manifest is written last, so a reader sees the
    old manifest or the new one; with the old one, a file already replaced fails its digest
    instead of loading half of one export and half of the other.

    Raises
    ------
    ArtifactError
        A name is not a plain file name (a path, ``..``, a dot file or ``manifest.json``).
    """
    directory = Path(directory)
    for name in files:
        _check_name(name, "write_checked")
    directory.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, data in files.items():
        data = bytes(data)
        _atomic_write(directory / name, data)
        entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": _FORMAT_VERSION, "files": entries}
    _atomic_write(
        directory / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True).encode()
    )


def _read_once(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit``, from one open."""
    # O_NONBLOCK: opening a FIFO planted under an artifact's name must not hang the load.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        handle = os.open(path, flags)
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing") from None
    with os.fdopen(handle, "rb") as stream:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise ArtifactError(f"{path} is not a regular file")
        return stream.read(limit)


def _read_manifest(directory: Path) -> Dict[str, dict]:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: export the ensemble again")
    raw = _read_once(path, 1 << 20)
    try:
        files = json.loads(raw)["files"]
        for entry in files.values():
            if not isinstance(entry["bytes"], int) or not isinstance(entry["sha256"], str):
                raise TypeError(f"bad entry {entry!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"{path} is not a valid manifest: {exc}") from exc
    return files


def _check_listed(directory: Path, files: Dict[str, dict], names: Sequence[str]) -> None:
    where = f"{directory / MANIFEST_NAME}"
    for name in files:
        _check_name(name, where)
        if name not in names:
            raise ArtifactError(
                f"{where} lists {name!r}, which is not one of the files expected here "
                f"({', '.join(names)})"
            )
    for name in names:
        if name not in files:
            raise ArtifactError(f"{where} does not list {name}")


def _verified(path: Path, data: bytes, expected: dict) -> bytes:
    if len(data) != expected["bytes"]:
        size = f"{len(data)} bytes" if len(data) < expected["bytes"] else "longer"
        raise ArtifactError(
            f"{path} is {size}, the manifest expects {expected['bytes']} bytes: "
            "the file is truncated or was changed after export"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise ArtifactError(
            f"{path} has SHA-256 {digest}, the manifest expects {expected['sha256']}: "
            "the file was changed after export"
        )
    return data


def read_checked(directory, names: Sequence[str]) -> Dict[str, bytes]:
    """Read ``names`` from ``directory``, each once, and return their bytes once checked.

    The manifest must list exactly ``names``. Every file is opened once; its size and SHA-256
    are checked on the bytes read, and those bytes are returned: load from them
    (``io.BytesIO``), never from the path again.

    Raises
    ------
    ArtifactError
        Naming the file and what failed: the manifest is missing or invalid, lists a name
        that is not a plain file name or not in ``names``, omits one of ``names``; a file is
        missing, not a regular file, of another size or another digest.
    """
    directory = Path(directory)
    names = [_check_name(name, "read_checked") for name in names]
    files = _read_manifest(directory)
    _check_listed(directory, files, names)
    blobs = {}
    for name in names:
        path = directory / name
        # One byte beyond the manifest's size tells a longer file from an exact one.
        data = _read_once(path, files[name]["bytes"] + 1)
        blobs[name] = _verified(path, data, files[name])
    return blobs


def save_model(model: torch.nn.Module, directory) -> None:
    """Save ``model`` into ``directory`` as checked weights and structure."""
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    weights, module = io.BytesIO(), io.BytesIO()
    torch.save(state, weights)
    # Buffers stay in the skeleton (some are not in the state_dict) and come back on the
    # CPU through load_model's map_location.
    torch.save(model_skeleton(model), module, pickle_module=cloudpickle)
    write_checked(directory, {MODULE_NAME: module.getvalue(), WEIGHTS_NAME: weights.getvalue()})


def load_model(directory, device) -> torch.nn.Module:
    """Rebuild the model saved by :func:`save_model` on ``device``, in eval mode.

    Each file is read once and checked before its bytes are unpickled.
    """
    blobs = read_checked(directory, MODEL_FILES)
    state = torch.load(io.BytesIO(blobs[WEIGHTS_NAME]), map_location=device, weights_only=True)
    # Trusted code, like ensemble.pkl: only reached once module.pt's bytes matched the manifest.
    model = torch.load(io.BytesIO(blobs[MODULE_NAME]), map_location="cpu", weights_only=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()
