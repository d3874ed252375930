"""Start the real ``tritonserver`` on a model repository and stop it, stubs and all."""

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

from merlin_t4r_ops.errors import ServerStartError
from merlin_t4r_ops.serving.triton_env import (
    backend_directory,
    server_environment,
    tritonserver_executable,
)

__all__ = ["TritonServer", "triton_server", "server_command", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_command(
    model_repository, *, host: str, grpc_port: int, http_port: int, extra_args=()
) -> List[str]:
    """The ``tritonserver`` command line for a repository, bound to ``host``."""
    return [
        str(tritonserver_executable()),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={backend_directory()}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        # The metrics endpoint would take a fixed port (8002) and collide between servers.
        "--allow-metrics=false",
        *extra_args,
    ]


@dataclass
class TritonServer:
    """A running ``tritonserver``: its addresses, its process and its log."""

    process: subprocess.Popen
    grpc_url: str
    http_url: str
    log_path: Path
    _clients: list = field(default_factory=list, repr=False)

    def client(self):
        """A ``tritonclient.grpc.InferenceServerClient`` connected to this server."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        self._clients.append(client)
        return client

    def logs(self) -> str:
        """Everything the server has written so far."""
        return self.log_path.read_text(errors="replace")

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def wait_until_ready(self, timeout: float) -> None:
        """Block until the server and all its models are ready; raise with the log if not."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + timeout
        with grpcclient.InferenceServerClient(self.grpc_url) as probe:
            while time.monotonic() < deadline:
                if not self.is_alive():
                    raise ServerStartError(
                        f"tritonserver exited with code {self.process.returncode} before it was "
                        f"ready. Its log:\n{self.logs()}"
                    )
                with contextlib.suppress(InferenceServerException):
                    if probe.is_server_ready():
                        return
                time.sleep(0.2)
        raise ServerStartError(
            f"tritonserver was not ready after {timeout:.0f} s. Its log:\n{self.logs()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and every stub it started (they share its process group)."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Stubs can outlive a server that died abruptly; the group takes them too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


def start_server(
    model_repository,
    *,
    grpc_port: Optional[int] = None,
    http_port: Optional[int] = None,
    host: str = LOOPBACK,
    extra_args=(),
    log_path: Optional[Path] = None,
) -> TritonServer:
    """Start ``tritonserver`` in its own process group and return without waiting."""
    if not Path(model_repository).is_dir():
        raise ServerStartError(f"model_repository {model_repository!r} is not a directory")
    grpc_port = grpc_port or free_port(host)
    http_port = http_port or free_port(host)
    command = server_command(
        model_repository, host=host, grpc_port=grpc_port, http_port=http_port,
        extra_args=extra_args,
    )
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            env=server_environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return TritonServer(
        process=process,
        grpc_url=f"{host}:{grpc_port}",
        http_url=f"{host}:{http_port}",
        log_path=Path(log_path),
    )


@contextlib.contextmanager
def triton_server(
    model_repository,
    *,
    grpc_port: Optional[int] = None,
    http_port: Optional[int] = None,
    host: str = LOOPBACK,
    timeout: float = 180.0,
    extra_args=(),
) -> Iterator[TritonServer]:
    """Run ``tritonserver`` on ``model_repository`` for the duration of a ``with`` block.

    Parameters
    ----------
    model_repository : str or Path
        A Triton model repository, such as the folder ``Ensemble.export`` wrote.
    grpc_port, http_port : int, optional
        Ports to listen on; free ports are picked when omitted.
    host : str
        Address to bind. Loopback by default: expose a server on purpose, not by accident.
    timeout : float
        Seconds to wait for the server and all its models to become ready.
    extra_args : sequence of str
        Further ``tritonserver`` flags, e.g. ``["--log-verbose=1"]``.

    Yields
    ------
    TritonServer
        With ``grpc_url``, ``http_url`` (``"127.0.0.1:PORT"``), ``client()`` and ``logs()``.

    Raises
    ------
    ServerStartError
        When the server exits or is not ready in time; the message carries its log.
    """
    server = start_server(
        model_repository, grpc_port=grpc_port, http_port=http_port, host=host,
        extra_args=extra_args,
    )
    try:
        server.wait_until_ready(timeout)
        yield server
    finally:
        server.stop()
