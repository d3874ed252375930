"""Launch a test script on 2 gloo ranks (127.0.0.1) with torch.distributed.run; read its results.

The script takes ``--out DIR`` and writes ``rank{R}.json`` and ``rank{R}.pt`` there
(:func:`write_rank_results`).
A run that hangs is stopped and fails its test.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(out, script, *script_args, nproc=2, timeout=240, results=True):
    """Run ``script`` under torchrun with a free port; return per-rank (json, weights) and stdout.

    ``results=False``: the script writes no rank files (a run stopped on purpose); ``[]``.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where a GPU exists
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", script, "--out", str(out), *map(str, script_args),
    ]
    # Logs go to files, not pipes: a hung worker would hold a pipe open.
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun stops its workers on SIGTERM (they run in sessions of their own).
            proc.terminate()
            proc.wait(timeout=60)
            pytest.fail(f"torchrun hung for {timeout} s and was stopped:\n"
                        f"{(out / 'stderr.log').read_text()[-6000:]}")
    stdout, stderr = (out / "stdout.log").read_text(), (out / "stderr.log").read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    ranks = []
    for r in range(nproc if results else 0):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            info = json.load(fh)
        ranks.append((info, torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True)))
    return ranks, stdout


def write_rank_results(out, rank, info, weights=None):
    """What a script run by :func:`torchrun` leaves for its test: ``rank{R}.json`` (``info``)
    and ``rank{R}.pt`` (``weights``, a state dict; empty when None)."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(info, fh)
    torch.save({} if weights is None else weights, os.path.join(out, f"rank{rank}.pt"))
