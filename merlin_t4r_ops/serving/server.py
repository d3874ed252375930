"""Start the real ``tritonserver`` on a model repository and stop it, stubs and all."""

import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Dict, Iterator, List, Optional, Tuple

import psutil

from merlin_t4r_ops.errors import ServerStartError
from merlin_t4r_ops.serving.binding import LOOPBACK, warn_for_addresses
from merlin_t4r_ops.serving.client import protocol_module
from merlin_t4r_ops.serving.lifetime import popen_tied_to_this_process
from merlin_t4r_ops.serving.triton_log import failure_causes
from merlin_t4r_ops.serving.triton_env import (
    backend_directory,
    server_environment,
    tritonserver_executable,
)

__all__ = ["TritonServer", "triton_server", "server_command", "server_ports", "free_port"]

LOGGER = logging.getLogger(__name__)


def free_port(host: str = LOOPBACK, avoid: Collection[int] = ()) -> int:
    """A TCP port that nothing listens on right now, and none of ``avoid``.

    The OS may hand a port it just handed out (and saw released) again: a server's HTTP and
    metrics ports came out equal once, and tritonserver refused to start.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def server_ports(host: str, grpc_port: Optional[int] = None, http_port: Optional[int] = None,
                 metrics_port: Optional[int] = None) -> Tuple[int, int, int]:
    """``(grpc, http, metrics)``: the given ports, and free ones, all distinct, for the rest
    (gRPC and HTTP on ``host``, metrics on loopback)."""
    given = {grpc_port, http_port, metrics_port}
    grpc_port = grpc_port or free_port(host, avoid=given)
    http_port = http_port or free_port(host, avoid=given | {grpc_port})
    metrics_port = metrics_port or free_port(avoid={grpc_port, http_port})
    return grpc_port, http_port, metrics_port


def server_command(
    model_repository, *, host: str, grpc_port: int, http_port: int,
    metrics_port: Optional[int] = None, extra_args=()
) -> List[str]:
    """The ``tritonserver`` command line for a repository, bound to ``host``.

    Prometheus metrics are served on 127.0.0.1 at ``metrics_port`` whatever ``host`` is
    (without a port, metrics are off). Warns
    (:class:`~merlin_t4r_ops.errors.ExposedServerWarning`) for every address that is not
    loopback, ``host`` or one that ``extra_args`` give (``--http-address=0.0.0.0``...).
    """
    metrics = (["--allow-metrics=false"] if metrics_port is None else
               ["--allow-metrics=true", f"--metrics-address={LOOPBACK}",
                f"--metrics-port={metrics_port}"])
    command = [
        str(tritonserver_executable()),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={backend_directory()}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        *metrics,
        # Explicit control with every model loaded at start: the same models as the default
        # mode, and a model whose stub died can be loaded again without a server restart.
        "--model-control-mode=explicit",
        "--load-model=*",
        *extra_args,
    ]
    warn_for_addresses(command)
    return command


@dataclass
class TritonServer:
    """A running ``tritonserver``: its addresses, its process and its log."""

    process: subprocess.Popen
    grpc_url: str
    http_url: str
    log_path: Path
    metrics_url: Optional[str] = None  # Prometheus text, http://127.0.0.1:PORT/metrics
    _clients: list = field(default_factory=list, repr=False)
    _handled_stubs: set = field(default_factory=set, repr=False)
    _stub_models: dict = field(default_factory=dict, repr=False)

    def client(self, protocol: str = "grpc"):
        """A ``tritonclient`` client of this server, closed when the server stops.

        Parameters
        ----------
        protocol : {"grpc", "http"}
            ``tritonclient.grpc`` on ``grpc_url``, or ``tritonclient.http`` on ``http_url``.
        """
        module = protocol_module(protocol)
        url = self.grpc_url if protocol == "grpc" else self.http_url
        client = module.InferenceServerClient(url)
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
                    raise self._start_error(
                        f"tritonserver exited with code {self.process.returncode} before it "
                        "was ready"
                    )
                with contextlib.suppress(InferenceServerException):
                    if probe.is_server_ready():
                        self.remember_stubs()
                        return
                time.sleep(0.2)
        raise self._start_error(f"tritonserver was not ready after {timeout:.0f} s")

    def _start_error(self, what: str) -> ServerStartError:
        """The cause first (the failing model and its error, from the log), then the log."""
        log = self.logs()
        causes = "".join(f"{cause}\n" for cause in failure_causes(log))
        return ServerStartError(f"{causes}{what}. Its full log ({self.log_path}):\n{log}")

    def remember_stubs(self) -> None:
        """Record which model each live stub serves: a dead stub's command line is gone."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for stub in psutil.Process(self.process.pid).children():
                if stub.pid in self._stub_models:
                    continue
                with contextlib.suppress(psutil.Error):
                    model_py = next((a for a in stub.cmdline() if a.endswith("model.py")), None)
                    if model_py:  # <repository>/<model name>/<version>/model.py
                        self._stub_models[stub.pid] = Path(model_py).parts[-3]

    def dead_stubs(self) -> Dict[str, List[int]]:
        """Models whose Python-backend stub died and was not reloaded yet, with the stubs' pids.

        Triton 2.51 keeps reporting such a model ready and answers each of its requests with
        "Stub process ... is not healthy", so liveness is read from the processes themselves.
        """
        dead: Dict[str, List[int]] = {}
        for pid, model in self._stub_models.items():
            if pid in self._handled_stubs:
                continue
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                dead.setdefault(model, []).append(pid)
        return dead

    def reload_model(self, name: str) -> None:
        """Load ``name`` again: Triton starts fresh stubs for it and returns once they are up."""
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            client.load_model(name)
        self.remember_stubs()

    def heal(self) -> List[str]:
        """Reload every model whose stub died; returns their names."""
        healed = []
        for name, pids in self.dead_stubs().items():
            self.reload_model(name)
            self._handled_stubs.update(pids)
            healed.append(name)
        return healed

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
    """Start ``tritonserver`` in its own process group and return without waiting.

    The server gets SIGKILL when this process dies, however it dies, and its Python stubs
    exit when they see their server gone: nothing keeps the ports or the GPU memory.
    """
    if not Path(model_repository).is_dir():
        raise ServerStartError(f"model_repository {model_repository!r} is not a directory")
    grpc_port, http_port, metrics_port = server_ports(host, grpc_port, http_port)
    command = server_command(
        model_repository, host=host, grpc_port=grpc_port, http_port=http_port,
        metrics_port=metrics_port, extra_args=extra_args,
    )
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        process = popen_tied_to_this_process(
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
        metrics_url=f"http://{LOOPBACK}:{metrics_port}/metrics",
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
    heal_interval: Optional[float] = None,
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
    heal_interval : float, optional
        When set, a watchdog thread checks the stubs this often and reloads any model whose
        stub died (:meth:`TritonServer.heal`). Without it, call ``heal()`` yourself.

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
    stopping = threading.Event()

    def watchdog():
        while not stopping.wait(heal_interval):
            try:
                healed = server.heal()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a failed reload
                LOGGER.warning("reloading a model whose stub died failed; retrying", exc_info=True)
            else:
                for name in healed:
                    LOGGER.warning("model %s lost its stub process and was reloaded", name)

    try:
        server.wait_until_ready(timeout)
        if heal_interval:
            threading.Thread(target=watchdog, name="triton-watchdog", daemon=True).start()
        yield server
    finally:
        stopping.set()
        server.stop()
