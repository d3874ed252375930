"""Which operators of an ensemble answer a row from other rows, so cannot be batched.

:class:`~merlin_t4r_ops.runtime.BatchingTritonRuntime` runs the rows of several requests as
one table and cuts the answer back by row. That is right only for a graph whose every
output row comes from its own input row. NVTabular's ``Groupby`` builds a session from many
event rows (and two requests could send the same session id), ``Filter`` and ``Dropna`` drop
rows, ``DifferenceLag`` reads the row before: in a batch, each would mix requests.
"""

from typing import List

from merlin.dag import postorder_iter_nodes

__all__ = ["CROSS_ROW_OPS", "cross_row_ops", "served_workflows"]

CROSS_ROW_OPS = ("Groupby", "Filter", "Dropna", "DifferenceLag")


def _workflow(op):
    # TransformWorkflow holds the workflow; after a Triton export it is wrapped in
    # TransformWorkflowTriton, which holds the original op.
    return getattr(op, "workflow", None) or getattr(getattr(op, "op", None), "workflow", None)


def _ensemble_nodes(ensemble):
    return postorder_iter_nodes(ensemble.graph.output_node, flatten_subgraphs=True)


def served_workflows(ensemble) -> list:
    """The NVTabular workflows that ``ensemble``'s ``TransformWorkflow`` operators serve."""
    found = (_workflow(node.op) for node in _ensemble_nodes(ensemble))
    return [workflow for workflow in found if workflow is not None]


def cross_row_ops(ensemble) -> List[str]:
    """Names of the operators in ``ensemble`` (workflows included) that cross rows."""
    ops = [node.op for node in _ensemble_nodes(ensemble)]
    for workflow in served_workflows(ensemble):
        ops += [n.op for n in postorder_iter_nodes(workflow.output_node)]
    found = [type(op).__name__ for op in ops if type(op).__name__ in CROSS_ROW_OPS]
    return list(dict.fromkeys(found))
