"""Batches straight from Arrow: a partition at a time, list columns from offsets and values.

Merlin 23.08's ``Loader`` turns each chunk of a shard into pandas and flattens every list
column of it through Python objects (``pull_apart_list``: 16 ms a step on the H200 profile
of issue 22, the GPU idle for seconds at each epoch start). Here a partition is read with
pyarrow (only its row groups, only the model's columns), a batch's rows are taken from it,
and a list column becomes tensors from the Arrow offsets and values through numpy. A padded
batch of ragged numeric lists skips the take: it is gathered from the partition's own values
(:mod:`~merlin_t4r_ops.training.padded_rows`), to the same tensors.

The batches are Merlin's, tensor for tensor: the same rows in the same order (the epoch's
plan, :func:`plan_batches`, cuts the rows :class:`~merlin_t4r_ops.training.data.ShardedLoader`
assigns into consecutive runs of ``batch_size``, as Merlin's loader cuts its shard), the same
keys (``name__values``/``name__offsets`` for a ragged column, ``[rows, n]`` for a fixed one),
dtypes and target layout (one target: a tensor; several: a dict). Padding is then the one
crop-and-pad rule of training and serving (:func:`merlin_t4r_ops.sequence.pad_lists_fn`).

:class:`EpochDataset` is a ``torch.utils.data.IterableDataset``: worker ``w`` of ``W`` makes
batches ``w, w + W, ...``, which ``DataLoader`` hands out round robin, in order. A worker
yields each batch as a :class:`~merlin_t4r_ops.training.packed.PackedBatch` (one buffer), which
:class:`~merlin_t4r_ops.training.data.EpochBatches` unpacks; a ``DataLoader`` of one's own over
an ``EpochDataset`` with workers gets ``PackedBatch`` objects (``.unpack()`` gives ``(x, y)``).
"""

import collections
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from accelerate.utils import recursively_apply

from merlin_t4r_ops.errors import T4ROpsError
from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
from merlin_t4r_ops.sequence import pad_lists_fn
from merlin_t4r_ops.training.packed import PackedBatch
from merlin_t4r_ops.training.padded_rows import PartitionArrays, copy_to, padded_batch

__all__ = ["ColumnLayout", "EpochDataset", "partition_reader", "plan_batches", "batch_tensors",
           "split_targets"]

# (partition, start, stop): positions start..stop of the partition's rows in epoch order.
Segment = Tuple[int, int, int]


def partition_rows(partition: int, length: int, seed: int, epoch: int, shuffle: bool):
    """The partition's rows in the order ``epoch`` reads them (None: stored order)."""
    if not shuffle:
        return None
    return np.random.default_rng([seed, epoch, int(partition)]).permutation(length)


# ---- reading partitions -----------------------------------------------------------------


class ParquetPartitions:
    """Reads a dataset's partitions as Merlin planned them: files and their row groups."""

    def __init__(self, fs, pieces: List[List[Tuple[str, Optional[list]]]], columns: Sequence[str]):
        self.fs, self.pieces, self.columns = fs, pieces, list(columns)

    def read(self, partition: int) -> pa.Table:
        in_worker = torch.utils.data.get_worker_info() is not None
        tables = []
        for path, row_groups in self.pieces[partition]:
            with self.fs.open(path, "rb") as handle:
                parquet = pq.ParquetFile(handle)
                groups = range(parquet.num_row_groups) if row_groups is None else row_groups
                # A worker is one of several processes: one thread each.
                tables.append(parquet.read_row_groups(
                    list(groups), columns=self.columns, use_threads=not in_worker))
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class FramePartitions:
    """Reads the partitions of a dataset that has no parquet files (one over a dataframe)."""

    def __init__(self, frame):
        self.frame = frame

    def read(self, partition: int) -> pa.Table:
        part = self.frame.partitions[int(partition)].compute(scheduler="synchronous")
        return pa.Table.from_pandas(part, preserve_index=False)


def _parquet_pieces(dataset, lengths: Sequence[int]):
    """Per partition, ``[(path, row_groups)]`` from Merlin's plan; None where unknown."""
    engine = dataset.engine
    parts = (getattr(engine, "_pp_metadata", None) or {}).get("parts")
    if not parts or len(parts) != len(lengths) or getattr(engine, "filters", None):
        return None
    pieces = []
    for part in parts:
        entries = part if isinstance(part, list) else [part]
        try:
            pieces.append([(e["piece"][0], e["piece"][1]) for e in entries])
        except (KeyError, TypeError, IndexError):
            return None
    for partition_pieces in pieces:
        for index, (path, row_groups) in enumerate(partition_pieces):
            if row_groups == [None]:
                partition_pieces[index] = (path, None)
    return pieces


