"""A serving fast path for fitted NVTabular workflows: the common ops as array operations.

:func:`compile_workflow` turns a fitted ``nvt.Workflow`` into :class:`CompiledWorkflow`, a
``TransformWorkflow`` whose graph is the workflow's own, with each NVTabular op replaced by an
array twin over Merlin's ``TensorTable`` (numpy). Merlin's ``LocalExecutor`` still walks the
graph, so column selection and merging are NVTabular's; only the per-op pandas work goes.
:func:`serve_workflow` is the hook the project's runtimes put in Merlin's ``op_table``: the
compiled operator where every op is known, else NVTabular's ``TransformWorkflowTriton``,
with a warning that names the ops it does not know. A workflow that filters rows is refused;
:func:`without_filters` is the explicit way to serve it, every row passed.
"""

from merlin_t4r_ops.workflow.compile import (
    CompiledWorkflow,
    compile_workflow,
    serve_workflow,
    unknown_ops,
)
from merlin_t4r_ops.workflow.filters import without_filters

__all__ = ["CompiledWorkflow", "compile_workflow", "serve_workflow", "unknown_ops",
           "without_filters"]
