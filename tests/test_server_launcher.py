"""The launcher binds loopback, picks free ports, and leaves no process behind."""

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
from merlin.systems.dag import Ensemble

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch, ServerStartError
from merlin_t4r_ops.serving import triton_server
from merlin_t4r_ops.serving.client import infer_dataframe
from merlin_t4r_ops.serving.server import free_port

_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@pytest.fixture(scope="module")
def small_repository(tmp_path_factory):
    model = factories.binary_model(seed=31)
    path = tmp_path_factory.mktemp("small_repo")
    Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
             model.input_schema).export(str(path))
    return model, path


def _listening_addresses(pid):
    addresses = set()
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                address = ipaddress.ip_address(conn.laddr.ip)
                # gRPC listens on an IPv6 socket with the IPv4-mapped loopback address.
                addresses.add(str(getattr(address, "ipv4_mapped", None) or address))
    return addresses


def test_serves_on_loopback_and_leaves_no_orphans(small_repository):
    model, path = small_repository
    with triton_server(path) as server:
        assert server.grpc_url.startswith("127.0.0.1:")
        assert server.http_url.startswith("127.0.0.1:")
        assert _listening_addresses(server.process.pid) == {"127.0.0.1"}
        stubs = psutil.Process(server.process.pid).children(recursive=True)
        assert stubs, "the Python backend should run the ensemble in a stub process"
        df = factories.random_sessions(5, np.random.default_rng(0))
        got = infer_dataframe(server.client(), df)["click/binary_classification_task"]
        np.testing.assert_allclose(got, factories.eager_scores(model, df).reshape(-1),
                                   rtol=1e-5, atol=1e-6)
        # Prometheus metrics are on, on loopback (the listening addresses above say only there).
        assert server.metrics_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.metrics_url, timeout=30) as page:
            assert 'nv_inference_request_success{model="executor_model"' in page.read().decode()
        pids = [server.process.pid, *[p.pid for p in stubs]]
    time.sleep(0.5)
    assert [pid for pid in pids if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE] == []


def test_missing_repository_is_refused():
    with pytest.raises(ServerStartError, match=r"model_repository '/nonexistent/repo' is not a"):
        with triton_server("/nonexistent/repo"):
            pass


def test_tritonserver_on_path_works_with_merlins_own_launcher(small_repository):
    from merlin.systems.triton.utils import run_triton_server

    model, path = small_repository
    assert os.path.dirname(shutil.which("tritonserver")) == os.path.dirname(sys.executable)
    port = free_port()
    with run_triton_server(str(path), grpc_port=port) as client:
        # The session's shared servers are children of this process too: take Merlin's.
        (server,) = [p for p in psutil.Process().children(recursive=True)
                     if p.name() == "tritonserver" and f"--grpc-port={port}" in p.cmdline()]
        # Merlin asks for gRPC on "localhost" and says nothing of HTTP and metrics.
        assert _listening_addresses(server.pid) <= {"127.0.0.1", "::1"}
        df = factories.random_sessions(3, np.random.default_rng(1))
        got = infer_dataframe(client, df)["click/binary_classification_task"]
        np.testing.assert_allclose(got, factories.eager_scores(model, df).reshape(-1),
                                   rtol=1e-5, atol=1e-6)


