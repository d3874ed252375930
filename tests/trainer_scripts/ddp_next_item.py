"""Run by ``torch.distributed.run`` from tests/test_trainer_ddp.py: train + evaluate under DDP.

Each rank writes ``rank{R}.json`` (environment, train/eval shard contents, eval
metrics, prediction shapes) and ``rank{R}.pt`` (trained weights) to ``--out``.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_common import ITEM_COL, make_args, make_model, make_schema  # noqa: E402

from merlin_t4r_ops.training import Trainer  # noqa: E402


def _sessions(loader):
    """The item sequences a loader yields, padding stripped, as lists."""
    out = []
    for inputs, _ in loader:
        for row in inputs[ITEM_COL].tolist():
            out.append([i for i in row if i != 0])
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--eval", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="xlnet")
    opts = parser.parse_args()

    schema = make_schema()
    model = make_model(schema, arch=opts.arch)
    args = make_args(os.path.join(opts.out, "hf"), save_strategy="no")
    trainer = Trainer(
        model=model,
        args=args,
        strategy="auto",
        schema=schema,
        train_dataset_or_path=opts.train,
        eval_dataset_or_path=opts.eval,
        compute_metrics=True,
    )
    state = trainer.dist_state
    train_shard = _sessions(trainer.get_train_dataloader())
    eval_shard = _sessions(trainer.get_eval_dataloader())

    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(opts.eval)
    trainer.save_model(os.path.join(opts.out, "saved"))

    rank = state.rank
    torch.save(trainer.model.state_dict(), os.path.join(opts.out, f"rank{rank}.pt"))
    report = {
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")},
        "strategy": state.strategy,
        "rank": rank,
        "local_rank": state.local_rank,
        "world_size": state.world_size,
        "train_shard": train_shard,
        "eval_shard": eval_shard,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("eval_/")},
        # Only rank 0 receives predictions.
        "pred_shapes": pred.predictions and [list(p.shape) for p in pred.predictions],
        "model_is_users": trainer.model is model,
        "model_type": type(trainer.model).__name__,
        "global_step": trainer.state.global_step,
        # What DDP was told, and the model's trainability once train() returned.
        "find_unused_parameters": trainer.model_wrapped.find_unused_parameters,
        "all_trainable_after": all(p.requires_grad for p in model.parameters()),
        "process_zero": {"local": trainer.is_local_process_zero(),
                         "world": trainer.is_world_process_zero(),
                         "should_save": trainer.args.should_save},
    }
    with open(os.path.join(opts.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
