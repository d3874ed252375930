"""Servers bind loopback unless told otherwise, and warn, naming Triton's advisories, when told.

No test here starts a server that listens beyond loopback: the CLI cases hand tritonserver
a flag it refuses, so it exits before it binds anything.
"""

import shutil
import subprocess
import warnings

import pytest

from merlin_t4r_ops.errors import ExposedServerWarning
from merlin_t4r_ops.serving.cli import HOST_VARIABLE, shim_command
from merlin_t4r_ops.serving.server import server_command

ADVISORIES = (r"CVE-2025-23319.*CVE-2025-23320.*CVE-2025-23334.*CVE-2025-23310.*"
              r"CVE-2025-23311.*Triton 25\.07 or newer")
EXPOSED = ["0.0.0.0", "::", "10.20.30.40"]
LOOPBACKS = ["127.0.0.1", "::1", "localhost"]


def _addresses(command):
    return {flag: arg.split("=", 1)[1] for arg in command for flag in
            ("--http-address", "--grpc-address", "--metrics-address")
            if arg.startswith(flag + "=")}


@pytest.mark.parametrize("host", EXPOSED)
def test_launcher_warns_naming_the_advisories_beyond_loopback(tmp_path, host):
    with pytest.warns(ExposedServerWarning, match=rf"listen on '{host}'.*{ADVISORIES}"):
        command = server_command(tmp_path, host=host, grpc_port=1, http_port=2)
    assert _addresses(command) == {"--http-address": host, "--grpc-address": host}


@pytest.mark.parametrize("host", LOOPBACKS)
def test_launcher_is_quiet_on_loopback(tmp_path, host):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExposedServerWarning)
        server_command(tmp_path, host=host, grpc_port=1, http_port=2)


def test_shim_binds_every_endpoint_to_loopback_by_default():
    # What Merlin's run_triton_server passes (merlin-systems 23.8).
    merlin_args = ["--model-repository", "/repo", "--backend-config=tensorflow,version=2",
                   "--grpc-port=8001", "--grpc-address=localhost"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExposedServerWarning)
        command = shim_command(merlin_args, environ={})
    assert command[1:1 + len(merlin_args)] == merlin_args
    assert _addresses(command) == {"--http-address": "127.0.0.1",
                                   "--grpc-address": "localhost",
                                   "--metrics-address": "127.0.0.1"}


@pytest.mark.parametrize("how", ["--host flag", "--host=flag", "environment"])
def test_shim_opens_up_only_when_asked_and_warns(how):
    args, environ = ["--model-repository", "/repo", "--host-policy=numa,cpu-cores=0"], {}
    if how == "--host flag":
        args += ["--host", "0.0.0.0"]
    elif how == "--host=flag":
        args += ["--host=0.0.0.0"]
    else:
        environ[HOST_VARIABLE] = "0.0.0.0"
    with pytest.warns(ExposedServerWarning, match=ADVISORIES):
        command = shim_command(args, environ=environ)
    assert set(_addresses(command).values()) == {"0.0.0.0"}
    assert "--host" not in command and "--host=0.0.0.0" not in command  # not Triton's flag
    assert "--host-policy=numa,cpu-cores=0" in command


def test_an_explicit_triton_address_wins_and_warns():
    with pytest.warns(ExposedServerWarning, match=r"listen on '0.0.0.0'"):
        command = shim_command(["--model-repository", "/r", "--http-address", "0.0.0.0"],
                               environ={})
    assert command.count("--http-address") == 1
    assert command[command.index("--http-address") + 1] == "0.0.0.0"
    assert _addresses(command) == {"--grpc-address": "127.0.0.1",
                                   "--metrics-address": "127.0.0.1"}


@pytest.mark.parametrize("executable", ["merlin-t4r-serve", "tritonserver"])
def test_command_lines_warn_on_stderr_before_the_server_starts(tmp_path, executable):
    repository = ([str(tmp_path)] if executable == "merlin-t4r-serve"
                  else ["--model-repository", str(tmp_path)])
    done = subprocess.run(
        [shutil.which(executable), *repository, "--host", "0.0.0.0", "--refused-by-triton"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0  # tritonserver refused the flag: nothing was bound
    assert "unrecognized option '--refused-by-triton'" in done.stderr
    assert "ExposedServerWarning: tritonserver will listen on '0.0.0.0'" in done.stderr
    assert "CVE-2025-23319" in done.stderr and "Triton 25.07 or newer" in done.stderr


@pytest.mark.parametrize("extra", [["--http-address=0.0.0.0"], ["--grpc-address", "0.0.0.0"],
                                   ["--metrics-address=0.0.0.0"]])
def test_an_address_in_the_launchers_extra_args_is_checked(tmp_path, extra):
    """tritonserver binds the last of a repeated flag: the caller's, after the launcher's."""
    with pytest.warns(ExposedServerWarning, match=rf"listen on '0.0.0.0'.*{ADVISORIES}"):
        command = server_command(tmp_path, host="127.0.0.1", grpc_port=1, http_port=2,
                                 metrics_port=3, extra_args=extra)
    assert command[-len(extra):] == extra


def test_metrics_are_on_and_on_loopback_whatever_the_host(tmp_path):
    with pytest.warns(ExposedServerWarning, match=r"listen on '10.20.30.40'") as caught:
        command = server_command(tmp_path, host="10.20.30.40", grpc_port=1, http_port=2,
                                 metrics_port=3)
    assert len(caught) == 1
    assert "--allow-metrics=true" in command and "--metrics-port=3" in command
    assert _addresses(command)["--metrics-address"] == "127.0.0.1"


def test_the_serve_cli_checks_the_flags_it_passes_through(tmp_path):
    """``merlin-t4r-serve REPO --http-address=0.0.0.0``: the flag goes to tritonserver, and
    warns; tritonserver then refuses the next flag, so nothing is bound."""
    done = subprocess.run(
        [shutil.which("merlin-t4r-serve"), str(tmp_path), "--http-address=0.0.0.0",
         "--refused-by-triton"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert "unrecognized option '--refused-by-triton'" in done.stderr
    assert "ExposedServerWarning: tritonserver will listen on '0.0.0.0'" in done.stderr
