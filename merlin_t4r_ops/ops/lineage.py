"""Which fitted ``Categorify`` encoded a workflow output column, found through Merlin's graph.

T4R's tutorials Categorify the event rows and only then build the sessions:
``Categorify >> Groupby(aggs={"item_id": ["list", "count"]}, name_sep="-") >> ListSlice >>
Rename(postfix="_seq") >> TagAsItemID >> ValueCount``. The served column
``item_id-list_seq`` holds the ids Categorify gave ``item_id``. :func:`categorify_of` walks
from the workflow's output node back to that Categorify: each node's operator says which of
its input columns an output column comes from (``op.column_mapping``), and the parent that
produces that input is the next step. Only operators known to keep the ids as they are may
lie on the way: a ``count`` of the item ids carries Categorify's properties in its schema
too, but it holds no item ids.
"""

from typing import Tuple

from merlin.dag import Node
from merlin_t4r_ops.errors import SchemaMismatchError

__all__ = ["categorify_of"]

# Groupby aggregations whose values are the grouped column's own values.
_ID_KEEPING_AGGREGATIONS = ("list", "first", "last")


def _keeps_ids(op) -> bool:
    """Whether ``op`` passes the values of a column on unchanged (renamed, cut, tagged)."""
    from merlin.dag.ops import ConcatColumns, SelectionOp, SubsetColumns, SubtractionOp
    from nvtabular.ops import AddMetadata, Dropna, Filter, ListSlice, Rename, ValueCount

    return isinstance(op, (ConcatColumns, SelectionOp, SubsetColumns, SubtractionOp, AddMetadata,
                           Dropna, Filter, ListSlice, Rename, ValueCount))


def _source_column(node: Node, column: str, path: str) -> str:
    """The input column of ``node`` whose values ``column`` carries, or an error naming why not."""
    from nvtabular.ops import Groupby

    sources = node.op.column_mapping(node.input_columns).get(column, [])
    if len(sources) != 1:
        raise SchemaMismatchError(
            f"{path} is made by {type(node.op).__name__} from {sources or 'no column'}, not "
            "from one encoded column: there is no Categorify vocabulary to decode it with")
    source = sources[0]
    if isinstance(node.op, Groupby):
        kept = [source + node.op.name_sep + agg for agg in _ID_KEEPING_AGGREGATIONS]
        if column not in kept and column != source:  # a groupby column passes as it is
            raise SchemaMismatchError(
                f"{path} is an aggregation of {source!r} by Groupby that is not one of "
                f"{list(_ID_KEEPING_AGGREGATIONS)}, so it holds no item ids")
    elif not _keeps_ids(node.op):
        raise SchemaMismatchError(
            f"{path} passes through {type(node.op).__name__}, which may change the ids "
            "Categorify gave it; DecodeItemIds follows only Groupby (list, first, last), "
            "ListSlice, Rename, AddTags/AddMetadata/TagAs*, ValueCount, Filter, Dropna and "
            "column selections")
    return source


def _parent_producing(node: Node, column: str) -> Node:
    for parent in node.parents_with_dependencies:
        if isinstance(parent, Node) and column in parent.output_columns.names:
            return parent
    return None


def categorify_of(workflow, column: str) -> Tuple[object, str]:
    """``(categorify, name)``: the fitted Categorify that encoded ``column``, and the name of
    that column as Categorify wrote it (the key of its vocabulary).

    Parameters
    ----------
    workflow : nvtabular.Workflow
    column : str
        An output column of ``workflow``.

    Raises
    ------
    SchemaMismatchError
        When no Categorify encoded ``column``, or an operator on the way may have changed
        its ids; the message names the column and the operator.
    """
    from nvtabular.ops import Categorify

    node, name, path = workflow.output_node, column, repr(column)
    while node is not None:
        if isinstance(node.op, Categorify):
            return node.op, name
        source = _source_column(node, name, path)
        if source != name:
            path = f"{path} (from {source!r})"
        node, name = _parent_producing(node, source), source
    raise SchemaMismatchError(
        f"column {path} is not encoded by a Categorify in this workflow, so there is no "
        "vocabulary to decode its ids with: DecodeItemIds needs the item ids Categorify-d")
