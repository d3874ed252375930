"""A batch's list columns cropped and padded straight from its partitions' Arrow buffers.

The general path takes a batch's rows out of its partition (an Arrow ``take`` of every list),
turns each list column into values and offsets (:func:`~.columnar.batch_tensors`), then
gathers those into ``[rows, width]`` (:func:`~merlin_t4r_ops.sequence.pad_lists_fn`): three
copies of every list a batch, and about 3 ms of a 1024-session batch on a 2-core CPU, on the
training thread. When every list column is ragged with flat numeric values, the gather can
read the partition's own values: one numpy gather a column a batch, at the positions the one
crop-and-pad rule gives (:func:`~merlin_t4r_ops.sequence.session_lengths`,
``_gather_index``). The tensors, keys, order and dtypes are the general path's; anything
else (fixed or nested lists, nulls, text) goes the general path, which also words its errors.

On a GPU the gather can run there (``device``): the partition's values are copied to it
once per read, and a batch costs the host its index math and one upload of the positions,
where a host gather costs a numpy gather a column, then pinning and copying every tensor
(3-4 ms of a 1024-session step on the H100 host's profile, issue 22).
"""

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import torch

from merlin_t4r_ops.errors import SessionLengthError
from merlin_t4r_ops.sequence import _gather_index, session_lengths

__all__ = ["PartitionArrays", "padded_batch", "copy_to"]

ArrayOrTensor = Union[np.ndarray, torch.Tensor]


def _numeric(data_type) -> bool:
    return (pa.types.is_integer(data_type) or pa.types.is_floating(data_type)
            or pa.types.is_boolean(data_type))


class PartitionArrays:
    """A partition's columns, made once per read: what :func:`padded_batch` gathers. As numpy,
    or (:meth:`to`) as tensors on a device.

    ``scalars``: name to values. ``values``: list column name to its values with one zero
    appended (the padding that index -1 reads, as ``_take_padded`` appends it): a copy, so
    a cached partition's lists are held twice while it is cached. ``offset_groups``:
    ``(offsets from 0, names)``, one for each set of list columns whose offsets are equal
    (T4R's features of one session usually are: one gather index serves them all).
    """

    def __init__(self, scalars: Dict[str, np.ndarray], values: Dict[str, np.ndarray],
                 offset_groups: List[Tuple[np.ndarray, List[str]]]):
        self.scalars, self.values, self.offset_groups = scalars, values, offset_groups
        self.device: Optional[torch.device] = None

    @staticmethod
    def fits(layout) -> bool:
        """Whether batches of ``layout`` can come from here: ragged lists, scalar targets."""
        return (all(kind in ("scalar", "ragged") for kind in layout.kinds.values())
                and all(layout.kinds[name] == "scalar" for name in layout.targets))

    @classmethod
    def of(cls, table: pa.Table, layout) -> Optional["PartitionArrays"]:
        """The partition's arrays, or None where the general path must make its batches."""
        if not cls.fits(layout):
            return None
        scalars, values, groups = {}, {}, []
        for name, kind in layout.kinds.items():
            column = table.column(name).combine_chunks()
            if column.null_count:
                return None
            if kind == "scalar":
                if not _numeric(column.type):
                    return None
                scalars[name] = column.to_numpy(zero_copy_only=False)  # bool needs a copy
                continue
            if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
                return None
            flat = column.flatten()  # a sliced array's values only
            if flat.null_count or not _numeric(flat.type):
                return None
            flat = flat.to_numpy(zero_copy_only=False)
            values[name] = np.concatenate([flat, np.zeros(1, flat.dtype)])
            _join_group(groups, _offsets_from_zero(column), name)
        return cls(scalars, values, groups)

    def to(self, device: torch.device) -> "PartitionArrays":
        """These arrays gathered on ``device``: scalars and values as tensors there, but for
        dtypes torch may not index there (unsigned wider than a byte), which stay numpy and
        are gathered on the host. The offsets stay numpy: the index math runs on the host.
        Where no column could move, the partition stays the host's: no positions uploaded."""
        def moved(a):
            return a if a.dtype.kind == "u" and a.itemsize > 1 else torch.tensor(a, device=device)

        arrays = PartitionArrays({name: moved(a) for name, a in self.scalars.items()},
                                 {name: moved(a) for name, a in self.values.items()},
                                 self.offset_groups)
        columns = [*arrays.scalars.values(), *arrays.values.values()]
        if any(isinstance(column, torch.Tensor) for column in columns):
            arrays.device = torch.device(device)
        return arrays

    def padded(self, rows: np.ndarray, width: int, id_columns) -> Dict[str, ArrayOrTensor]:
        """``rows``' columns: scalars taken, lists ``[rows, width]`` as the rule crops them
        (numpy, or tensors on :attr:`device` once :meth:`to` moved them there).

        Raises
        ------
        SessionLengthError
            When the rows' list columns disagree on a session's length.
        """
        ends = [offsets[rows + 1] for offsets, _ in self.offset_groups]
        # One length array a group: its columns share their offsets, hence their lengths.
        group_lengths = [end - offsets[rows] for (offsets, _), end in zip(self.offset_groups, ends)]
        lengths = {name: length for (_, names), length in zip(self.offset_groups, group_lengths)
                   for name in names}
        session = session_lengths(lengths, id_columns)
        on_host = [rows, *(_gather_index(end, session, width) for end in ends)]
        # Where the values are: positions on the device for tensors, on the host for numpy.
        on_device = on_host if self.device is None else _upload(on_host, self.device)

        def positions(values, which):
            return on_host[which] if isinstance(values, np.ndarray) else on_device[which]

        out = {name: values[positions(values, 0)] for name, values in self.scalars.items()}
        for group, (_, names) in enumerate(self.offset_groups, start=1):
            for name in names:
                values = self.values[name]
                out[name] = values[positions(values, group)]  # -1 reads the zero appended last
        return out


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host ``tensor`` on ``device``: to a GPU from pinned memory, without waiting."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _upload(arrays: List[np.ndarray], device: torch.device) -> List[torch.Tensor]:
    """``arrays`` (int64) as tensors on ``device``, in one copy from pinned memory."""
    joined = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64))
    joined = copy_to(joined, device)
    return [part.view(a.shape) for part, a in
            zip(joined.split([a.size for a in arrays]), arrays)]


