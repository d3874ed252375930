"""``Groupby`` of event rows into sessions, as a sort and a segmentation of numpy arrays.

NVTabular 23.08's ``Groupby`` on the CPU sorts the frame by ``sort_cols``
(``DataFrame.sort_values``: one column with numpy's quicksort, which is not stable, several
with a stable lexicographic sort, nulls last), then runs pandas' ``groupby(...).agg``: groups
in the order of their keys, rows with a null key dropped, each group's rows in the sorted
frame's order. ``first`` is the list's first element, ``last`` its last (swapped when
``ascending=False``), ``count`` the number of non-null values (int32). The twin does the same
steps with the same sorts, so ties in ``sort_cols`` land where they land under pandas.

pandas hands ``list``, ``first`` and ``last`` through Python objects, so their dtypes are not
the input's (an int32 column comes out int64, a float32 one float64): the twin learns them by
running the NVTabular op once on a stand-in frame of the same input dtypes. What it cannot
reproduce exactly (an empty table, nulls in an aggregated column, dtypes other than
bool, int, float and object, uint64) goes to the NVTabular op itself.
"""

import numpy as np
import pandas as pd
from dask.dataframe.utils import meta_nonempty
from merlin.table import TensorColumn, TensorTable

from merlin_t4r_ops.workflow.arrays import _ArrayTwin

# What the twin computes; any other aggregation keeps the workflow on NVTabular.
AGGREGATIONS = frozenset(["list", list, "count", "first", "last"])
_EXACT_KINDS = "biufO"
_LARGEST_GROUP_CODE = 2**62


def groupby_twin(op, node):
    """The twin of ``node``'s ``Groupby``, or None where it would not be exact."""
    selection = node.input_columns.resolve(node.input_schema)
    schema = node.input_schema
    used = [*op.groupby_cols, *op.sort_cols, *selection.names]
    aggregations = [agg for aggs in [*op.list_aggs.values(), *op.conv_aggs.values()]
                    for agg in aggs]
    if (not isinstance(op.ascending, bool) or not set(aggregations) <= AGGREGATIONS
            or any(name not in schema.column_names or schema[name].is_list for name in used)):
        return None
    return GroupbyArrays(op, selection)


