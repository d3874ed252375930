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
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import torch

from merlin_t4r_ops.errors import SessionLengthError
from merlin_t4r_ops.sequence import _gather_index, session_lengths

__all__ = ["PartitionArrays", "padded_batch"]


def _numeric(data_type) -> bool:
    return (pa.types.is_integer(data_type) or pa.types.is_floating(data_type)
            or pa.types.is_boolean(data_type))


class PartitionArrays:
    """A partition's columns as numpy, made once per read: what :func:`padded_batch` gathers.

    ``lists``: name to ``(values, offsets)``, the values with one zero appended (the padding
    that index -1 reads, as ``_take_padded`` appends it) and int64 offsets from 0; columns
    whose offsets are equal share one offsets array. ``scalars``: name to values.
    """

    def __init__(self, scalars: Dict[str, np.ndarray],
                 lists: Dict[str, Tuple[np.ndarray, np.ndarray]]):
        self.scalars, self.lists = scalars, lists

    @classmethod
    def of(cls, table: pa.Table, layout) -> Optional["PartitionArrays"]:
        """The partition's arrays, or None where the general path must make its batches."""
        if any(layout.kinds[name] != "scalar" for name in layout.targets):
            return None
        scalars, lists, shared = {}, {}, []
        for name, kind in layout.kinds.items():
            column = table.column(name).combine_chunks()
            if column.null_count:
                return None
            if kind == "scalar":
                if not _numeric(column.type):
                    return None
                scalars[name] = column.to_numpy()
                continue
            if kind != "ragged" or not (pa.types.is_list(column.type)
                                        or pa.types.is_large_list(column.type)):
                return None
            values = column.flatten()
            if values.null_count or not _numeric(values.type):
                return None
            offsets = column.offsets.to_numpy().astype(np.int64)
            offsets -= offsets[0]  # a sliced array's offsets start where its values do
            offsets = next((o for o in shared if np.array_equal(o, offsets)), offsets)
            if not any(o is offsets for o in shared):
                shared.append(offsets)
            values = values.to_numpy(zero_copy_only=False)
            lists[name] = (np.concatenate([values, np.zeros(1, values.dtype)]), offsets)
        return cls(scalars, lists)

    def padded(self, rows: np.ndarray, width: int, id_columns) -> Dict[str, np.ndarray]:
        """``rows``' columns: scalars taken, lists ``[rows, width]`` as the rule crops them.

        Raises
        ------
        SessionLengthError
            When the rows' list columns disagree on a session's length.
        """
        ends = {id(o): o[rows + 1] for _, o in self.lists.values()}
        lengths = {name: ends[id(o)] - o[rows] for name, (_, o) in self.lists.items()}
        session = session_lengths(lengths, id_columns)
        index = {key: _gather_index(end, session, width) for key, end in ends.items()}
        out = {name: values[rows] for name, values in self.scalars.items()}
        for name, (values, offsets) in self.lists.items():
            out[name] = values[index[id(offsets)]]  # -1 reads the zero appended last
        return out


def padded_batch(parts: Sequence[Tuple[PartitionArrays, np.ndarray]], layout, width: int,
                 id_columns) -> Optional[Dict[str, torch.Tensor]]:
    """Every column of the rows ``parts`` names (partition arrays, their rows), in the
    layout's order, or None where the general path must make them (its error names the row
    of the whole batch where list columns disagree)."""
    try:
        pieces: List[Dict[str, np.ndarray]] = [
            arrays.padded(rows, width, id_columns) for arrays, rows in parts]
    except SessionLengthError:
        return None
    tensors = {}
    for name in layout.kinds:
        joined = pieces[0][name] if len(pieces) == 1 else np.concatenate(
            [piece[name] for piece in pieces])
        tensors[name] = torch.from_numpy(joined)
    return tensors
