"""Per-rank Merlin dataloaders that feed a T4R model dense, padded batches.

Sharding is by *global* rank (``DistributedState.rank``), so it is the same
whether the ranks live on one node or several. Merlin's ``Loader`` assigns each
rank a contiguous block of dataset partitions; we repartition to a multiple of
the world size first so the blocks are disjoint, cover the whole dataset and
are close to equal (``fit`` still tolerates unequal shards with DDP's ``join``).

List columns are cropped and padded inside the loader, by the rule and to the
width that the operator serves with (:mod:`merlin_t4r_ops.sequence`): dense
tensors are what ``DataParallel`` can scatter along the batch dimension
(Merlin's ragged ``__values``/``__offsets`` pairs cannot be split that way).
"""

import glob
import os
from typing import Iterable, Optional, Sequence, Union

import torch

from merlin_t4r_ops.sequence import pad_lists_fn, resolve_sequence_length
from merlin_t4r_ops.training.metrics import prediction_tasks
from merlin_t4r_ops.training.state import DistributedState, unwrap_model

__all__ = ["ShardedLoader", "make_loader", "model_columns", "to_device"]

DP_NEEDS_WIDTH = (
    "strategy 'dp' needs dense [batch, width] tensors to split along the batch dimension "
    "(it would split ragged values and offsets independently)"
)


def model_columns(model):
    """``(input_names, target_names)`` a T4R model reads from a batch."""
    model = unwrap_model(model)
    inputs = list(model.input_schema.column_names)
    targets = []
    for _, task in prediction_tasks(model):
        name = getattr(task, "target_name", None)
        if name and name not in targets:
            targets.append(name)
    return inputs, targets


def _as_dataset(data):
    from merlin.io import Dataset

    if isinstance(data, Dataset):
        return data
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
    # Dataset finds schema.pbtxt next to the files, which carries the T4R tags.
    return Dataset(files, engine="parquet")


class ShardedLoader:
    """This rank's shard of a Merlin dataset as ``(inputs, targets)`` batches.

    Parameters
    ----------
    dataset : merlin.io.Dataset
    state : DistributedState
        ``rank``/``world_size`` pick the shard (global rank, not local).
    batch_size : int
        Per-rank batch size.
    input_names, target_names : sequence of str
        Columns to load.
    max_sequence_length : int or None
        List columns are cropped and padded to this length by
        :func:`merlin_t4r_ops.sequence.crop_and_pad` (most recent items kept, as the
        operator serves them); None leaves ragged columns as values/offsets pairs.
    shuffle : bool
        Shuffle partitions and rows each epoch, from ``seed + epoch`` so every
        rank draws the same partition order and the shards stay disjoint.
    seed : int
    drop_last : bool

    Notes
    -----
    Call :meth:`set_epoch` before each epoch when shuffling, as with
    ``torch.utils.data.DistributedSampler``.
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
    ):
        from merlin.dataloader.torch import Loader
        from merlin.schema import Tags

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
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
                schema[name] = schema[name].without_tags(Tags.TARGET)
        world = state.world_size
        if dataset.npartitions % world:
            # Disjoint blocks of partitions per rank need a multiple of world_size;
            # splitting every partition into world_size pieces keeps the blocks balanced.
            dataset = dataset.repartition(npartitions=dataset.npartitions * world)
        dataset.schema = schema
        self.dataset = dataset
        self.state = state
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.max_sequence_length = max_sequence_length
        self.list_columns = [c.name for c in schema if c.is_list]
        device = state.device.index if state.device.type == "cuda" else "cpu"
        self._loader = Loader(
            dataset,
            batch_size,
            shuffle=shuffle,
            seed_fn=lambda: self.seed + self.epoch,
            global_size=world if world > 1 else None,
            global_rank=state.rank if world > 1 else None,
            drop_last=drop_last,
            device=device,
        )

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for ``epoch`` (same order on every rank)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self):
        pad = None
        if self.max_sequence_length:
            pad = pad_lists_fn(self.max_sequence_length, self.list_columns)
        for x, y in self._loader:
            if pad:
                x, y = pad(x, y)
            yield x, y


def make_loader(
    data,
    model,
    state: DistributedState,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
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
        Per-rank batch size.
    shuffle, seed, drop_last
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
        _as_dataset(data),
        state,
        batch_size,
        inputs,
        targets,
        max_sequence_length=width,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def to_device(batch, device: torch.device):
    """Move a nested structure of tensors (dicts, lists, tuples) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
