"""Yesterday's loader, kept as the tests' reference: Merlin 23.08's ``Loader`` over a shard.

Until issue 22, :class:`~merlin_t4r_ops.training.data.ShardedLoader` handed each pass's rows
(its ``shard``, each partition's rows in ``partition_rows`` order) to Merlin's torch
``Loader`` as a dask frame, and padded its batches with ``pad_lists_fn``. The columnar
reader must yield exactly these batches.
"""

import dask.dataframe as dd
import torch
from merlin.dataloader.torch import Loader
from merlin.io import Dataset

from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
from merlin_t4r_ops.sequence import pad_lists_fn
from merlin_t4r_ops.training.columnar import partition_rows
from merlin_t4r_ops.training.data import _after_rows


def _take_rows(frame, rows):
    return frame.iloc[rows]


def merlin_batches(loader, epoch, skip_batches=0):
    """Every ``(x, y)`` of ``loader``'s pass over ``epoch``, made by Merlin's ``Loader``."""
    pieces = _after_rows(loader.shard(epoch), skip_batches * loader.batch_size)
    if not pieces:
        return []
    frame = loader.dataset.to_ddf(columns=loader.schema.column_names).clear_divisions()
    parts = []
    for partition, start, stop in pieces:
        rows = slice(start, stop)
        order = partition_rows(partition, loader.partition_lengths[partition], loader.seed,
                               epoch, loader.shuffle)
        if order is not None:
            rows = order[start:stop]
        parts.append(
            frame.partitions[int(partition)].map_partitions(_take_rows, rows, meta=frame._meta))
    with cpu_datasets_quiet():
        shard = Dataset(dd.concat(parts), schema=loader.schema, cpu=loader.dataset.cpu)
    merlin = Loader(shard, loader.batch_size, drop_last=loader.drop_last, device="cpu")
    pad = None
    if loader.max_sequence_length:
        pad = pad_lists_fn(loader.max_sequence_length, loader.list_columns, loader.id_columns)
    batches = iter(merlin)
    try:
        # Exactly len() batches: asking Merlin 23.08 for one past its last can block for
        # ever (its reader thread may still look alive, then end without a last put).
        return [pad(*next(batches)) if pad else next(batches) for _ in range(len(merlin))]
    finally:
        merlin.stop()


def identical(a, b) -> bool:
    """Batch parts equal tensor for tensor: dict keys in order, dtypes, shapes, values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(identical(a[k], b[k]) for k in a)
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
