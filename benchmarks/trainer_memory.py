"""Peak memory per rank of ``Trainer.evaluate()`` and ``Trainer.predict()`` under DDP.

Two gloo ranks on this machine (``torch.distributed.run --nproc_per_node=2``) evaluate
and predict with a next-item model over a large catalogue. Each rank runs
``tests/trainer_scripts/ddp_predict.py``, which measures, per phase, the peak RSS
(sampled every millisecond) and the peak of Python allocations (``tracemalloc``: the
pickles that object collectives send and receive) over what the rank held when the
phase began. The table shows what each phase costs each rank, side by side.

Usage::

    python benchmarks/trainer_memory.py                   # 50,000 items, 2,000 sessions
    python benchmarks/trainer_memory.py --items 50000 --sessions 400
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPTS = os.path.join(REPO, "tests", "trainer_scripts")
sys.path[:0] = [REPO, SCRIPTS]
PHASES = "evaluate,predict_top_k,predict_full"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(items, sessions, workdir):
    """Launch the two ranks; return their reports."""
    from trainer_common import write_sessions

    evals, _ = write_sessions(os.path.join(workdir, "eval"), sessions, 2, seed=2, n_items=items)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        os.path.join(SCRIPTS, "ddp_predict.py"), "--eval", *evals, "--out", workdir,
        "--items", str(items), "--phases", PHASES,
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    reports = []
    for rank in range(2):
        with open(os.path.join(workdir, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def table(reports, items, sessions):
    own_mb = sessions / 2 * 4 * (items + 1) / 1e6
    lines = [
        f"2 gloo ranks, {items:,} items, {sessions:,} sessions ({sessions // 2:,} per rank; "
        f"one rank's full scores: {own_mb:.1f} MB)",
        "",
        "| phase | rank | peak RSS over start | peak traced (Python) | predictions on this rank |",
        "|---|---:|---:|---:|---|",
    ]
    for phase in PHASES.split(","):
        for report in reports:
            entry = report["phases"][phase]
            held = entry.get("predictions", "-")
            if isinstance(held, dict):
                held = " + ".join("x".join(map(str, shape)) for shape in held["shapes"])
            lines.append(
                f"| {phase} | {report['rank']} | {entry['rss_peak_over_start'] / 1e6:.1f} MB | "
                f"{entry['traced_peak'] / 1e6:.1f} MB | {held} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--sessions", type=int, default=2_000)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        reports = run(opts.items, opts.sessions, workdir)
    print(table(reports, opts.items, opts.sessions))


if __name__ == "__main__":
    main()
