"""Stand-in for ``artifacts.write_checked`` / ``read_checked`` until they land on main.

Same contract: a manifest of sizes and SHA-256 digests beside the files, and a reader that
reads each file once, hashes those bytes and returns them only when they match.
"""

import hashlib
import json
from pathlib import Path
from typing import Dict, Iterable

from merlin_t4r_ops.errors import ArtifactError

MANIFEST_NAME = "manifest.json"


def write_checked(directory, files: Dict[str, bytes]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    manifest = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in files.items()}
    (directory / MANIFEST_NAME).write_text(json.dumps({"format": 1, "files": manifest}))


def read_checked(directory, names: Iterable[str]) -> Dict[str, bytes]:
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise ArtifactError(f"{directory / MANIFEST_NAME} is missing or invalid: {exc}") from exc
    files = {}
    for name in names:
        path = directory / name
        if name not in manifest:
            raise ArtifactError(f"{directory / MANIFEST_NAME} does not list {name}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{path} is missing") from exc
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != manifest[name]["bytes"] or digest != manifest[name]["sha256"]:
            raise ArtifactError(
                f"{path} has {len(data)} bytes and SHA-256 {digest}; the manifest expects "
                f"{manifest[name]['bytes']} bytes and {manifest[name]['sha256']}"
            )
        files[name] = data
    return files
