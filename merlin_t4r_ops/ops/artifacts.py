"""Write a T4R model as checked artifacts, and load it back only once the checks pass.

A model is saved as two files and a manifest:

* ``weights.pt``: the ``state_dict``, loaded with ``torch.load(weights_only=True)``;
* ``module.pt``: the module's structure, pickled with its parameters replaced by
  meta tensors, so it holds code and configuration but no weights;
* ``manifest.json``: the size and SHA-256 of both files.

Loading verifies the manifest first and unpickles ``module.pt`` only when its digest
matches. This catches truncated copies, bit rot and files swapped after export. It does not
make a model repository safe to take from strangers: Triton runs the repository's
``model.py`` and Merlin unpickles ``ensemble.pkl``, so a repository is trusted code.
"""

import copy
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Dict

import cloudpickle
import torch

from merlin_t4r_ops.errors import ArtifactError

__all__ = ["save_model", "load_model", "verify_manifest", "MANIFEST_NAME"]

MANIFEST_NAME = "manifest.json"
MODULE_NAME = "module.pt"
WEIGHTS_NAME = "weights.pt"
_FORMAT_VERSION = 1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _weightless_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy whose parameters are meta tensors: structure and buffers, no weights.

    Seeding ``deepcopy``'s memo with the meta parameters keeps tied weights tied and never
    copies a real parameter. Buffers stay real because some are not in the ``state_dict``
    (GPT-2's causal mask is registered ``persistent=False``).
    """
    memo = {
        id(param): torch.nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
        for param in model.parameters()
    }
    return copy.deepcopy(model, memo)


def save_model(model: torch.nn.Module, directory) -> Dict[str, dict]:
    """Save ``model`` into ``directory`` as weights, structure and a manifest of both."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    _atomic_write(directory / WEIGHTS_NAME, lambda f: torch.save(state, f))
    skeleton = _weightless_copy(model)  # buffers come back on the CPU via map_location
    _atomic_write(
        directory / MODULE_NAME,
        lambda f: torch.save(skeleton, f, pickle_module=cloudpickle),
    )
    files = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
        for name in (MODULE_NAME, WEIGHTS_NAME)
    }
    manifest = {"format": _FORMAT_VERSION, "files": files}
    _atomic_write(
        directory / MANIFEST_NAME,
        lambda f: f.write(json.dumps(manifest, indent=2, sort_keys=True).encode()),
    )
    return files


def verify_manifest(directory) -> Dict[str, dict]:
    """Check every file the manifest lists; raise :class:`ArtifactError` naming the first bad one."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{manifest_path} is missing: export the ensemble again")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{manifest_path} is not a valid manifest: {exc}") from exc
    for name in (MODULE_NAME, WEIGHTS_NAME):
        if name not in files:
            raise ArtifactError(f"{manifest_path} does not list {name}")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise ArtifactError(
                f"{path} is {size} bytes, the manifest expects {expected['bytes']}: "
                "the file is truncated or was changed after export"
            )
        digest = _sha256(path)
        if digest != expected["sha256"]:
            raise ArtifactError(
                f"{path} has SHA-256 {digest}, the manifest expects {expected['sha256']}: "
                "the file was changed after export"
            )
    return files


def load_model(directory, device) -> torch.nn.Module:
    """Verify the artifacts in ``directory``, then rebuild the model on ``device`` in eval mode."""
    directory = Path(directory)
    verify_manifest(directory)
    state = torch.load(directory / WEIGHTS_NAME, map_location=device, weights_only=True)
    # Only reached once module.pt's digest matched the manifest written at export.
    model = torch.load(directory / MODULE_NAME, map_location="cpu", weights_only=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()
