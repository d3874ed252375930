"""Training throughput: T4R's Trainer, our Trainer, ``fit`` and the model's own pace, side by side.

One T4R model (continuous projection, ``MLPBlock``, XLNet with 2 layers, causal next-item,
weight tying) on copies of T4R's packaged ``tabular_sequence_testing_data``, trained by
each path in turn, in rounds that alternate between the paths (odd rounds in reverse
order). Each path trains one epoch at most, stopped cleanly at ``--time-limit`` seconds of
timed steps; the first ``--warmup-steps`` steps are left out of the timing.

Paths (``benchmarks/training_paths.py``):

* ``t4r-trainer``: ``transformers4rec.torch.Trainer.train()``, T4R's own loader;
* ``trainer``: ``merlin_t4r_ops.training.Trainer.train()``;
* ``fit``, ``fit-fp16`` (``amp=True``), ``fit-bf16`` (``amp="bf16"``);
* ``t4r-loader``: a bare loop (forward, backward, Adam) over T4R's own loader;
* ``cached``: the same bare loop over batches already on the device: the model's own pace;
* optional: ``fit-compile``, ``fit-bf16-compile`` (``compile=True``), ``cached-fused``
  (``Adam(fused=True)``), ``cached-trainer-step`` (the cached loop with the step our Trainer
  takes by default: Hugging Face's ``AdamW`` as ``MultiTensorAdamW`` steps it, and
  ``clip_grad_norm_(1.0)``), ``cached-hf-step`` (the same with Hugging Face's own class, a
  loop per parameter, as T4R's Trainer steps),
  ``trainer-no-nan-filter`` (our Trainer with Hugging Face's
  ``logging_nan_inf_filter=False``: no read of each step's loss), ``trainer-fused`` (our
  Trainer with ``optim="adamw_torch_fused"`` in place of Hugging Face 4.30's ``adamw_hf``),
  ``trainer-fused-no-nan-filter`` (both), ``trainer-as-fit`` (both, and ``max_grad_norm=0``:
  no clipping, as ``fit``), ``trainer-cached`` (our Trainer, its defaults, over the
  cached batches: Hugging Face's loop without the loader, beside ``cached-trainer-step``),
  ``trainer-compile`` (our Trainer with Hugging Face's ``torch_compile``, mode
  ``"reduce-overhead"``, compiled as ``fit(compile=True)``), ``trainer-compile-mode-alone``
  (the same with the mode alone, as Hugging Face 4.30 hands it to accelerate).

The table gives the best samples/s of the rounds, the ratio to T4R's Trainer and to
``cached``, and the GPU's mean utilisation over the timed steps (NVML, sampled every
0.1 s; "-" without CUDA). A path this checkout cannot run (an option ``fit`` lacks,
fp16 on a CPU) is reported with the reason and skipped.

Usage::

    python benchmarks/training.py                          # tutorial preset on CUDA, else cpu
    python benchmarks/training.py --preset large --rounds 2 --json large.json
    python benchmarks/training.py --paths fit,cached,fit-compile,cached-fused
    python benchmarks/training.py --profile prof/ --profile-paths fit,cached --profile-steps 20
    python benchmarks/training.py --workers-sweep 0,2,4,8  # fit with each num_workers
"""

import argparse
import gc
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

PRESETS = {
    # T4R's tutorials' setting, and a larger one; data: T4R's 1,000 sessions copied.
    "tutorial": dict(batch_size=384, d_model=64, copies=64, time_limit=30.0, warmup_steps=5),
    "large": dict(batch_size=1024, d_model=128, copies=128, time_limit=30.0, warmup_steps=5),
    "cpu": dict(batch_size=32, d_model=16, copies=1, time_limit=6.0, warmup_steps=2),
}
COMPILE_WARMUP_STEPS = 10  # compilation and CUDA-graph recording happen in the first steps


