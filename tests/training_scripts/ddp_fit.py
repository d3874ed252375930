"""Run under ``torch.distributed.run`` by tests/test_training_ddp.py: ``fit`` under DDP.

Each rank writes to ``--out``: ``rank{R}.pt`` (trained weights) and
``rank{R}.json`` (resolved state, history, the rows of its train shard).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402
from torchrun_launch import write_rank_results  # noqa: E402

from merlin_t4r_ops.training import fit, make_loader, resolve_strategy  # noqa: E402


class Preempted(Exception):
    """Stands for the job being stopped after ``--stop-after`` optimizer steps."""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shuffle", action="store_true")
    # "{rank}" in the path gives each rank its own directory, as node-local disks would.
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--save-steps", type=int, default=None)
    # Stop (as if preempted) after this many optimizer steps; nothing is written then.
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--masking", default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()

    state = resolve_strategy("auto")
    model = factories.build_model(args.task, seed=args.model_seed, masking=args.masking)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = []

    def constant(_):
        steps.append(None)
        if args.stop_after is not None and len(steps) > args.stop_after:  # 1st call: at init
            raise Preempted
        return 1.0

    try:
        history = fit(
            model,
            args.train,
            optimizer=optimizer,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, constant),
            lr_scheduler_interval="step",
            save_steps=args.save_steps,
            gradient_accumulation_steps=args.accumulate,
            eval_data=args.eval,
            epochs=args.epochs,
            batch_size=args.batch_size,
            strategy=state,
            shuffle=args.shuffle,
            seed=0,
            progress=False,
            checkpoint_dir=args.checkpoint_dir and args.checkpoint_dir.format(rank=state.rank),
            resume=args.resume,
            log_dir=args.log_dir,
        )
    except Preempted:
        torch.distributed.destroy_process_group()
        return
    shard = [
        [int(i) for i in row if i != 0]
        for x, _ in make_loader(args.train, model, state, batch_size=args.batch_size, shuffle=True, seed=5)
        for row in x["item_id-list"].tolist()
    ]
    info = {
        "strategy": state.strategy,
        "rank": state.rank,
        "world_size": state.world_size,
        "device": str(state.device),
        "backend": torch.distributed.get_backend(),
        "history": history,
        "shard": shard,
        "model_type": type(model).__name__,
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }
    write_rank_results(args.out, state.rank, info, model.state_dict())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
