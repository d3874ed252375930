"""Compile a fitted workflow's graph into array twins, or say which ops keep it on NVTabular."""

import copy
import logging
import warnings

import nvtabular as nvt
from merlin.dag import ColumnSelector, DataFormats, postorder_iter_nodes
from merlin.dag.ops import (
    ConcatColumns,
    GroupingOp,
    Rename,
    SelectionOp,
    SubsetColumns,
    SubtractionOp,
)
from merlin.systems.dag.ops.workflow import TransformWorkflow
from merlin.table import TensorTable

from merlin_t4r_ops.errors import WorkflowFallbackWarning
from merlin_t4r_ops.workflow.arrays import (
    CategorifyArrays,
    ListSliceArrays,
    LogOpArrays,
    NormalizeArrays,
)
from merlin_t4r_ops.workflow.executor import GraphPlan
from merlin_t4r_ops.workflow.filters import KeepEveryRow, refuse_filters
from merlin_t4r_ops.workflow.groupby import groupby_twin

LOG = logging.getLogger(__name__)

# Ops whose transform leaves the data as it is or only picks and names columns: Merlin's
# own, which run on a TensorTable unchanged.
_AS_THEY_ARE = (SelectionOp, GroupingOp, ConcatColumns, SubsetColumns, SubtractionOp, Rename,
                nvt.ops.Rename, nvt.ops.AddMetadata, nvt.ops.ValueCount, KeepEveryRow)


class CompiledWorkflow(TransformWorkflow):
    """``TransformWorkflow`` that runs a fitted workflow's graph with array twins of its ops.

    The graph runs through :class:`~merlin_t4r_ops.workflow.executor.GraphPlan`, which
    merges columns as Merlin's ``LocalExecutor`` does at a fraction of its cost.

    It is a ``TransformWorkflow``: same ``workflow``, same input and output schemas (the
    Categorify properties on each column included), so operators downstream see what they
    would see behind NVTabular's. Built by :func:`compile_workflow`.
    """

    def __init__(self, op: TransformWorkflow, output_node):
        super().__init__(op.workflow, sparse_max=op.sparse_max, max_batch_size=op.max_batch_size,
                         cats=op.cats, conts=op.conts)
        self.label_columns = op.label_columns
        self.plan = GraphPlan(output_node)

    @property
    def supported_formats(self) -> DataFormats:
        return DataFormats.NUMPY_TENSOR_TABLE

    def transform(self, col_selector: ColumnSelector, transformable: TensorTable) -> TensorTable:
        """The workflow's output columns for ``transformable``'s rows, as NVTabular gives them."""
        return self.plan.transform(transformable)


def unknown_ops(workflow) -> list:
    """Names of the ops in ``workflow`` that the fast path does not compile (empty: all known).

    Raises
    ------
    UnservableWorkflowError
        The workflow filters rows (``Filter``): a served request is answered row for row
        (:func:`~merlin_t4r_ops.workflow.filters.without_filters` serves it without them).
    """
    refuse_filters(workflow)
    unknown = []
    for node in postorder_iter_nodes(workflow.output_node):
        if _twin(node) is None and not (node.op is None or isinstance(node.op, _AS_THEY_ARE)):
            unknown.append(_describe(node.op))
    return unknown


def compile_workflow(op: TransformWorkflow):
    """``op``'s workflow as a :class:`CompiledWorkflow`, or None when an op is unknown.

    The workflow's graph is copied, so the user's workflow is left as it is.
    """
    if unknown_ops(op.workflow):
        return None
    output_node = copy.deepcopy(op.workflow.output_node)
    for node in postorder_iter_nodes(output_node):
        twin = _twin(node)
        if twin is not None:
            node.op = twin
    return CompiledWorkflow(op, output_node)


def serve_workflow(op: TransformWorkflow):
    """The Triton runtimes' ``op_table`` entry for ``TransformWorkflow``.

    Returns the compiled operator (runs inside the executor model), or, when the workflow
    holds an op the fast path does not know, Merlin's ``TransformWorkflowTriton`` (a Triton
    model of its own, NVTabular on pandas), with a :class:`WorkflowFallbackWarning`.
    """
    from merlin.systems.dag.runtimes.triton.ops.workflow import TransformWorkflowTriton

    unknown = unknown_ops(op.workflow)
    if not unknown:
        return compile_workflow(op)
    message = (f"workflow ops without a fast path ({', '.join(sorted(set(unknown)))}): the "
               "whole workflow is served by NVTabular (TransformWorkflowTriton)")
    LOG.warning(message)
    warnings.warn(message, WorkflowFallbackWarning, stacklevel=2)
    return TransformWorkflowTriton(op)


def _twin(node):
    """The array twin of ``node``'s op, or None where it has none."""
    op = node.op
    if isinstance(op, nvt.ops.Categorify) and _plain_categorify(op, node):
        names = node.input_columns.names
        dtypes = {name: node.output_schema[name].dtype.to_numpy for name in names}
        return CategorifyArrays(op, names, dtypes)
    if isinstance(op, nvt.ops.ListSlice) and not op.pad:
        # NVTabular 23.08 does not pad on the CPU (ListSlice appends to a copy it drops).
        return ListSliceArrays(op)
    if type(op) is nvt.ops.LogOp:
        return LogOpArrays(op)
    if type(op) is nvt.ops.Normalize:
        return NormalizeArrays(op)
    if type(op) is nvt.ops.Groupby:
        return groupby_twin(op, node)
    return None


def _plain_categorify(op, node) -> bool:
    """One column per group, joint encoding, no hashed buckets, ids after the reserved ones."""
    grouped = any(isinstance(group, (list, tuple)) and len(group) > 1
                  for group in node.input_columns.grouped_names)
    return (not op.num_buckets and op.encode_type == "joint" and not op.single_table
            and not grouped)


def _describe(op) -> str:
    return type(op).__name__