def parse_args(argv=None):
    import torch

    from training_paths import DEFAULT_PATHS, PATHS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   default="tutorial" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds of timed steps per path per round (preset's by default)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--copies", type=int, default=None, help="copies of T4R's 1,000 sessions")
    p.add_argument("--num-workers", type=int, default=None,
                   help="loader workers for fit and our Trainer, where this checkout takes them")
    p.add_argument("--workers-sweep", default=None,
                   help="comma list of worker counts: one fit path per count")
    p.add_argument("--json", default=None, help="also write every round's figures here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the rounds, run torch.profiler over --profile-paths into DIR")
    p.add_argument("--profile-paths", default="fit,cached")
    p.add_argument("--profile-steps", type=int, default=10)
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_steps < 1 or args.time_limit <= 0 or args.rounds < 1:
        p.error(f"--warmup-steps and --rounds take 1 or more, --time-limit more than 0; got "
                f"{args.warmup_steps}, {args.rounds} and {args.time_limit}")
    for option in ("paths", "profile_paths"):
        unknown = [name for name in _names(getattr(args, option)) if name not in PATHS]
        if unknown:
            p.error(f"--{option.replace('_', '-')}: unknown {', '.join(unknown)}; "
                    f"choose from {', '.join(PATHS)}")
    return args


def _names(text):
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _runners(args):
    from training_paths import PATHS, workers_path

    runners = {name: PATHS[name] for name in _names(args.paths)}
    for workers in _names(args.workers_sweep):
        runners[f"fit[workers={int(workers)}]"] = workers_path(int(workers))
    return runners


def measure(name, runner, setting, args, sampler):
    """One path, one round: samples/s, timed steps, seconds, GPU utilisation, note."""
    import torch

    from training_paths import StepClock, Unsupported, process_settings_kept

    warmup = max(args.warmup_steps, COMPILE_WARMUP_STEPS if "compile" in name else 0)
    clock = StepClock(setting.batch_size, warmup, args.time_limit)
    note = ""
    sampler.start()
    try:
        with process_settings_kept():
            runner(setting, clock)
    except Unsupported as exc:
        note = f"skipped: {exc}"
    except Exception as exc:  # one path failing must not cost the others' figures
        note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        sampler.stop()
        gc.collect()  # passes left by an exception close their reading threads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not note and clock.timed_steps == 0:
        note = f"no timed step ({clock.steps} steps, warm-up {warmup})"
    if clock.done and not note:
        note = "cut at the time limit"
    return {
        "samples_per_s": clock.samples_per_s, "timed_steps": clock.timed_steps,
        "seconds": clock.seconds, "gpu_util": sampler.mean(clock.start, clock.end),
        "note": note,
    }


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def table(results):
    """Markdown table of the best round of each path, with its ratios."""
    best = {name: max((r for r in rounds if r["samples_per_s"]), default=rounds[-1],
                      key=lambda r: r["samples_per_s"] or 0) for name, rounds in results.items()}
    t4r = (best.get("t4r-trainer") or {}).get("samples_per_s")
    cached = (best.get("cached") or {}).get("samples_per_s")
    lines = ["| path | samples/s | / t4r-trainer | / cached | GPU util % | timed steps | rounds "
             "| note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in best.items():
        rate = row["samples_per_s"]
        measured = sum(1 for r in results[name] if r["samples_per_s"])
        lines.append(
            f"| {name} | {_fmt(rate, ',.0f')} | {_ratio(rate, t4r)} | {_ratio(rate, cached)} "
            f"| {_fmt(row['gpu_util'], '.1f')} | {row['timed_steps']} "
            f"| {measured}/{len(results[name])} | {row['note']} |"
        )
    return "\n".join(lines)


def _ratio(value, reference):
    return "-" if not value or not reference else f"{value / reference:.2f}"


def profile(runners, setting, args):
    """torch.profiler over ``--profile-steps`` steps of each ``--profile-paths`` path."""
    import torch
    from torch.profiler import ProfilerActivity, schedule

    from training_paths import PATHS, StepClock, process_settings_kept

    os.makedirs(args.profile, exist_ok=True)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if setting.device.type == "cuda" else [])
    sort_by = "self_cuda_time_total" if setting.device.type == "cuda" else "self_cpu_time_total"
    for name in _names(args.profile_paths):
        runner = runners.get(name) or PATHS[name]
        wait = max(args.warmup_steps, COMPILE_WARMUP_STEPS if "compile" in name else 0)
        with torch.profiler.profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=1, active=args.profile_steps, repeat=1),
        ) as prof:
            clock = StepClock(setting.batch_size, 1, float("inf"),
                              max_steps=wait + 1 + args.profile_steps, on_step=prof.step)
            with process_settings_kept():
                runner(setting, clock)
        text = prof.key_averages().table(sort_by=sort_by, row_limit=40)
        path = os.path.join(args.profile, f"{name}.txt")
        with open(path, "w") as fh:
            fh.write(f"{name}: {args.profile_steps} steps after {wait + 1}, sorted by {sort_by}\n")
            fh.write(text)
        prof.export_chrome_trace(os.path.join(args.profile, f"{name}.trace.json"))
        print(f"\nprofile of {name} ({args.profile_steps} steps): {path}")
        print(f"{name}, a step: {step_summary(prof.key_averages(), args.profile_steps)}")
        print("\n".join(text.splitlines()[:16]), flush=True)


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def step_summary(averages, steps):
    """Host time, aten ops, kernels, kernel time and host syncs a step, from key_averages().

    The rows that say why one path's step is slower than another's: a host-bound step has
    more host time than kernel time, and more aten ops (autocast's casts among them) or
    syncs cost it host time, not GPU time. aten ops count nested calls too.
    """
    from torch.autograd import DeviceType

    host_steps = [r for r in averages
                  if r.key.startswith("ProfilerStep") and r.device_type == DeviceType.CPU]
    steps = sum(r.count for r in host_steps) or steps  # the steps recorded
    host_ms = sum(r.cpu_time_total for r in host_steps) / 1e3
    aten = sum(r.count for r in averages if r.key.startswith("aten::"))
    # GPU rows of record_function ranges (ProfilerStep#, Optimizer.step#...) span kernels
    # that are rows of their own: counting them would count those kernels twice.
    kernels = [r for r in averages if r.device_type == DeviceType.CUDA
               and not getattr(r, "is_user_annotation", False)]
    kernel_ms = sum(r.self_device_time_total for r in kernels) / 1e3
    syncs = sum(r.count for r in averages if r.key in _SYNCS)
    return (f"host {host_ms / steps:.2f} ms, {aten / steps:.0f} aten ops, "
            f"{sum(r.count for r in kernels) / steps:.0f} kernels and copies, "
            f"kernel time {kernel_ms / steps:.2f} ms, {syncs / steps:.1f} host syncs")


