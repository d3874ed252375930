"""Array twins of NVTabular ops over Merlin ``TensorTable`` columns (values and offsets).

Each twin runs on the CPU with numpy, and is exact against NVTabular 23.08 on the CPU
(``tests/test_workflow_fast_path.py``); where it cannot be (nulls inside a list column), the
column goes to the NVTabular op itself.
"""

import numpy as np
import pandas as pd
from pandas.api.types import infer_dtype
from merlin.dag import BaseOperator, ColumnSelector, DataFormats
from merlin.table import TensorColumn, TensorTable
from nvtabular.ops.categorify import NULL_OFFSET, OOV_OFFSET


class _ArrayTwin(BaseOperator):
    """An NVTabular op's stand-in in a compiled graph: same node, same schemas, numpy work."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    @property
    def supported_formats(self) -> DataFormats:
        return DataFormats.NUMPY_TENSOR_TABLE

    # Whether the NVTabular op returns the other columns of its input beside the ones it
    # transforms (Categorify, LogOp) or those alone (ListSlice, Normalize): what a node
    # returns decides what its children merge.
    keeps_other_columns = True

    def transform(self, col_selector: ColumnSelector, table: TensorTable) -> TensorTable:
        columns = dict(table.items()) if self.keeps_other_columns else {}
        for name in col_selector.names:
            columns[name] = self.column(name, table[name])
        return TensorTable(columns, _unsafe=True)

    def column(self, name: str, column: TensorColumn) -> TensorColumn:
        raise NotImplementedError


# From about this many string ids a hash lookup beats casting and bisecting; below it,
# pandas' get_indexer's fixed cost does not pay off (benchmarks/workflow_lookup.py).
_HASHED_FROM = 512


class CategorifyArrays(_ArrayTwin):
    """``Categorify`` as a lookup in its sorted vocabulary (``searchsorted``); string ids
    in a hash index of it (:func:`_string_index`).

    The ids of the vocabulary are what the fitted ``Categorify`` itself gives each value
    (its table, ``freq_threshold`` and ``max_size`` applied at fit), so they are exact by
    construction; a value not in the vocabulary gets the out-of-vocabulary id (2), a null
    scalar the null id (1), as ``nvtabular.ops.categorify._encode`` does.
    """

    def __init__(self, op, names, output_dtypes):
        super().__init__(op)
        self.output_dtypes = output_dtypes
        self.vocabularies = {name: _vocabulary(op, name) for name in names}
        self.string_indexes = _string_indexes(self.vocabularies)

    # The hash indexes are rebuilt where the export is loaded, not pickled into it: the
    # artifact stays as it was, and one exported before them loads too.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "string_indexes"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.string_indexes = _string_indexes(self.vocabularies)

    def column(self, name, column):
        values, offsets = np.asarray(column.values), column.offsets
        sorted_values, ids = self.vocabularies[name]
        index = self.string_indexes[name]
        if values.dtype.kind == "O" and pd.isna(values).any():
            if offsets is not None:  # nulls inside lists: NVTabular's own rule (not 1)
                return self._by_nvtabular(name, column)
            nulls = pd.isna(values)
            encoded = np.full(len(values), NULL_OFFSET, dtype=np.int64)
            encoded[~nulls] = self._lookup(values[~nulls], sorted_values, ids, index)
        elif (values.dtype.kind == "f" and sorted_values.dtype.kind != "f"
              and np.isnan(values).any()):
            return self._by_nvtabular(name, column)  # NVTabular refuses NaN into int ids
        else:
            encoded = self._lookup(values, sorted_values, ids, index)
        encoded = encoded.astype(self.output_dtypes[name], copy=False)
        return TensorColumn(encoded, offsets=offsets, _unsafe=True)

    @staticmethod
    def _lookup(values, sorted_values, ids, string_index=None):
        if sorted_values.dtype.kind != "U":
            # NVTabular casts to the table's dtype
            return _bisect(values.astype(sorted_values.dtype), sorted_values, ids)
        if values.dtype.kind not in "OUS":  # an int never equals a string id
            return np.full(len(values), OOV_OFFSET, dtype=np.int64)
        if (string_index is not None and len(values) >= _HASHED_FROM
                and values.dtype.kind == "O" and infer_dtype(values, skipna=False) == "string"):
            return _hashed(values, sorted_values, ids, string_index)
        return _bisect(values.astype(str), sorted_values, ids)

    def _by_nvtabular(self, name, column):
        frame = TensorTable({name: column}).to_df()
        encoded = self.op.transform(ColumnSelector([name]), frame)
        return TensorTable.from_df(encoded[[name]])[name]


def _vocabulary(op, name):
    """(sorted raw values, their ids) of one column of a fitted ``Categorify``."""
    # Imported here: the operators' package (torch) stays out of a workflow's unpickling.
    from merlin_t4r_ops.ops.vocabulary import unique_values

    raw = unique_values(op, name).dropna().reset_index(drop=True)
    ids = op.transform(ColumnSelector([name]), pd.DataFrame({name: raw}))[name].to_numpy()
    values = raw.to_numpy()
    if values.dtype.kind == "O":
        values = values.astype(str)
    order = np.argsort(values, kind="stable")
    return values[order], ids[order].astype(np.int64)


def _bisect(values, sorted_values, ids):
    """The ids of ``values`` in the sorted vocabulary, out-of-vocabulary where absent."""
    if not len(sorted_values):
        return np.full(len(values), OOV_OFFSET, dtype=np.int64)
    position = np.searchsorted(sorted_values, values).clip(max=len(sorted_values) - 1)
    return np.where(sorted_values[position] == values, ids[position], OOV_OFFSET)


def _hashed(values, sorted_values, ids, string_index):
    """``_bisect(values.astype(str), ...)`` for ``str`` objects, from a hash index.

    A hit is a string equal to a vocabulary id, which the cast would leave as it is. The
    misses (unknown ids, mostly) are cast and bisected as before: fixed-width text drops
    trailing NUL characters, so ``"a\\x00"`` still finds ``"a"`` there, as it always did.
    """
    position = string_index.get_indexer(values)
    encoded = ids[position]  # a miss (-1) is overwritten below
    missed = position < 0
    if missed.any():
        encoded[missed] = _bisect(values[missed].astype(str), sorted_values, ids)
    return encoded


def _string_indexes(vocabularies):
    return {name: _string_index(sorted_values)
            for name, (sorted_values, _) in vocabularies.items()}


def _string_index(sorted_values):
    """A hash index of a string vocabulary; None for numbers, and for a vocabulary where
    two raw ids read as one string (``1`` and ``"1"``), which ``searchsorted`` resolves."""
    if sorted_values.dtype.kind != "U":
        return None
    index = pd.Index(sorted_values.astype(object))
    return index if index.is_unique else None


class ListSliceArrays(_ArrayTwin):
    """``ListSlice(start, end)`` without padding: Python's slice of every row, by offsets."""

    keeps_other_columns = False

    def column(self, name, column):
        offsets = np.asarray(column.offsets).astype(np.int64)
        lengths = np.diff(offsets)
        start = _slice_bound(self.op.start, lengths)
        end = np.maximum(_slice_bound(self.op.end, lengths), start)
        kept = end - start
        new_offsets = np.concatenate([[0], np.cumsum(kept)])
        within = np.arange(new_offsets[-1]) - np.repeat(new_offsets[:-1], kept)
        taken = np.repeat(offsets[:-1] + start, kept) + within
        values = np.asarray(column.values)[taken]
        return TensorColumn(values, offsets=new_offsets.astype(column.offsets.dtype),
                            _unsafe=True)


def _slice_bound(bound, lengths):
    """Where ``row[bound]`` of a Python slice falls in each row of ``lengths``."""
    if bound < 0:
        return np.maximum(lengths + bound, 0)
    return np.minimum(bound, lengths)


class LogOpArrays(_ArrayTwin):
    """``LogOp``: ``log(x + 1)`` in float32, on scalars and on list values alike."""

    def column(self, name, column):
        values = np.log(np.asarray(column.values).astype(self.op.output_dtype) + 1)
        return TensorColumn(values, offsets=column.offsets, _unsafe=True)


class NormalizeArrays(_ArrayTwin):
    """``Normalize``: the fitted mean and standard deviation, NVTabular's arithmetic."""

    keeps_other_columns = False

    def column(self, name, column):
        values = np.asarray(column.values)
        mean, std = self.op.means[name], self.op.stds[name]
        values = (values - mean) / std if std > 0 else values - mean
        return TensorColumn(values.astype(self.op.output_dtype), offsets=column.offsets,
                            _unsafe=True)