def _offsets_from_zero(column: pa.Array) -> np.ndarray:
    """A list array's offsets as int64 from 0 (a sliced array's start where its values do)."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0]


def _join_group(groups: List[Tuple[np.ndarray, List[str]]], offsets: np.ndarray,
                name: str) -> None:
    for kept, names in groups:
        if np.array_equal(kept, offsets):
            names.append(name)
            return
    groups.append((offsets, [name]))


def padded_batch(parts: Sequence[Tuple[PartitionArrays, np.ndarray]], layout, width: int,
                 id_columns) -> Optional[Dict[str, torch.Tensor]]:
    """Every column of the rows ``parts`` names (partition arrays, their rows), in the
    layout's order, or None where the general path must make them (its error names the row
    of the whole batch where list columns disagree)."""
    try:
        pieces: List[Dict[str, ArrayOrTensor]] = [
            arrays.padded(rows, width, id_columns) for arrays, rows in parts]
    except SessionLengthError:
        return None
    return {name: _joined([piece[name] for piece in pieces]) for name in layout.kinds}


def _joined(columns: list) -> torch.Tensor:
    """One column of a batch from its partitions' pieces: numpy joined on the host, tensors
    on their device."""
    if all(isinstance(column, np.ndarray) for column in columns):
        return torch.from_numpy(columns[0] if len(columns) == 1 else np.concatenate(columns))
    if len(columns) == 1:
        return columns[0]
    tensors = [torch.from_numpy(c) if isinstance(c, np.ndarray) else c for c in columns]
    if len({tensor.dtype for tensor in tensors}) > 1:
        # Files that store the column in other dtypes: numpy promotes them, as on the host
        # (torch does not promote the unsigned dtypes). Rare enough to wait for the device.
        return torch.from_numpy(np.concatenate([tensor.cpu().numpy() for tensor in tensors]))
    device = next(c.device for c in columns if isinstance(c, torch.Tensor))
    return torch.cat([tensor.to(device) for tensor in tensors])