def _file_holds(fs, path: str, columns: Sequence[str]) -> bool:
    """Whether the file stores every column (hive partitions keep some in folder names)."""
    with fs.open(path, "rb") as handle:
        return set(columns) <= set(pq.ParquetFile(handle).schema_arrow.names)


def partition_reader(dataset, columns: Sequence[str], lengths: Sequence[int]):
    """A picklable reader of ``dataset``'s partitions as Arrow tables of ``columns``.

    Parquet datasets are read with pyarrow, file and row groups as Merlin's plan names them;
    anything else (a dataset over a dataframe) through its dask partitions.
    """
    pieces = _parquet_pieces(dataset, lengths) if hasattr(dataset, "engine") else None
    if pieces and pieces[0] and _file_holds(dataset.engine.fs, pieces[0][0][0], columns):
        return ParquetPartitions(dataset.engine.fs, pieces, columns)
    with cpu_datasets_quiet():
        frame = dataset.to_ddf(columns=list(columns)).clear_divisions()
    return FramePartitions(frame)


# ---- batches from Arrow -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ColumnLayout:
    """The columns of a batch in Merlin's order, how each is made, which are targets.

    ``kinds``: column name to ``"scalar"``, ``"ragged"`` or ``"fixed"`` (a list column whose
    schema fixes its length: one ``[rows, n, ...]`` tensor), in the order Merlin's loader
    builds them (columns grouped by dtype, groups in schema order).
    """

    kinds: Dict[str, str]
    targets: Tuple[str, ...]

    @classmethod
    def from_schema(cls, schema) -> "ColumnLayout":
        from merlin.schema import Tags

        groups = collections.defaultdict(list)
        for column in schema:
            groups[column.dtype].append(column)
        kinds = {}
        for columns in groups.values():
            for column in columns:
                ragged = column.shape.is_ragged if column.is_list else False
                kinds[column.name] = "ragged" if ragged else "fixed" if column.is_list else "scalar"
        targets = tuple(schema.select_by_tag(Tags.TARGET).column_names)
        return cls(kinds, targets)


def _list_parts(name: str, column: pa.ChunkedArray):
    """``(values, lengths)`` of a list column: flattened leaves and values per row."""
    array = column.combine_chunks()
    if array.null_count:
        raise T4ROpsError(
            f"list column {name!r} holds {array.null_count} null rows where a list was expected"
        )
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    values = array.flatten()
    if values.null_count:
        raise T4ROpsError(f"list column {name!r} holds {values.null_count} null values")
    return values, lengths


def _leaves(values: pa.Array) -> np.ndarray:
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False, writable=True)  # torch needs it writable


