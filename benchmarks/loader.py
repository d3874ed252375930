"""Merlin 23.08's ``Loader`` against the columnar loader, on the same shard, side by side.

Prints ms per batch of each (one epoch of a rank's shard, shuffled, cropped and padded as
``fit`` loads it) and their ratio, for ``--rounds`` alternating rounds, then the columnar
loader with ``--workers`` worker processes. The data: synthetic sessions written as parquet
by the tests' factories. CPU only; run from the repository root::

    python benchmarks/loader.py --rows 40000 --batch-size 384

Then, on copies of T4R's testing data (15 tensors a batch), what receiving a batch from
``--workers`` workers costs the training process: its CPU time (``time.process_time``) and
wall time per batch, with each batch packed into one buffer
(:class:`~merlin_t4r_ops.training.packed.PackedBatch`, what the loader does) and with one
shared-memory tensor per tensor (``DataLoader``'s own way), in alternating rounds.
"""

import argparse
import itertools
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(os.path.dirname(HERE), "tests")]


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
        if args.workers > 0:
            receiving(folder, args)


class _PerTensor(torch.utils.data.IterableDataset):
    """The loader's batches as a worker would send them unpacked: one segment per tensor."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def __iter__(self):
        from merlin_t4r_ops.training.packed import PackedBatch

        for batch in self.epoch:
            x, y = batch.unpack() if isinstance(batch, PackedBatch) else batch
            yield {k: v.clone() for k, v in x.items()}, _cloned(y)


def _cloned(y):
    if isinstance(y, dict):
        return {k: v.clone() for k, v in y.items()}
    return None if y is None else y.clone()


def _receive_ms(dataset, workers: int, batches: int) -> tuple:
    """(CPU ms, wall ms) of the training process per batch, workers already ahead."""
    from merlin_t4r_ops.training.packed import PackedBatch

    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         prefetch_factor=batches)
    got = iter(loader)
    next(got)
    time.sleep(3)  # the workers fill their queues: what follows is receiving, not making
    cpu, wall, n = time.process_time(), time.perf_counter(), 0
    for batch in itertools.islice(got, batches):
        if isinstance(batch, PackedBatch):
            batch.unpack()
        n += 1
    return ((time.process_time() - cpu) * 1000 / n, (time.perf_counter() - wall) * 1000 / n)


def receiving(folder: str, args) -> None:
    from training_paths import build_model, write_copies

    from merlin_t4r_ops.training import make_loader, resolve_strategy

    files = write_copies(os.path.join(folder, "t4r"), copies=8)
    loader = make_loader(files, build_model(64), resolve_strategy("single"),
                         batch_size=args.batch_size, drop_last=True, device_batches=False)
    batches = min(len(loader) - 1, 16)
    print(f"\nReceiving {batches} batches of {args.batch_size} sessions of T4R's testing data "
          f"from {args.workers} workers, ms per batch in the training process")
    print(f"{'round':>5} | {'packed CPU':>10} | {'per tensor CPU':>14} | {'packed wall':>11} | "
          f"{'per tensor wall':>15} | {'CPU ratio':>9}")
    for index in range(args.rounds):
        packed = _receive_ms(loader.epoch_dataset(0), args.workers, batches)
        per_tensor = _receive_ms(_PerTensor(loader.epoch_dataset(0)), args.workers, batches)
        print(f"{index + 1:>5} | {packed[0]:>10.2f} | {per_tensor[0]:>14.2f} | {packed[1]:>11.2f} | "
              f"{per_tensor[1]:>15.2f} | {per_tensor[0] / packed[0]:>9.1f}")


if __name__ == "__main__":
    main()
