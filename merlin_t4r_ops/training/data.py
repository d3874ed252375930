"""Per-rank Merlin dataloaders that feed a T4R model dense, padded batches.

Each epoch, :class:`ShardedLoader` lays the dataset's partitions out in one
order (shuffled from ``seed`` and the epoch, so every rank draws the same
order) and gives rank ``r`` of ``W`` the ``r``-th of ``W`` equal runs of rows
of that stream. Shards therefore

* are disjoint and cover the dataset every epoch, whatever the partition sizes
  (a partition that straddles two runs is read by both ranks, each keeping its
  own rows): balanced by rows, not by partitions;
* move between ranks and change order every epoch when shuffling, unlike
  Merlin 23.08's ``Loader``, which fixes its partition list before it shuffles;
* follow the *global* rank (``DistributedState.rank``), so several nodes need
  nothing extra.

This module decides which rows each rank reads, in which order;
:mod:`~merlin_t4r_ops.training.columnar` reads them with pyarrow and makes the
tensors that Merlin's ``Loader`` made from them, in the training process or, when asked,
in ``torch.utils.data.DataLoader`` worker processes that prepare batches ahead of the
training step (``num_workers``; :func:`worker_share`).

List columns are cropped and padded inside the loader, by the rule and to the
width that the operator serves with (:mod:`merlin_t4r_ops.sequence`): dense
tensors are what ``DataParallel`` can scatter along the batch dimension
(Merlin's ragged ``__values``/``__offsets`` pairs cannot be split that way).
"""

import bisect
import contextlib
import dataclasses
import glob
import itertools
import os
import warnings
import weakref
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from accelerate.utils import send_to_device

from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
from merlin_t4r_ops.sequence import core_schema, resolve_sequence_length
from merlin_t4r_ops.training.columnar import (
    ColumnLayout,
    EpochDataset,
    PadSpec,
    partition_reader,
    plan_batches,
)
from merlin_t4r_ops.training.metrics import prediction_tasks
from merlin_t4r_ops.training.packed import PackedBatch
from merlin_t4r_ops.training.state import DistributedState, unwrap_model

__all__ = [
    "ShardedLoader", "EpochBatches", "batches_of", "worker_share", "make_loader",
    "model_columns", "shard_rows", "to_device",
]

DP_NEEDS_WIDTH = (
    "strategy 'dp' needs dense [batch, width] tensors to split along the batch dimension "
    "(it would split ragged values and offsets independently)"
)


def model_columns(model):
    """``(input_names, target_names)`` a T4R model reads from a batch.

    Targets are the columns its tasks name. A T4R model's input schema is the
    whole schema it was built from, targets included (``click`` beside the
    features in T4R's ``music_streaming`` data); as in T4R's loader, no column
    tagged TARGET there, nor any task's target, is an input.
    """
    from merlin.schema import Tags

    model = unwrap_model(model)
    targets = []
    for _, task in prediction_tasks(model):
        name = getattr(task, "target_name", None)
        if name and name not in targets:
            targets.append(name)
    schema = model.input_schema
    inputs = [
        c.name for c in schema if Tags.TARGET not in c.tags and c.name not in targets
    ]
    return inputs, targets


def as_dataset(data, schema=None):
    """A ``merlin.io.Dataset`` over parquet path(s), or ``data`` itself if it is one.

    Parameters
    ----------
    data : str, os.PathLike, list of them, or merlin.io.Dataset
        Files, directories of ``*.parquet`` files, or glob patterns.
    schema : merlin.schema.Schema or merlin_standard_lib Schema, optional
        Replaces the schema found next to the files (``schema.pbtxt``), as
        Transformers4Rec's loaders do with the schema given to its ``Trainer``.
    """
    from merlin.io import Dataset

    if not isinstance(data, Dataset):
        with cpu_datasets_quiet():  # pandas is the intended engine without cuDF
            data = Dataset(_parquet_files(data), engine="parquet")
    if schema is not None:
        data.schema = core_schema(schema)
    return data


def _parquet_files(data) -> List[str]:
    paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    files = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.parquet")))
            if not found:
                raise FileNotFoundError(f"data directory {path!r} holds no *.parquet files")
            files += found
        elif os.path.exists(path) or glob.glob(path):
            files += sorted(glob.glob(path)) or [path]
        else:
            raise FileNotFoundError(f"data path {path!r} does not exist")
    return files


