"""Make the ``tritonserver`` of the ``nvidia-pytriton`` wheel runnable from this environment.

The wheel ships the server, the Python backend and one backend stub per Python minor
version, but the stub Triton launches must match the interpreter that runs the models, must
find this environment's numpy, and must load this interpreter's libpython. Three facts,
measured on the CPU and on an H200, follow from that:

* the stub for ``sys.version_info`` must sit beside ``libtriton_python.so``;
* this environment's ``bin`` must come first on ``PATH``;
* ``sysconfig.get_config_var("LIBDIR")`` must be on ``LD_LIBRARY_PATH``.

The stub finds the wheel's bundled libraries (``nvidia_pytriton.libs``) through an RPATH
relative to where the wheel put it, so a copy of the stub needs that folder on
``LD_LIBRARY_PATH`` too.

Rather than write into the installed wheel, the backend is assembled once in a private
directory and passed to the server with ``--backend-directory``.
"""

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, Optional

from merlin_t4r_ops.errors import ServerStartError

__all__ = [
    "tritonserver_executable", "backend_directory", "server_environment", "stub_threads",
    "put_scripts_on_path",
]


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise ServerStartError(
            "tritonserver comes from the 'nvidia-pytriton' wheel, which is not installed: "
            "pip install nvidia-pytriton"
        ) from exc
    return Path(pytriton.__file__).parent / "tritonserver"


def tritonserver_executable() -> Path:
    """Path of the real ``tritonserver`` binary inside the ``nvidia-pytriton`` wheel."""
    binary = _pytriton_root() / "bin" / "tritonserver"
    if not binary.is_file():
        raise ServerStartError(f"expected the tritonserver binary at {binary}, found nothing")
    return binary


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def backend_directory(cache_dir: Optional[Path] = None) -> Path:
    """A backend directory whose ``python`` backend carries the stub for this interpreter.

    Built once per interpreter version under ``cache_dir`` (default: the user cache) and
    reused; the directory is built beside its final place and renamed, so that two servers
    started at once never see half of it.
    """
    source = _pytriton_root()
    stub = source / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerStartError(
            f"nvidia-pytriton ships no Python backend stub for Python {_python_tag()} "
            f"(looked for {stub})"
        )
    cache_dir = Path(
        cache_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    ) / "merlin-t4r-ops"
    target = cache_dir / f"triton-backends-py{_python_tag()}-{stub.stat().st_size}"
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".backends-"))
    python_backend = staging / "python"
    shutil.copytree(source / "backends" / "python", python_backend,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    try:
        os.rename(staging, target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
    return target


def server_environment(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment ``tritonserver`` needs so that its Python stubs run this interpreter."""
    env = dict(os.environ if base is None else base)
    env_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([env_bin, env.get("PATH", "")])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    bundled = str(_pytriton_root().parent.parent / "nvidia_pytriton.libs")
    ld_paths = [p for p in [libdir, bundled, env.get("LD_LIBRARY_PATH", "")] if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld_paths)
    env.setdefault("OMP_NUM_THREADS", str(stub_threads()))
    return env


def stub_threads(cpus: Optional[int] = None) -> int:
    """Intra-op torch threads for each Python stub: a quarter of the cores, 1 to 4.

    One model instance runs one request at a time, and the stub shares the cores with
    tritonserver's own threads, the other stubs and, on one machine, the clients. An OpenMP
    team larger than the cores left to it spins at its barriers while its members are
    preempted: on two cores, two threads made the batch-1 forward of a small XLNet 4 to 15
    times slower under load (p50 10 ms -> 60-140 ms) than one thread. ``OMP_NUM_THREADS``
    in the environment wins over this default.
    """
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(4, cpus // 4))


def put_scripts_on_path(environ=os.environ) -> None:
    """Append this environment's scripts folder to ``PATH`` when it holds our ``tritonserver``.

    Merlin's ``run_triton_server`` runs ``shutil.which("tritonserver")``, looked up when
    ``merlin.systems.triton.utils`` is imported: from a venv that is not activated
    (``.venv/bin/python script.py``) it found nothing and failed. Appended, not prepended:
    a ``tritonserver`` already on ``PATH`` (an NGC container's) still wins.
    """
    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "tritonserver").is_file():
        return
    parts = [part for part in environ.get("PATH", "").split(os.pathsep) if part]
    if scripts not in parts:
        environ["PATH"] = os.pathsep.join([*parts, scripts])
