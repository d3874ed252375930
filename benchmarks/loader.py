"""Merlin 23.08's ``Loader`` against the columnar loader, on the same shard, side by side.

Prints ms per batch of each (one epoch of a rank's shard, shuffled, cropped and padded as
``fit`` loads it) and their ratio, for ``--rounds`` alternating rounds, then the columnar
loader with ``--workers`` worker processes. The data: synthetic sessions written as parquet
by the tests' factories. CPU only; run from the repository root::

    python benchmarks/loader.py --rows 40000 --batch-size 384
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]


def per_batch_ms(make_batches) -> tuple:
    start = time.perf_counter()
    batches = make_batches()
    return (time.perf_counter() - start) * 1000 / max(len(batches), 1), len(batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    import torch

    import t4r_training_factories as factories
    from merlin_reference import merlin_batches
    from merlin_t4r_ops.training import DistributedState
    from merlin_t4r_ops.training.data import ShardedLoader, as_dataset

    state = DistributedState("single", 0, 0, 1, torch.device("cpu"), "benchmark")
    with tempfile.TemporaryDirectory() as folder:
        path = factories.write_sessions(folder, args.rows, n_files=args.files)

        def loader(workers):
            return ShardedLoader(as_dataset(path), state, args.batch_size,
                                 ["item_id-list", "category-list"], ["click"],
                                 max_sequence_length=factories.MAX_LEN, shuffle=True,
                                 num_workers=workers)

        def columnar(workers):
            one = loader(workers)
            one.set_epoch(0)
            return list(one)

        print(f"{args.rows} rows in {args.files} files, batch {args.batch_size}, one epoch")
        print(f"{'round':>5} | {'batches':>7} | {'Merlin Loader ms':>16} | "
              f"{'columnar ms':>11} | {'ratio':>5}")
        for index in range(args.rounds):
            merlin_ms, n = per_batch_ms(lambda: merlin_batches(loader(0), 0))
            columnar_ms, _ = per_batch_ms(lambda: columnar(0))
            print(f"{index + 1:>5} | {n:>7} | {merlin_ms:>16.2f} | {columnar_ms:>11.2f} | "
                  f"{merlin_ms / columnar_ms:>5.1f}")
        workers_ms, _ = per_batch_ms(lambda: columnar(args.workers))
        print(f"columnar with {args.workers} workers (their start included): "
              f"{workers_ms:.2f} ms per batch")


if __name__ == "__main__":
    main()