class GroupbyArrays(_ArrayTwin):
    """``Groupby(groupby_cols, sort_cols, aggs, name_sep, ascending)`` with the list, count,
    first and last aggregations, over scalar columns."""

    def __init__(self, op, selection):
        super().__init__(op)
        self.selection = selection
        self.keys = list(op.groupby_cols)
        mapping = op.column_mapping(selection)
        self.aggregations = [(output, inputs[0], output[len(inputs[0]) + len(op.name_sep):])
                             for output, inputs in mapping.items() if output not in self.keys]
        self.used = list(dict.fromkeys([*self.keys, *op.sort_cols,
                                        *(name for _, name, _ in self.aggregations)]))
        self._dtypes = {}  # NVTabular's output dtypes, per tuple of input dtypes

    def transform(self, col_selector, table: TensorTable) -> TensorTable:
        columns = {name: np.asarray(table[name].values) for name in self.used}
        if not self._exact(table, columns):
            return self._by_nvtabular(table)
        dtypes = self._output_dtypes(columns)
        order = _sort_order([columns[name] for name in self.op.sort_cols], self.op.ascending,
                            len(columns[self.keys[0]]))
        groups = _groups([columns[name] for name in self.keys], order)
        if groups is None:
            return self._by_nvtabular(table)
        members, offsets = groups
        starts, ends = members[offsets[:-1]], members[offsets[1:] - 1]
        output = {name: _scalar(columns[name][starts], dtypes[name]) for name in self.keys}
        # NVTabular's _first_or_last: with ascending=False, first is the list's end.
        first, last = (starts, ends) if self.op.ascending else (ends, starts)
        for name, source, agg in self.aggregations:
            values = columns[source]
            if agg == "list":
                list_offsets = offsets.astype(dtypes[name][1])
                output[name] = TensorColumn(values[members].astype(dtypes[name][0]),
                                            offsets=list_offsets, _unsafe=True)
            elif agg == "count":
                output[name] = _scalar(np.diff(offsets), dtypes[name])
            else:
                output[name] = _scalar(values[first if agg == "first" else last], dtypes[name])
        return TensorTable(output, _unsafe=True)

    def _exact(self, table, columns) -> bool:
        """Whether this table's data is within what the twin reproduces exactly."""
        if not len(columns[self.keys[0]]):
            return False  # NVTabular builds an empty frame's dtypes from fake rows
        for name, values in columns.items():
            if (table[name].offsets is not None or values.dtype.kind not in _EXACT_KINDS
                    or values.dtype == np.uint64):
                return False
        aggregated = {source for _, source, _ in self.aggregations} - set(self.keys)
        return not any(pd.isna(columns[name]).any() for name in aggregated)

    def _output_dtypes(self, columns):
        """{output: dtype, or (values dtype, offsets dtype) of a list}, as NVTabular gives
        them for inputs of these dtypes (learned once per dtypes, on stand-in rows)."""
        signature = tuple(values.dtype.str for values in columns.values())
        if signature not in self._dtypes:
            stand_in = meta_nonempty(pd.DataFrame({name: values[:0]
                                                   for name, values in columns.items()}))
            out = TensorTable.from_df(self.op.transform(self.selection, stand_in))
            self._dtypes[signature] = {
                name: (column.values.dtype if column.offsets is None
                       else (column.values.dtype, column.offsets.dtype))
                for name, column in out.items()}
        return self._dtypes[signature]

    def _by_nvtabular(self, table):
        frame = TensorTable({name: table[name] for name in self.used}).to_df()
        return TensorTable.from_df(self.op.transform(self.selection, frame))


def _scalar(values, dtype):
    return TensorColumn(values.astype(dtype, copy=False), _unsafe=True)


def _sort_order(columns, ascending, rows):
    """The row order of pandas' ``sort_values(by, ascending)`` (its ``nargsort`` for one
    column, ``lexsort_indexer`` for several), nulls last."""
    if not columns:
        return np.arange(rows)
    if len(columns) == 1:
        values = columns[0]
        nulls = np.asarray(pd.isna(values))
        index = np.arange(rows)[~nulls]
        present = values[~nulls]
        if not ascending:
            index, present = index[::-1], present[::-1]
        order = index[present.argsort(kind="quicksort")]
        if not ascending:
            order = order[::-1]
        return np.concatenate([order, np.nonzero(nulls)[0]])
    ranks = []
    for values in columns:
        codes, uniques = pd.factorize(values, sort=True)
        ranked = codes if ascending else len(uniques) - codes - 1
        ranks.append(np.where(codes < 0, len(uniques), ranked))
    return np.lexsort(ranks[::-1])  # stable: ties keep the frame's order


def _groups(keys, order):
    """pandas' ``groupby(keys, sort=True, dropna=True)`` of the rows in ``order``.

    Returns (rows of the groups one after the other, each group's rows in ``order``; the
    groups' offsets into them), or None where no row has a key or the combined key would not
    fit an int64.
    """
    combined, size = np.zeros(len(order), dtype=np.int64), 1
    valid = np.ones(len(order), dtype=bool)
    for values in keys:
        codes, uniques = pd.factorize(values, sort=True)  # pandas' own grouping codes
        size *= max(len(uniques), 1)
        if size > _LARGEST_GROUP_CODE:
            return None
        combined = combined * max(len(uniques), 1) + codes
        valid &= codes >= 0
    rows = order[valid[order]]
    if not len(rows):
        return None  # no group: NVTabular's empty frame
    _, group_of_row = np.unique(combined[rows], return_inverse=True)
    members = rows[np.argsort(group_of_row, kind="stable")]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(group_of_row))]).astype(np.int64)
    return members, offsets
