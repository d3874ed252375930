"""Run by tests/test_training_checkpoint.py: train with checkpoints, SIGKILL itself after an epoch."""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402

from merlin_t4r_ops.training import fit  # noqa: E402
from merlin_t4r_ops.training.state import DistributedState  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--kill-after", type=int, required=True)
    args = parser.parse_args()

    import torch

    def kill(entry):
        if entry["epoch"] == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, like an OOM kill or preemption

    state = DistributedState("single", 0, 0, 1, torch.device("cpu"), "killed-run test")
    model = factories.build_model("next-item", masking="mlm", seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    fit(model, args.train, optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        epochs=args.epochs, strategy=state, seed=7, checkpoint_dir=args.checkpoint_dir,
        progress=False, callbacks=[kill])


if __name__ == "__main__":
    main()
