"""Run under ``torch.distributed.run`` by tests/test_training_workers.py: workers per rank.

Each gloo rank resolves its strategy as torchrun launched it, opens a pass with the default
workers and one with its share of the cores, at most 2 (``worker_share`` with this rank's
``local_world_size``), counts the worker processes each started, and asks for one more than
its share (a warning). Writes ``rank{R}.json`` (and an empty ``rank{R}.pt``) to ``--out``.
"""

import argparse
import multiprocessing
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402
from torchrun_launch import write_rank_results  # noqa: E402

from merlin_t4r_ops.training import make_loader, resolve_strategy  # noqa: E402
from merlin_t4r_ops.training.data import worker_share  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = resolve_strategy("auto")
    data, model = factories.testing_dataset(factories.testing_frame(), 8), factories.testing_model()

    def started(**options) -> int:
        loader = make_loader(data, model, state, batch_size=32, **options)
        before = set(multiprocessing.active_children())
        with iter(loader) as batches:
            next(batches)
            return len(set(multiprocessing.active_children()) - before)

    share = worker_share(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_loader(data, model, state, batch_size=32, num_workers=share + 1)
    info = {
        "local_world_size": state.local_world_size,
        "share": share,
        "started_by_default": started(),
        # At most 2: a pass starts no more workers than it has batches (16 per rank here).
        "started_for_share": started(num_workers=min(share, 2)),
        "over_share_warnings": [str(w.message) for w in caught if "num_workers" in str(w.message)],
        "cores": len(os.sched_getaffinity(0)),
    }
    torch.distributed.barrier()
    write_rank_results(args.out, state.rank, info)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
