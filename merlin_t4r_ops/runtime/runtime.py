"""Runtimes for ``Ensemble.export(path, runtime=...)``: instances, errors, batching.

Both subclass Merlin's ``TritonExecutorRuntime`` and change only what its
``_executor_model_export`` writes for the executor model (its config, and
:mod:`merlin_t4r_ops.runtime.executor_model` as its ``model.py``); the operators, their
artifacts and ``ensemble.pkl`` are exported by Merlin as they are without a runtime.
"""

import importlib.resources
import shutil
from pathlib import Path
from typing import Optional, Sequence

from google.protobuf import text_format
from merlin.systems.dag.ops.workflow import TransformWorkflow
from merlin.systems.dag.runtimes.triton import TritonExecutorRuntime

from merlin_t4r_ops.errors import T4ROpsError
from merlin_t4r_ops.ops.cuda_graphs import DEFAULT_BUCKETS
from merlin_t4r_ops.runtime.instances import instance_group
from merlin_t4r_ops.runtime.rowwise import cross_row_ops, served_workflows
from merlin_t4r_ops.workflow import serve_workflow
from merlin_t4r_ops.workflow.filters import refuse_filters

__all__ = ["TritonRuntime", "BatchingTritonRuntime"]

MAX_BATCH_ROWS = max(DEFAULT_BUCKETS)  # the operator's largest CUDA-graph bucket
MAX_BATCH_ROWS_PARAMETER = "max_batch_rows"  # read by executor_model.py
LEAN_CHAIN_PARAMETER = "lean_chain"  # read by executor_model.py: "true" or "false"