def test_cli_serves_in_the_foreground_until_interrupted(small_repository):
    import tritonclient.grpc as grpcclient

    _, path = small_repository
    port = free_port()
    http = free_port(avoid={port})
    process = subprocess.Popen(
        [shutil.which("merlin-t4r-serve"), str(path), "--grpc-port", str(port),
         "--http-port", str(http)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        ready = False
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            while time.monotonic() < deadline and process.poll() is None and not ready:
                try:
                    ready = client.is_server_ready()
                except Exception:  # not listening yet
                    time.sleep(0.3)
        assert ready, process.stdout.read().decode(errors="replace")[-3000:]
    finally:
        os.killpg(process.pid, 2)
        process.wait(60)
    assert process.returncode == 0


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port_is_free(port):
    """Whether a new server could listen there: SO_REUSEADDR, as servers bind, so that the
    killed server's closed connections (TIME_WAIT, 60 s) do not count; a listener still does."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_server_and_stubs_die_with_a_launcher_killed_by_sigkill(small_repository):
    """SIGKILL leaves the launcher no chance to clean up: the kernel must end the server."""
    _, path = small_repository
    script = Path(__file__).parent / "serving_scripts" / "launch_and_wait.py"
    launcher = subprocess.Popen([sys.executable, str(script), str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        assert line, f"the launcher printed nothing; its stderr:\n{launcher.stderr.read()[-3000:]}"
        started = json.loads(line)
        assert started["stubs"], "the Python backend should run the ensemble in a stub process"
        assert _alive(started["server"]), "the server died with the thread that started it"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
    pids = [started["server"], *started["stubs"]]
    killed = time.monotonic()
    deadline = killed + 10
    while time.monotonic() < deadline and (
            any(map(_alive, pids)) or not all(map(_port_is_free, started["ports"]))):
        time.sleep(0.2)
    try:
        assert [pid for pid in pids if _alive(pid)] == [], "outlived its launcher"
        assert all(map(_port_is_free, started["ports"]))
        print(f"\nserver and {len(started['stubs'])} stub(s) gone, ports free, "
              f"{time.monotonic() - killed:.1f} s after SIGKILL of the launcher")
    finally:  # never leave them behind, whatever the outcome
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_a_failed_start_leads_with_the_failing_model_and_file(tmp_path):
    model = factories.binary_model(seed=32)
    Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
             model.input_schema).export(str(tmp_path))
    weights = next(tmp_path.glob("executor_model/1/ensemble/t4r_model_*/weights.pt"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ServerStartError) as caught:
        with triton_server(tmp_path, timeout=180):
            pass
    lines = str(caught.value).splitlines()
    assert re.fullmatch(
        r"model 'executor_model' \(version 1\) failed to load: .*ArtifactError: "
        + re.escape(str(weights)) + r" has SHA-256 [0-9a-f]{64}, the manifest expects "
        r"[0-9a-f]{64}: the file was changed after export", lines[0]), lines[0]
    assert any(re.fullmatch(r"tritonserver exited with code 1 before it was ready\. "
                            r"Its full log \(.*\):", line) for line in lines[1:12])


def test_a_start_that_fails_outside_the_models_leads_with_tritons_error():
    from merlin_t4r_ops.serving.triton_log import failure_causes

    log = (  # the end of a log whose gRPC port was taken, abridged
        'E1203 13:14:24.021256 8439 server.cc:241] "CudaDriverHelper has not been initialized."\n'
        'I1203 13:14:38.771211 8439 model_lifecycle.cc:839] "successfully loaded \'m\'"\n'
        "E1203 13:14:38.772684706    8439 chttp2_server.cc:1060]  UNKNOWN:No address added\n"
        'E1203 13:14:38.778314 8439 main.cc:245] "failed to start GRPC service: Unavailable - '
        "Socket '127.0.0.1:39153' already in use \"\n"
    )
    assert failure_causes(log) == [
        "failed to start GRPC service: Unavailable - Socket '127.0.0.1:39153' already in use"]
    assert failure_causes("I1203 1:2:3.4 5 a.cc:1] \"fine\"\n") == []


def test_merlins_launcher_works_from_a_venv_that_is_not_activated(small_repository):
    """``.venv/bin/python script.py`` with the venv's bin off PATH: importing this package
    lets Merlin's ``run_triton_server`` find the ``tritonserver`` shim."""
    _, path = small_repository
    script = (
        "import merlin_t4r_ops\n"
        "from merlin.systems.triton.utils import run_triton_server\n"
        "from merlin_t4r_ops.serving.server import free_port\n"
        f"with run_triton_server({str(path)!r}, grpc_port=free_port()) as client:\n"
        "    print('ready', client.is_model_ready('executor_model'))\n"
    )
    environ = {**os.environ, "PATH": "/usr/bin:/bin"}
    environ.pop("VIRTUAL_ENV", None)
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True,
                          text=True, timeout=400)
    assert "ready True" in done.stdout, done.stderr[-3000:]


def test_free_port_never_gives_a_port_to_avoid():
    """The OS may hand a just-released port out again: a server's HTTP and metrics ports came
    out equal once in CI, and tritonserver refused to start."""
    taken = set()
    for _ in range(50):
        port = free_port(avoid=taken)
        assert port not in taken
        taken.add(port)


@pytest.mark.skipif(not os.path.exists(_PORT_RANGE), reason="needs Linux's ephemeral port range")
def test_free_port_keeps_asking_until_the_port_is_not_one_to_avoid():
    """Every ephemeral port but 1,000 avoided: on Linux's default range the OS's pick falls
    outside them 96 times in 100, so a free_port that ignored ``avoid`` fails here (the test
    above would pass it: the OS rarely repeats a port)."""
    low, high = map(int, Path(_PORT_RANGE).read_text().split())
    allowed = set(range(low, high + 1)[-1000:])
    avoid = set(range(1, 65536)) - allowed
    for _ in range(5):
        assert free_port(avoid=avoid) in allowed
