"""Training throughput of ``merlin_t4r_ops.training.fit``: single device vs DataParallel vs DDP.

Measures samples/s and the final training loss of each strategy on synthetic
sessions, for a next-item XLNet and an XLNet binary classifier, over whatever
GPUs the machine has, and prints a markdown table. DDP runs relaunch this
script under ``torch.distributed.run`` (one process per GPU, nccl; or two gloo
processes on a CPU-only machine), so no process manager is involved.

Usage::

    python benchmarks/training_strategies.py                       # defaults for this machine
    python benchmarks/training_strategies.py --d-model 128 --n-layer 2 --rows 200000 --items 50000
    python benchmarks/training_strategies.py --strategies single,ddp --tasks next-item

Notes
-----
``--batch-size`` is per device: DDP and DataParallel with N GPUs step on
N x batch examples, so their final loss after the same number of epochs is not
directly comparable with one device's (N times fewer steps). samples/s leaves
out the first epoch (warm-up) when ``--epochs`` > 1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The synthetic-data/model factory is shared with the tests.
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def parse_args(argv=None):
    import torch

    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="next-item,binary", help="comma list of next-item,binary")
    p.add_argument("--strategies", default="single,dp,ddp", help="comma list of single,dp,ddp")
    p.add_argument("--d-model", type=int, default=128 if gpu else 32)
    p.add_argument("--n-layer", type=int, default=2 if gpu else 1)
    p.add_argument("--rows", type=int, default=100_000 if gpu else 2_000)
    p.add_argument("--items", type=int, default=20_000 if gpu else 500)
    p.add_argument("--batch-size", type=int, default=256 if gpu else 64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--nproc", type=int, default=None, help="DDP processes (default: GPUs, or 2 on CPU)")
    p.add_argument("--amp", action="store_true", help="autocast fp16 (GPU only)")
    p.add_argument("--data", default=None, help="reuse a data directory (else a temp one)")
    p.add_argument("--json", default=None, help="also write the results here")
    # Internal: set when this script relaunches itself under torchrun.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_fit(args, task, strategy, data_dir):
    """One fit() call; returns the result row (meaningful on the main process)."""
    import t4r_training_factories as factories

    from merlin_t4r_ops.training import fit, resolve_strategy

    state = resolve_strategy(strategy)
    schema = factories.session_schema(args.items)
    model = factories.build_model(task, d_model=args.d_model, n_layer=args.n_layer, schema=schema, seed=0)
    history = fit(
        model,
        os.path.join(data_dir, "train"),
        epochs=args.epochs,
        batch_size=args.batch_size,
        strategy=state,
        seed=0,
        amp=args.amp,
        progress=False,
    )
    timed = history[1:] if len(history) > 1 else history
    samples = sum(h["train_samples"] for h in timed)
    seconds = sum(h["train_seconds"] for h in timed)
    devices = state.world_size * state.n_devices  # GPUs under dp, processes under ddp
    return {
        "task": task,
        "strategy": state.strategy,
        "processes": state.world_size,
        "devices": devices,
        "device": state.device.type,
        "samples_per_s": samples / seconds if seconds else float("nan"),
        "final_loss": history[-1]["train_loss"],
        "params": sum(p.numel() for p in model.parameters()),
    }


def worker(args):
    import torch.distributed as dist

    row = run_fit(args, args.task, "ddp", args.data)
    if dist.get_rank() == 0:
        with open(args.result, "w") as fh:
            json.dump(row, fh)
    dist.destroy_process_group()


def run_ddp(args, task, data_dir, nproc, gpu):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result = fh.name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        os.path.abspath(__file__), "--worker", "--task", task, "--result", result, "--data", data_dir,
        "--d-model", str(args.d_model), "--n-layer", str(args.n_layer), "--items", str(args.items),
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
    ] + (["--amp"] if args.amp else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    if not gpu:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // nproc))
    subprocess.run(cmd, env=env, check=True)
    with open(result) as fh:
        row = json.load(fh)
    os.unlink(result)
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)

    import t4r_training_factories as factories
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = n_gpus > 0
    data_dir = args.data or tempfile.mkdtemp(prefix="t4r-bench-")
    if not os.path.isdir(os.path.join(data_dir, "train")):
        nproc_hint = args.nproc or max(n_gpus, 2)
        # Several files, as a dataset usually comes; shards are balanced by rows anyway.
        factories.write_sessions(
            os.path.join(data_dir, "train"), args.rows, seed=0, n_files=2 * nproc_hint, n_items=args.items
        )
    rows, skipped = [], []
    for task in args.tasks.split(","):
        for strategy in args.strategies.split(","):
            if strategy == "single":
                rows.append(run_fit(args, task, "single", data_dir))
            elif strategy == "dp":
                if n_gpus < 2:
                    skipped.append(f"{task}/dp: needs 2+ GPUs, found {n_gpus}")
                    continue
                rows.append(run_fit(args, task, "dp", data_dir))
            elif strategy == "ddp":
                nproc = args.nproc or (n_gpus if gpu else 2)
                rows.append(run_ddp(args, task, data_dir, nproc, gpu))
            else:
                raise SystemExit(f"--strategies expects single, dp or ddp, got {strategy!r}")
            print(json.dumps(rows[-1]) if rows else "", flush=True)

    print()
    print(
        f"d_model={args.d_model} n_layer={args.n_layer} rows={args.rows} items={args.items} "
        f"batch/device={args.batch_size} epochs={args.epochs} amp={args.amp} "
        f"({n_gpus} GPU(s){', CPU fallback' if not gpu else ''})"
    )
    print()
    print("| task | strategy | processes | devices | samples/s | final train loss |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['task']} | {r['strategy']} | {r['processes']} | {r['devices']} {r['device']} "
            f"| {r['samples_per_s']:.0f} | {r['final_loss']:.4f} |"
        )
    for line in skipped:
        print(f"\nskipped {line}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "skipped": skipped}, fh, indent=2)


if __name__ == "__main__":
    main()
