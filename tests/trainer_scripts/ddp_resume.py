"""Run by ``torch.distributed.run`` from tests/test_trainer_resume.py: resume under DDP.

On T4R's packaged sessions (the first 320, 160 per rank, 10 batches of 16 per epoch)
each rank trains 2 epochs uninterrupted with a checkpoint every 5 steps, then resumes a
fresh model from checkpoint-5 (mid-epoch) and from checkpoint-10 (epoch boundary).
Each rank writes ``rank{R}.pt`` (``{run: state_dict}``) and ``rank{R}.json``.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import t4r_training_factories as factories  # noqa: E402
from trainer_common import make_args  # noqa: E402

from merlin_t4r_ops.training import Trainer  # noqa: E402

ROWS = 320


def train(frame, out, model_seed, resume=None):
    trainer = Trainer(
        model=factories.testing_model("mlm", seed=model_seed),
        args=make_args(out, max_sequence_length=factories.TESTING_MAX_LEN, num_train_epochs=2,
                       save_strategy="steps", save_steps=5),
        strategy="auto",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(frame),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    frame = factories.testing_frame().iloc[:ROWS]
    first = os.path.join(opts.out, "uninterrupted")
    trainer, weights = train(frame, first, model_seed=0)
    runs = {"uninterrupted": weights}
    steps = {"uninterrupted": trainer.state.global_step}
    for checkpoint in ("checkpoint-5", "checkpoint-10"):
        resumed, runs[checkpoint] = train(frame, os.path.join(opts.out, checkpoint), 7,
                                          resume=os.path.join(first, checkpoint))
        steps[checkpoint] = resumed.state.global_step
    rank = trainer.dist_state.rank
    torch.save(runs, os.path.join(opts.out, f"rank{rank}.pt"))
    with open(os.path.join(opts.out, f"rank{rank}.json"), "w") as fh:
        json.dump({"steps": steps, "world_size": trainer.dist_state.world_size}, fh)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