def _column_tensors(name: str, kind: str, column: pa.ChunkedArray) -> dict:
    if kind == "scalar":
        array = column.to_numpy() if column.null_count == 0 else column.to_pandas().to_numpy()
        return {name: torch.from_numpy(np.array(array))}  # a writable copy
    values, lengths = _list_parts(name, column)
    if kind == "fixed":  # as Merlin: every row shaped like the first one
        first = np.array(column[0].as_py()).shape if len(column) else (0,)
        return {name: torch.from_numpy(_leaves(values).reshape(-1, *first))}
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise T4ROpsError(
            f"list column {name!r} holds ragged nested lists; only a schema with fixed inner "
            "shapes (is_ragged False) can load nested lists"
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {f"{name}__values": torch.from_numpy(_leaves(values)),
            f"{name}__offsets": torch.from_numpy(offsets)}


def batch_tensors(table: pa.Table, layout: ColumnLayout):
    """``(x, y)`` as Merlin's torch ``Loader`` yields them for these rows."""
    tensors = {}
    for name, kind in layout.kinds.items():
        tensors.update(_column_tensors(name, kind, table.column(name)))
    return split_targets(tensors, layout)


def split_targets(tensors: dict, layout: ColumnLayout):
    """``(x, y)`` of a batch's tensors: one target a tensor, several a dict, none None."""
    targets = {name: tensors.pop(name) for name in layout.targets}
    if not targets:
        return tensors, None
    if len(targets) == 1:
        return tensors, next(iter(targets.values()))
    return tensors, targets


# ---- one epoch's batches ----------------------------------------------------------------


def plan_batches(pieces: Sequence[Segment], batch_size: int, drop_last: bool) -> List[List[Segment]]:
    """``pieces`` (a rank's row ranges, in reading order) cut into batches of consecutive rows.

    Merlin's loader cuts its shard so (carrying a partial batch over into the next chunk),
    and yields the last, shorter batch unless ``drop_last``.
    """
    batches, current, held = [], [], 0
    for partition, start, stop in pieces:
        while start < stop:
            take = min(stop - start, batch_size - held)
            current.append((int(partition), start, start + take))
            held, start = held + take, start + take
            if held == batch_size:
                batches.append(current)
                current, held = [], 0
    if current and not drop_last:
        batches.append(current)
    return batches


@dataclasses.dataclass
class PadSpec:
    """What :func:`~merlin_t4r_ops.sequence.pad_lists_fn` needs, picklable for workers."""

    width: int
    list_columns: Tuple[str, ...]
    id_columns: Tuple[str, ...]


class EpochDataset(torch.utils.data.IterableDataset):
    """One epoch's batches of a rank, made by whichever worker's turn it is.

    Parameters
    ----------
    reader : ParquetPartitions or FramePartitions
    layout : ColumnLayout
    plan : list of list of (partition, start, stop)
        From :func:`plan_batches`.
    lengths : sequence of int
        Rows per partition.
    seed, epoch : int
    shuffle : bool
        Rows of a partition in :func:`partition_rows` order.
    pad : PadSpec, optional
    device : torch.device, optional
        Make every batch on this device: a padded batch is gathered there
        (:meth:`~.padded_rows.PartitionArrays.to`), any other copied there. In this process
        only: a worker process cannot hold CUDA tensors it made for the parent.
    """

    def __init__(self, reader, layout, plan, lengths, seed, epoch, shuffle, pad=None,
                 device=None):
        super().__init__()
        self.reader, self.layout, self.plan = reader, layout, plan
        self.lengths, self.seed, self.epoch, self.shuffle = lengths, seed, epoch, shuffle
        self.pad, self.device = pad, device

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info and self.device is not None:
            raise ValueError("an EpochDataset with a device makes its batches in this process: "
                             "read it with num_workers=0")
        pad = None
        if self.pad is not None:
            pad = pad_lists_fn(self.pad.width, self.pad.list_columns, self.pad.id_columns)
        cache = collections.OrderedDict()  # the last two partitions read
        for index in range(worker, len(self.plan), workers):
            x, y = self._batch(self.plan[index], cache, pad)
            # From a worker process: one buffer to send and pin, not one per tensor.
            yield PackedBatch.pack(x, y) if info else (x, y)

    def _batch(self, segments: Sequence[Segment], cache, pad):
        """The batch padded from its partitions' buffers where it can be (:mod:`.padded_rows`),
        else through ``batch_tensors`` and ``pad``: the same tensors either way."""
        # Each partition fetched once a batch: one that spans more than the cache's two
        # partitions (partitions smaller than a batch) would otherwise be read again below.
        pieces = [(self._partition(partition, cache), start, stop)
                  for partition, start, stop in segments]
        if pad is not None and all(arrays is not None for (_, _, arrays), _, _ in pieces):
            parts = [(arrays, _positions(order, start, stop))
                     for (_, order, arrays), start, stop in pieces]
            tensors = padded_batch(parts, self.layout, self.pad.width, self.pad.id_columns)
            if tensors is not None:
                batch = split_targets(tensors, self.layout)
                # Columns that ``PartitionArrays.to`` left on the host, and columns joined there
                # (partitions of other dtypes), are copied now.
                return batch if self.device is None else _on_device(batch, self.device)
        tables = [table.slice(start, stop - start) if order is None
                  else table.take(pa.array(order[start:stop]))
                  for (table, order, _), start, stop in pieces]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        x, y = batch_tensors(table, self.layout)
        x, y = pad(x, y) if pad else (x, y)
        return (x, y) if self.device is None else _on_device((x, y), self.device)

    def _partition(self, partition: int, cache):
        """``(table, row order, PartitionArrays or None)`` of a partition, read once."""
        if partition not in cache:
            table = self.reader.read(partition)
            order = partition_rows(partition, self.lengths[partition], self.seed, self.epoch,
                                   self.shuffle)
            arrays = PartitionArrays.of(table, self.layout) if self.pad is not None else None
            if arrays is not None and self.device is not None:
                arrays = arrays.to(self.device)
            cache[partition] = (table, order, arrays)
            while len(cache) > 2:
                cache.popitem(last=False)
        return cache[partition]


def _on_device(batch, device: torch.device):
    """``(x, y)``'s tensors on ``device``: those on the host copied (from pinned memory to a
    GPU); those gathered on the device already kept (``cuda`` and ``cuda:0`` compare unequal)."""
    def move(tensor):
        on_host = tensor.device.type == "cpu" and device.type != "cpu"
        return copy_to(tensor, device) if on_host else tensor
    return recursively_apply(move, batch)


def _positions(order, start: int, stop: int) -> np.ndarray:
    """Rows ``start..stop`` of a partition in epoch order (``order`` None: stored order)."""
    return np.arange(start, stop) if order is None else order[start:stop]
