"""Run under ``torch.distributed.run`` by tests/test_training_eval_empty_shard.py.

``evaluate`` on 2 ranks where one rank has no eval batch, for each task kind: the rank
named by ``empty`` gets an empty loader, the other every batch of ``--eval`` (read as
one process reads it); ``one-row``: ``--one-row``, a one-row parquet set that the
sharded loader gives to rank 1 alone. Writes ``rank{R}.json`` (``{case: metrics}``)
and ``rank{R}.pt`` (nothing) to ``--out``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402
from torchrun_launch import write_rank_results  # noqa: E402

from merlin_t4r_ops.training import DistributedState, evaluate, make_loader  # noqa: E402
from merlin_t4r_ops.training import resolve_strategy  # noqa: E402

TASKS = ("next-item", "asked-metrics")
BATCH = 16
MODEL_SEED = 1


def every_batch(path, model):
    """All batches of ``path``, as one process loads them."""
    one_process = DistributedState("single", 0, 0, 1, torch.device("cpu"), "all rows")
    return list(make_loader(path, model, one_process, batch_size=BATCH))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval", required=True)
    parser.add_argument("--one-row", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = resolve_strategy("auto")
    results = {}
    for task in TASKS:
        model = factories.build_model(task, seed=MODEL_SEED)
        batches = every_batch(args.eval, model)
        for empty in (0, 1):
            data = [] if state.rank == empty else batches
            results[f"{task}/rank{empty}-empty"] = evaluate(model, data, strategy=state)
        results[f"{task}/one-row"] = evaluate(model, args.one_row, strategy=state,
                                              batch_size=BATCH)
    write_rank_results(args.out, state.rank, results)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
