"""A DDP worker killed mid-run under ``torchrun --max-restarts=1`` finishes from its checkpoint."""

import os
import socket
import subprocess
import sys

import pytest
import torch

import t4r_training_factories as factories

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "training_scripts", "ddp_restart.py")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(out, train, *extra):
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{_free_port()}", SCRIPT,
               "--train", train, "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    log = out / "torchrun.log"
    # A file, not a pipe: workers that torchrun restarts keep the parent's descriptors.
    with open(log, "w") as stream:
        code = subprocess.call(command, env=env, stdout=stream, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, timeout=300)
    assert code == 0, log.read_text()[-5000:]


def test_killed_worker_restarts_and_matches_an_uninterrupted_run(tmp_path):
    train = factories.write_sessions(str(tmp_path / "train"), 128, seed=1)
    _torchrun(tmp_path / "clean", train)
    _torchrun(tmp_path / "killed", train, "--kill-rank", "1", "--kill-after", "1")

    assert (tmp_path / "killed" / "killed-once").exists()
    assert (tmp_path / "killed" / "attempt").read_text() == "1", "torchrun should have restarted"
    clean = torch.load(tmp_path / "clean" / "rank0.pt", weights_only=True)
    for rank in (0, 1):
        resumed = torch.load(tmp_path / "killed" / f"rank{rank}.pt", weights_only=True)
        for name, value in clean.items():
            torch.testing.assert_close(resumed[name], value, msg=f"rank {rank}: {name}")