def main(argv=None):
    args = parse_args(argv)

    import torch

    from gpu_utilisation import UtilisationSampler
    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from training_paths import Setting, build_model, write_copies

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    scratch = tempfile.mkdtemp(prefix="t4r-training-bench-")
    files = write_copies(os.path.join(scratch, "data"), args.copies)
    setting = Setting(files=files, batch_size=args.batch_size, d_model=args.d_model,
                      device=device, scratch=os.path.join(scratch, "out"),
                      num_workers=args.num_workers)
    sampler = UtilisationSampler(device.index if device.type == "cuda" else None)
    rows = 1000 * args.copies
    params = sum(p.numel() for p in build_model(args.d_model).parameters())
    print(f"preset {args.preset}: batch {args.batch_size}, d_model {args.d_model}, XLNet 2 layers, "
          f"{params:,} parameters; {rows:,} sessions ({args.copies} copies), "
          f"{rows // args.batch_size} steps an epoch; {args.rounds} rounds, time limit "
          f"{args.time_limit:g} s, warm-up {args.warmup_steps} steps")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, GPU sampling "
          f"{'on' if sampler.available else 'off'}", flush=True)

    runners = _runners(args)
    results = {name: [] for name in runners}
    skipped = set()
    with cpu_datasets_quiet():
        for round_ in range(args.rounds):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
            for name in order:
                if name in skipped:
                    continue
                result = measure(name, runners[name], setting, args, sampler)
                results[name].append(result)
                if result["note"].startswith("skipped"):
                    skipped.add(name)
                print(f"round {round_ + 1} {name}: {_fmt(result['samples_per_s'], ',.0f')} "
                      f"samples/s, {result['timed_steps']} steps in "
                      f"{_fmt(result['seconds'], '.2f')} s, GPU "
                      f"{_fmt(result['gpu_util'], '.1f')}% {result['note']}", flush=True)
        print()
        print(table(results), flush=True)
        if args.profile:
            profile(runners, setting, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "device": str(device), "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
