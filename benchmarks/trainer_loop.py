"""Hugging Face's training loop part by part: the host time each part of its step costs.

Our ``Trainer`` runs Hugging Face's loop (transformers 4.30) and accelerate's wrappers as
they are. What they add to the model's own step is host time, which a host-bound step pays
in full. cProfile overstates it for calls this small, so this script times each part alone,
unprofiled, on the objects of a real run: it trains the benchmark model with our
``Trainer`` for a few steps over batches already on the device, then times every part of
Hugging Face's step beside the bare call it wraps (best of 5 rounds of ``--calls`` calls,
the device synchronised around each call), and the model's own step in a bare loop.

    python benchmarks/trainer_loop.py                             # 384/d64 on CUDA, else CPU
    python benchmarks/trainer_loop.py --batch-size 1024 --d-model 128

On the CPU the optimizer and clipping rows include their arithmetic; only the differences
between a part and its bare call speak of the loop there.
"""

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import training_paths as paths  # noqa: E402


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=384 if cuda else 8)
    p.add_argument("--d-model", type=int, default=64 if cuda else 16)
    p.add_argument("--calls", type=int, default=200, help="calls a round, for each part")
    return p.parse_args(argv)


def host_us(fn, calls: int, before=None, rounds: int = 5) -> float:
    """Best mean over ``rounds`` of ``calls`` calls of ``fn``, in µs; ``before`` runs untimed."""
    best = float("inf")
    for _ in range(rounds):
        total = 0.0
        for _ in range(calls):
            if before is not None:
                before()
            paths._synchronize()
            start = time.perf_counter()
            fn()
            paths._synchronize()
            total += time.perf_counter() - start
        best = min(best, total / calls)
    return best * 1e6


def trained_trainer(setting):
    """Our Trainer after 20 steps over cached batches: its optimizer and scheduler prepared."""
    clock = paths.StepClock(setting.batch_size, 2, float("inf"), max_steps=20)
    return paths.train_on_cached_batches(setting, clock, 20)


def parts(trainer, model, batch):
    """(part of Hugging Face's step, its call, the bare call it wraps or None, needs grads)."""
    from accelerate.utils import is_lomo_available

    accelerator, optimizer = trainer.accelerator, trainer.optimizer
    bare_optimizer = getattr(optimizer, "optimizer", optimizer)
    args, state, control = trainer.args, trainer.state, trainer.control
    callbacks = trainer.callback_handler
    return [
        ("model.train() (every step)", model.train, None, False),
        ("model.zero_grad()", model.zero_grad,
         lambda: bare_optimizer.zero_grad(set_to_none=True), True),
        ("accelerator.clip_grad_norm_", lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0),
         lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), True),
        ("AcceleratedOptimizer.step()", optimizer.step, bare_optimizer.step, True),
        ("  of which is_lomo_available(), twice", lambda: (is_lomo_available(), is_lomo_available()),
         None, False),
        ("lr_scheduler.step()", trainer.lr_scheduler.step, None, False),
        ("callbacks on_step_begin + on_step_end",
         lambda: (callbacks.on_step_begin(args, state, control),
                  callbacks.on_step_end(args, state, control)), None, False),
        ("trainer._prepare_inputs(batch)", lambda: trainer._prepare_inputs(batch), None, False),
        ("accelerator.accumulate(model), entered",
         lambda: accelerator.accumulate(model).__enter__(), None, False),
    ]


def model_step_us(model, batches, calls: int) -> float:
    """The model's own step (forward, backward, Adam) in a bare loop, µs a step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = itertools.count()

    def step():
        paths._bare_step(model, optimizer, *batches[next(steps) % len(batches)])

    return host_us(step, max(10, calls // 10), rounds=3)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as scratch:
        files = paths.write_copies(scratch, 4)
        setting = paths.Setting(files=files, batch_size=args.batch_size, d_model=args.d_model,
                                device=device, scratch=scratch)
        trainer, model, batches = trained_trainer(setting)
        model.train()
        x, y = batches[0]
        model(x, targets=y, training=True)["loss"].backward()
        grads = [(p, p.grad) for p in model.parameters()]

        def with_grads():
            for parameter, grad in grads:
                parameter.grad = grad

        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        print(f"{name}; batch {args.batch_size}, d_model {args.d_model}; "
              f"{sum(1 for _ in model.modules())} modules, {len(grads)} parameters; "
              f"sync around a call alone: {host_us(lambda: None, args.calls):.1f} µs")
        print("| part of Hugging Face's step | µs | the bare call | µs | added |")
        print("|---|---:|---|---:|---:|")
        added_total = 0.0
        for label, call, bare, needs_grads in parts(trainer, model, batches[0]):
            before = with_grads if needs_grads else None
            cost = host_us(call, args.calls, before)
            bare_cost = host_us(bare, args.calls, before) if bare is not None else 0.0
            added = cost - bare_cost
            if not label.startswith(" "):  # a part of a row above is in that row already
                added_total += added
            bare_label = "-" if bare is None else "yes"
            print(f"| {label} | {cost:.1f} | {bare_label} | {bare_cost:.1f} | {added:.1f} |")
        with_grads()
        step = model_step_us(model, batches, args.calls)
        print(f"\nThe loop's parts add {added_total / 1e3:.3f} ms a step; the model's own step in a "
              f"bare loop takes {step / 1e3:.3f} ms: {added_total / step:.1%} of it.")


if __name__ == "__main__":
    main()
