"""Run under ``torch.distributed.run`` by tests/test_training_workers.py: workers per rank.

Each gloo rank resolves its strategy as torchrun launched it, asks for the loader workers
that the default gives a CUDA rank of this node (``default_num_workers`` with this rank's
``local_world_size``), opens a pass and counts the worker processes it started. Writes
``rank{R}.json`` (and an empty ``rank{R}.pt``) to ``--out``.
"""

import argparse
import dataclasses
import multiprocessing
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402
from torchrun_launch import write_rank_results  # noqa: E402

from merlin_t4r_ops.training import make_loader, resolve_strategy  # noqa: E402
from merlin_t4r_ops.training.data import default_num_workers  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = resolve_strategy("auto")
    as_if_on_cuda = dataclasses.replace(state, device=torch.device("cuda", state.local_rank))
    workers = default_num_workers(as_if_on_cuda)
    loader = make_loader(factories.testing_dataset(factories.testing_frame(), 8),
                         factories.testing_model(), state, batch_size=32, num_workers=workers)
    before = set(multiprocessing.active_children())
    with iter(loader) as batches:
        next(batches)
        started = len(set(multiprocessing.active_children()) - before)
    info = {
        "local_world_size": state.local_world_size,
        "cpu_default": default_num_workers(state),
        "cuda_default": workers,
        "started": started,
        "cores": len(os.sched_getaffinity(0)),
    }
    torch.distributed.barrier()
    write_rank_results(args.out, state.rank, info)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
