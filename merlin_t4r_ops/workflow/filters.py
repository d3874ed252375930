"""Row filters in a served workflow: refused, or passed over when the user asks.

A served request is answered row for row; NVTabular's ``Filter`` drops rows (the
tutorial's drops sessions shorter than a minimum), so a request could get fewer answers
than it sent sessions, silently. The fast path refuses such a workflow at export
(:func:`refuse_filters`), and :func:`without_filters` is the explicit way to serve one: a
copy in which every ``Filter`` passes every row.
"""

import copy

import nvtabular as nvt
from merlin.dag import postorder_iter_nodes
from nvtabular.ops import Operator

from merlin_t4r_ops.errors import UnservableWorkflowError


class KeepEveryRow(Operator):
    """What stands where a ``Filter`` stood in :func:`without_filters`' copy: every row and
    column of its input, unchanged (the ``Filter``'s own schema)."""

    def transform(self, col_selector, df):
        return df


def refuse_filters(workflow) -> None:
    """Raise :class:`UnservableWorkflowError` when ``workflow`` holds a ``Filter``."""
    for node in postorder_iter_nodes(workflow.output_node):
        if isinstance(node.op, nvt.ops.Filter):
            raise UnservableWorkflowError(
                "the workflow holds a Filter, which drops rows, but a served request is "
                "answered row for row; serve a workflow without it: "
                "TransformWorkflow(merlin_t4r_ops.workflow.without_filters(workflow)) "
                "passes every row where the Filter stood, or build the serving workflow "
                "from the same fitted ops minus the Filter, or filter the requests before "
                "they are sent")


def without_filters(workflow):
    """A copy of the fitted ``workflow`` whose every ``Filter`` passes every row, to serve.

    The user's workflow is left as it is (it still filters in ``transform``, for training);
    the copy shares nothing with it that serving changes, and its schemas are the same.

    Examples
    --------
    >>> served = TransformWorkflow(without_filters(workflow))
    """
    served = copy.deepcopy(workflow)
    for node in postorder_iter_nodes(served.output_node):
        if isinstance(node.op, nvt.ops.Filter):
            node.op = KeepEveryRow()
    return served
