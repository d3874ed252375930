"""Run under ``torchrun --max-restarts=1`` by tests/test_training_faults.py.

Trains with checkpoints and ``resume=True``. With ``--kill-rank R --kill-after K`` rank R
SIGKILLs itself once, after epoch K: torchrun then restarts the whole world, which resumes from
the last checkpoint. A marker file makes the kill happen on the first attempt only.
"""

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402

from merlin_t4r_ops.training import fit, resolve_strategy  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-after", type=int, default=-1)
    args = parser.parse_args()

    state = resolve_strategy("ddp")
    marker = os.path.join(args.out, "killed-once")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def kill_once(entry):
        if (state.rank == args.kill_rank and entry["epoch"] == args.kill_after
                and not os.path.exists(marker)):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, like a preempted node

    model = factories.build_model("next-item", seed=0)
    fit(model, args.train, epochs=args.epochs, batch_size=16, strategy=state, seed=3,
        checkpoint_dir=os.path.join(args.out, "ckpt"), resume=True, progress=False,
        callbacks=[kill_once])
    torch.save(model.state_dict(), os.path.join(args.out, f"rank{state.rank}.pt"))
    if state.is_main_process:
        with open(os.path.join(args.out, "attempt"), "w") as stream:
            stream.write(attempt)


if __name__ == "__main__":
    main()