class TritonRuntime(TritonExecutorRuntime):
    """Merlin's Triton runtime, with named errors and the ``instance_group`` chosen at export.

    The executor is :mod:`merlin_t4r_ops.runtime.executor_model`: a bad request gets
    ``INVALID_ARGUMENT`` and one line naming the input (bad offsets included, which Merlin's
    executor refuses unnamed before any operator runs), a server fault ``INTERNAL``, and a
    request without rows the declared outputs with none. ``ensemble.export(path)`` without a
    runtime keeps Merlin's executor and its errors (``INTERNAL``, with a traceback).

    Parameters
    ----------
    instances : int
        Copies of the executor model; with ``instance_kind="gpu"``, copies **per GPU**, on
        each GPU (:func:`merlin_t4r_ops.runtime.instances.instance_group`).
    instance_kind : {"auto", "cpu", "gpu"}
        Triton's ``KIND_AUTO`` (Merlin's default), ``KIND_CPU`` or ``KIND_GPU``.
    gpus : sequence of int, optional
        Only these GPUs (``instance_kind="gpu"``).
    compile_workflows : bool
        Run each ``TransformWorkflow`` inside the executor through the fast path
        (:mod:`merlin_t4r_ops.workflow`) where all its ops have one; else, and with False,
        as Merlin does: NVTabular in a Triton model of its own. A workflow that filters
        rows is refused either way (:func:`merlin_t4r_ops.workflow.without_filters`).
    lean_chain : bool
        Where the graph is the linear chain inputs >> compiled ``TransformWorkflow`` >>
        ``PredictT4RPyTorch`` >> ``DecodeItemIds`` (the workflow and the decoding optional),
        run its operators one after the other in the executor (:mod:`merlin_t4r_ops.runtime.chain`) instead of through
        Merlin's ``LocalExecutor``: same answers and errors, less time per request. Any
        other graph keeps Merlin's executor. False: always Merlin's.

    Examples
    --------
    >>> ensemble.export("model_repository", runtime=TritonRuntime(instances=2, instance_kind="gpu"))
    """

    def __init__(self, *, instances: int = 1, instance_kind: str = "auto",
                 gpus: Optional[Sequence[int]] = None, compile_workflows: bool = True,
                 lean_chain: bool = True):
        super().__init__()
        self.instance_group = instance_group(instances, instance_kind, gpus)
        self.lean_chain = bool(lean_chain)
        if compile_workflows:  # Merlin's hook: a copy of its table, TransformWorkflow remapped
            self.op_table = {**self.op_table, TransformWorkflow: serve_workflow}

    def export(self, ensemble, path, version=1, name=None):
        """Merlin's export, once no workflow of ``ensemble`` filters rows.

        Raises
        ------
        UnservableWorkflowError
            A workflow holds NVTabular's ``Filter``: a request is answered row for row, and
            NVTabular would drop rows silently (with ``compile_workflows=False`` too).
        """
        for workflow in served_workflows(ensemble):
            refuse_filters(workflow)
        return super().export(ensemble, path, version=version, name=name)

    def _executor_model_export(self, path, export_name, ensemble, params=None, node_id=None,
                               version=1):
        """Merlin's export of the executor model, then this runtime's config and model.py."""
        config = super()._executor_model_export(
            path, export_name, ensemble, params=params, node_id=node_id, version=version
        )
        self.adapt_config(config)
        model_dir = Path(path) / config.name
        (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
        self.write_model_py(model_dir / str(version) / "model.py")
        return config

    def adapt_config(self, config) -> None:
        """Change Merlin's executor ``ModelConfig`` in place: its instance group, and every
        input optional, so that the executor names a missing input in one line (Triton's own
        refusal lists every input of the model, 300-odd characters)."""
        del config.instance_group[:]
        config.instance_group.append(self.instance_group)
        config.parameters[LEAN_CHAIN_PARAMETER].string_value = str(self.lean_chain).lower()
        for model_input in config.input:
            model_input.optional = True

    def write_model_py(self, target: Path) -> None:
        """This package's executor in place of Merlin's."""
        source = importlib.resources.files("merlin_t4r_ops.runtime") / "executor_model.py"
        with importlib.resources.as_file(source) as executor_model:
            shutil.copyfile(executor_model, target)


class BatchingTritonRuntime(TritonRuntime):
    """Export an ensemble whose executor runs once for all the requests Triton batches.

    Triton's dynamic batcher needs one batch dimension shared by every input of a request,
    and Merlin's ragged ``<col>__values``/``<col>__offsets`` inputs have none
    (``max_batch_size: 0``). This runtime declares ``max_batch_size > 0`` with
    ``allow_ragged_batch`` on every input, so each request is one batch entry whose tensors
    carry a leading dimension of 1 (``merlin_t4r_ops.serving.client`` sends them so), and
    copies :mod:`merlin_t4r_ops.runtime.executor_model` as the executor's ``model.py``: it
    concatenates the rows of the requests, runs the graph once and answers each request with
    its own rows. ``benchmarks/batching_encodings.py`` measured why this encoding was chosen.

    Parameters
    ----------
    max_batch_size : int
        Most **requests** (Triton counts requests, not rows) in one ``execute`` call.
    max_batch_rows : int
        Most **rows** the graph runs at once: the requests of one ``execute`` call are run
        in groups of at most this many rows (a larger request alone). The default is the
        operator's largest CUDA-graph bucket, so a merged batch never leaves the graphs.
    max_queue_delay_us : int
        How long Triton may hold a request to fill a batch (``dynamic_batching``'s
        ``max_queue_delay_microseconds``). 0 batches only requests already queued while the
        model was busy, adding no latency when idle.
    preferred_batch_sizes : sequence of int, optional
        Triton's ``preferred_batch_size``, in requests.
    instances, instance_kind, gpus, compile_workflows, lean_chain
        As for :class:`TritonRuntime`.

    Raises
    ------
    T4ROpsError
        At export, when the graph holds an operator that answers a row from other rows
        (NVTabular's ``Groupby``, ``Filter``, ``Dropna``, ``DifferenceLag``): batched, it
        would mix requests. Export such an ensemble with :class:`TritonRuntime`.

    Examples
    --------
    >>> ensemble.export("model_repository",
    ...                 runtime=BatchingTritonRuntime(max_queue_delay_us=500))
    """

    def __init__(self, *, max_batch_size: int = 64, max_batch_rows: int = MAX_BATCH_ROWS,
                 max_queue_delay_us: int = 0,
                 preferred_batch_sizes: Optional[Sequence[int]] = None, instances: int = 1,
                 instance_kind: str = "auto", gpus: Optional[Sequence[int]] = None,
                 compile_workflows: bool = True, lean_chain: bool = True):
        super().__init__(instances=instances, instance_kind=instance_kind, gpus=gpus,
                         compile_workflows=compile_workflows, lean_chain=lean_chain)
        _check_count("max_batch_size", max_batch_size, minimum=1)
        _check_count("max_batch_rows", max_batch_rows, minimum=1)
        _check_count("max_queue_delay_us", max_queue_delay_us, minimum=0)
        for size in preferred_batch_sizes or ():
            _check_count("preferred_batch_sizes", size, minimum=1, maximum=max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_batch_rows = max_batch_rows
        self.max_queue_delay_us = max_queue_delay_us
        self.preferred_batch_sizes = list(preferred_batch_sizes or ())

    def export(self, ensemble, path, version=1, name=None):
        """Merlin's export, for a graph that answers each row from that row alone."""
        crossing = cross_row_ops(ensemble)
        if crossing:
            raise T4ROpsError(
                f"BatchingTritonRuntime runs the rows of several requests as one table, but "
                f"this ensemble's {crossing} combine or drop rows, which would mix requests; "
                "export it with TritonRuntime (or ensemble.export(path)) instead"
            )
        return super().export(ensemble, path, version=version, name=name)

    def adapt_config(self, config) -> None:
        """Batch dimension, ragged batching on every input, and the dynamic batcher."""
        super().adapt_config(config)
        config.max_batch_size = self.max_batch_size
        for model_input in config.input:
            model_input.allow_ragged_batch = True
        config.dynamic_batching.max_queue_delay_microseconds = self.max_queue_delay_us
        config.dynamic_batching.preferred_batch_size[:] = self.preferred_batch_sizes
        config.parameters[MAX_BATCH_ROWS_PARAMETER].string_value = str(self.max_batch_rows)


def _check_count(name, value, *, minimum, maximum=None):
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise T4ROpsError(f"{name} must be an int {bound}, got {value!r}")