def _partition_lengths(dataset) -> List[int]:
    """Rows per partition: from the parquet footers when Merlin has them, else counted once."""
    try:
        lengths = list(dataset.partition_lens or [])
    except AttributeError:  # a Dataset over a dataframe has no file metadata
        lengths = []
    if len(lengths) != dataset.npartitions:
        first = dataset.schema.column_names[:1] or None
        lengths = dataset.to_ddf(columns=first).map_partitions(len).compute().tolist()
    return [int(n) for n in lengths]


def shard_rows(
    lengths: Sequence[int], order: Sequence[int], rank: int, world_size: int, equal: bool
) -> List[Tuple[int, int, int]]:
    """This rank's rows of the partitions laid out in ``order``, as ``(partition, start, stop)``.

    Rank ``r`` takes positions ``[r * N / W, (r + 1) * N / W)`` of the stream of
    ``N`` rows. With ``equal``, every rank takes ``ceil(N / W)`` positions and the
    last ranks wrap around to the start of the stream, repeating at most
    ``W - 1`` rows in all (what ``torch.utils.data.DistributedSampler`` does),
    so every rank holds the same number of rows.

    Parameters
    ----------
    lengths : sequence of int
        Rows of each partition, indexed by partition.
    order : sequence of int
        Partition indices in the order this epoch reads them.
    rank, world_size : int
    equal : bool

    Returns
    -------
    list of (int, int, int)
        Partition index and its row range, in reading order.
    """
    ordered = [lengths[p] for p in order]
    total = sum(ordered)
    if total == 0:
        return []
    if equal:
        per_rank = -(-total // world_size)
        begin, end = rank * per_rank, (rank + 1) * per_rank
    else:
        begin, end = rank * total // world_size, (rank + 1) * total // world_size
    ends = list(itertools.accumulate(ordered))
    pieces = []
    position = begin
    while position < end:
        offset = position % total
        index = bisect.bisect_right(ends, offset)  # skips empty partitions
        first_row = ends[index] - ordered[index]
        take = min(end - position, ends[index] - offset)
        pieces.append((order[index], offset - first_row, offset - first_row + take))
        position += take
    return pieces


def _without_target_tag(column):
    """``column`` without Tags.TARGET (merlin-core 23.08's ColumnSchema can only add tags)."""
    from merlin.schema import Tags

    return dataclasses.replace(column, tags=column.tags - [Tags.TARGET], dims=column.shape.dims)


class EpochBatches:
    """One pass over a :class:`ShardedLoader`: an iterator that ends what reads ahead for it.

    The pass reads through a ``torch.utils.data.DataLoader``, whose worker processes and
    pin-memory thread prepare batches ahead; a pass abandoned before its end (``max_steps``,
    a probe batch, ``eval_steps_on_train_set``) would leave them waiting until the iterator
    is collected. :meth:`close` (also ``with``, and when the pass is garbage-collected)
    drops the ``DataLoader``'s iterator, which shuts its workers and thread down.

    Parameters
    ----------
    open_batches : callable
        Returns the pass's batch iterator (or None for an empty shard); called at the
        first ``next``, so that an iterator never read starts no worker.
    """

    def __init__(self, open_batches):
        self._open_batches = open_batches
        self._batches = None

    def __iter__(self) -> "EpochBatches":
        return self

    def __next__(self):
        if self._open_batches is not None:
            self._batches, self._open_batches = self._open_batches(), None
        if self._batches is None:
            raise StopIteration
        try:
            batch = next(self._batches)
        except BaseException:
            self.close()
            raise
        return batch.unpack() if isinstance(batch, PackedBatch) else batch

    def close(self) -> None:
        """End the workers and thread reading ahead; the pass yields nothing more."""
        self._open_batches = None
        # The DataLoader's iterator shuts its workers down when it is freed, but a traceback
        # that holds its frame keeps it alive: shut them down now where it can.
        shutdown = getattr(self._batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._batches = None

    def __enter__(self) -> "EpochBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


@contextlib.contextmanager
def batches_of(loader) -> Iterator[Iterator]:
    """``with batches_of(loader) as batches``: one pass, closed however the block ends.

    Closes what ``iter(loader)`` returned when it has ``close`` (an :class:`EpochBatches`,
    a generator); other iterators (a ``torch.utils.data.DataLoader``'s) end as they do.
    """
    batches = iter(loader)
    try:
        yield batches
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def first_batch(loader):
    """The first batch of ``loader``, or None when it is empty; the pass is closed.

    A :class:`ShardedLoader` is left at the epoch and resume point it was at: a probe must not
    move the data order of the run that follows it.
    """
    saved = (loader.epoch, loader._skip_rows) if isinstance(loader, ShardedLoader) else None
    try:
        with batches_of(loader) as batches:
            return next(batches, None)
    finally:
        if saved is not None:
            loader.epoch, loader._skip_rows = saved


class ShardedLoader:
    """This rank's shard of a Merlin dataset as ``(inputs, targets)`` batches.

    Parameters
    ----------
    dataset : merlin.io.Dataset
    state : DistributedState
        ``rank``/``world_size`` pick the shard (global rank, not local).
    batch_size : int
        Rows per batch that this process loads (:func:`make_loader` turns a
        per-device batch size into this).
    input_names, target_names : sequence of str
        Columns to load.
    max_sequence_length : int or None
        List columns are cropped and padded to this length by
        :func:`merlin_t4r_ops.sequence.crop_and_pad` (most recent items kept, as the
        operator serves them); None leaves ragged columns as values/offsets pairs.
    shuffle : bool
        Shuffle the partition order, hence the shards, and the rows within each
        partition, every epoch, from ``(seed, epoch)``: every rank draws the
        same order, so the shards stay disjoint.
    seed : int
        Non-negative.
    drop_last : bool
    equal_shards : bool
        Give every rank the same number of rows (and batches) by repeating at
        most ``world_size - 1`` rows per epoch, as ``DistributedSampler`` pads.
        For training, where every step is a collective; evaluation leaves it
        off so that no row counts twice.
    num_workers : int, optional
        Worker processes that read, convert and pad batches ahead of the step
        (``torch.utils.data.DataLoader``'s). Default 0: this process makes them, which
        kept a GPU busiest (see :func:`worker_share`). More than this rank's
        :func:`worker_share` warns.
    pin_memory : bool, optional
        Batches in page-locked memory, so that ``to_device(..., non_blocking=True)``
        copies overlap the step. Default: when ``state.device`` is CUDA.
    device_batches : bool, optional
        Make the batches on ``state.device``: a padded batch of ragged numeric lists is
        gathered there from its partition's values, copied there once per read (one
        upload of positions a batch instead of a numpy gather and a pinned copy of every
        column), any other batch is copied there. The partitions cached (the last two read,
        three while the next one is read) hold their columns on the GPU, and each one's
        upload waits for the GPU. Default: on a CUDA device with no workers and
        ``pin_memory`` not False, except under ``dp``, whose batches DataParallel scatters
        from the host. ``True`` pins its uploads whatever ``pin_memory`` says; ``False``
        keeps batches on the host (pinned, as ``pin_memory`` says).

    Notes
    -----
    Each pass over the loader reads the next epoch, as a shuffling
    ``torch.utils.data.DataLoader`` would; :meth:`set_epoch` picks the epoch
    of the next pass, as with ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset,
        state: DistributedState,
        batch_size: int,
        input_names: Sequence[str],
        target_names: Sequence[str] = (),
        max_sequence_length: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        equal_shards: bool = False,
        num_workers: Optional[int] = None,
        pin_memory: Optional[bool] = None,
        device_batches: Optional[bool] = None,
    ):
        from merlin.schema import Tags

        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
            raise ValueError(f"num_workers must be None or a non-negative int, got {num_workers!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        names = list(input_names) + [t for t in target_names if t not in input_names]
        missing = [n for n in names if n not in dataset.schema.column_names]
        if missing:
            raise KeyError(
                f"the model needs columns {missing} that the dataset schema lacks; "
                f"dataset has {dataset.schema.column_names}"
            )
        schema = dataset.schema.select_by_name(names)
        for name in target_names:
            # Merlin splits a batch into (x, y) by the TARGET tag.
            schema[name] = schema[name].with_tags(Tags.TARGET)
        for name in input_names:
            if Tags.TARGET in schema[name].tags:
                # A model feature that the data tags as a target stays a feature.
                schema[name] = _without_target_tag(schema[name])
        self.dataset = dataset
        self.schema = schema
        self.state = state
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.drop_last = drop_last
        self.equal_shards = equal_shards
        self.max_sequence_length = max_sequence_length
        self.list_columns = [c.name for c in schema if c.is_list]
        self.id_columns = [c.name for c in schema if Tags.CATEGORICAL in c.tags]
        self.partition_lengths = _partition_lengths(dataset)
        self.num_workers = 0 if num_workers is None else int(num_workers)
        if self.num_workers > worker_share(state):
            warnings.warn(
                f"num_workers={self.num_workers} is more than this rank's share of the cores "
                f"({worker_share(state)}: this process's {_cores()} cores over "
                f"{state.local_world_size} local ranks); the workers and the training step will "
                "compete for them",
                stacklevel=2)
        on_cuda = state.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory is None else bool(pin_memory) and on_cuda
        self.device_batches = _device_batches(device_batches, state, self.num_workers,
                                              pin_memory)
        self._reader = partition_reader(dataset, schema.column_names, self.partition_lengths)
        self._layout = ColumnLayout.from_schema(schema)
        self._passes = weakref.WeakSet()
        self._skip_rows = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Make the next pass read ``epoch`` (same order on every rank).

        ``skip_batches``: the next pass starts after that many of its batches (a run
        resumed mid-epoch); their rows are not read. Later passes start at their first.
        """
        if not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"skip_batches must be a non-negative int, got {skip_batches!r}")
        self.epoch = int(epoch)
        self._skip_rows = skip_batches * self.batch_size

    def shard(self, epoch: int) -> List[Tuple[int, int, int]]:
        """``(partition, start, stop)`` row ranges this rank reads in ``epoch``, in order."""
        n = len(self.partition_lengths)
        order = range(n)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        return shard_rows(
            self.partition_lengths, list(order), self.state.rank, self.state.world_size,
            self.equal_shards,
        )

    @property
    def num_rows(self) -> int:
        """Rows this rank reads per epoch (the same every epoch)."""
        return sum(stop - start for _, start, stop in self.shard(0))

    def __len__(self) -> int:
        rows = self.num_rows
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def __iter__(self) -> EpochBatches:
        epoch, skip_rows = self.epoch, self._skip_rows
        self.epoch, self._skip_rows = epoch + 1, 0
        batches = self._batches(epoch, skip_rows)
        self._passes.add(batches)
        return batches

    def close(self) -> None:
        """Close every pass still open (see :class:`EpochBatches`)."""
        for batches in list(self._passes):
            batches.close()

    def epoch_dataset(self, epoch: int, skip_rows: int = 0) -> EpochDataset:
        """This rank's batches of ``epoch`` after its first ``skip_rows`` rows, as a
        ``torch.utils.data.IterableDataset`` (what each pass iterates through a ``DataLoader``)."""
        pieces = _after_rows(self.shard(epoch), skip_rows)
        pad = None
        if self.max_sequence_length:
            pad = PadSpec(self.max_sequence_length, tuple(self.list_columns),
                          tuple(self.id_columns))
        return EpochDataset(
            self._reader, self._layout, plan_batches(pieces, self.batch_size, self.drop_last),
            self.partition_lengths, self.seed, epoch, self.shuffle, pad,
            device=self.state.device if self.device_batches else None,
        )

    def _open_batches(self, epoch: int, skip_rows: int):
        batches = self.epoch_dataset(epoch, skip_rows)
        if not len(batches):
            return None
        workers = min(self.num_workers, len(batches))  # a worker without a batch costs a start
        loader = torch.utils.data.DataLoader(
            batches, batch_size=None, num_workers=workers,
            pin_memory=self.pin_memory and not self.device_batches,
            # Its own generator: each pass would otherwise draw a seed from torch's global
            # RNG, moving the model's random stream (MLM masks, dropout) by one draw a pass.
            generator=torch.Generator(),
        )
        return iter(loader)

    def _batches(self, epoch: int, skip_rows: int) -> EpochBatches:
        return EpochBatches(lambda: self._open_batches(epoch, skip_rows))


def _device_batches(asked: Optional[bool], state: DistributedState, workers: int,
                    pin_memory: Optional[bool]) -> bool:
    """Whether batches are made on ``state.device`` (see :class:`ShardedLoader`)."""
    if asked is None:
        return (state.device.type == "cuda" and workers == 0 and state.strategy != "dp"
                and pin_memory is not False)  # its uploads are pinned
    if asked and workers:
        raise ValueError(f"device_batches=True makes batches in this process; it takes "
                         f"num_workers=0, got num_workers={workers}")
    return bool(asked)


def _after_rows(pieces, skip_rows: int) -> List[Tuple[int, int, int]]:
    """``pieces`` (``(partition, start, stop)`` in reading order) without their first rows.

    Batches are cut from consecutive rows (:func:`~.columnar.plan_batches`), so dropping
    ``k * batch_size`` rows makes them the ones after the first ``k`` of the full pass.
    """
    kept = []
    for partition, start, stop in pieces:
        dropped = min(skip_rows, stop - start)
        skip_rows -= dropped
        if start + dropped < stop:
            kept.append((partition, start + dropped, stop))
    return kept


def _cores() -> int:
    """The cores this process may run on (its affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_share(state: DistributedState) -> int:
    """A rank's share of the cores: the most loader workers it may ask for without a warning.

    The cores this process may use (its affinity) are shared by the node's ranks (torchrun's
    ``LOCAL_WORLD_SIZE``): ``cores // local_world_size``. The training process runs on the
    same cores, so a rank that takes its whole share still shares one with its workers.

    Workers are not the default. On the H200 machine (16 cores), ``fit`` at T4R's tutorial
    setting reached 0.89, 0.77, 0.70 and 0.66 of the model's own pace with 0, 2, 4 and 8
    workers, and at batch 1024, d_model 128, 0.67, 0.55 and 0.52 with 0, 2 and 4
    (``benchmarks/training.py --workers-sweep``; docs/benchmarks.md). The columnar loader
    makes a batch in about a millisecond, and a host-bound step loses more to receiving
    and pinning batches from other processes than it gains from their overlap. Workers pay
    off where reading is slow (remote storage, heavy decoding).
    """
    return _cores() // max(1, state.local_world_size)


def make_loader(
    data,
    model,
    state: DistributedState,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    equal_shards: bool = False,
    schema=None,
    num_workers: Optional[int] = None,
    pin_memory: Optional[bool] = None,
    device_batches: Optional[bool] = None,
) -> Union[ShardedLoader, Iterable]:
    """Turn ``data`` into this rank's batches for ``model``.

    Parameters
    ----------
    data : str, os.PathLike, list of them, merlin.io.Dataset, or iterable of (x, y)
        Parquet file(s)/directory(ies) (with ``schema.pbtxt``) or a Dataset are
        sharded by global rank; anything else is taken as a ready dataloader
        and used as is (shard it yourself under DDP).
    model : transformers4rec.torch.Model
        Gives the columns and the sequence length
        (:func:`merlin_t4r_ops.sequence.resolve_sequence_length`, required under ``dp``).
    state : DistributedState
    batch_size : int
        Per device, as in Hugging Face: a DataParallel process loads
        ``batch_size * state.n_devices`` rows per batch, which DataParallel
        splits over its GPUs.
    shuffle, seed, drop_last, equal_shards
        See :class:`ShardedLoader`.
    schema : optional
        Replaces the dataset's own schema (see :func:`as_dataset`).
    num_workers, pin_memory, device_batches : optional
        See :class:`ShardedLoader`.
    """
    from merlin.io import Dataset

    is_path = isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, os.PathLike)) for d in data)
    )
    if not (is_path or isinstance(data, Dataset)):
        if not hasattr(data, "__iter__"):
            raise TypeError(
                "data must be parquet path(s), a merlin.io.Dataset or an iterable of (x, y) "
                f"batches, got {type(data).__name__}"
            )
        return data
    inputs, targets = model_columns(model)
    width = resolve_sequence_length(
        unwrap_model(model), required_for=DP_NEEDS_WIDTH if state.strategy == "dp" else None
    )
    return ShardedLoader(
        as_dataset(data, schema),
        state,
        batch_size * state.n_devices,
        inputs,
        targets,
        max_sequence_length=width,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        equal_shards=equal_shards,
        num_workers=num_workers,
        pin_memory=pin_memory,
        device_batches=device_batches,
    )


def to_device(batch, device: torch.device):
    """Move a nested structure of tensors (dicts, lists, tuples) to ``device``."""
    return send_to_device(batch, device, non_blocking=True)
