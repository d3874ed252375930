"""Triton Python-backend model that runs a Merlin ensemble, with short errors of the right kind.

:class:`~merlin_t4r_ops.runtime.TritonRuntime` and
:class:`~merlin_t4r_ops.runtime.BatchingTritonRuntime` copy this file as the executor's
``model.py`` in place of Merlin's ``executor_model.py``. Each request is checked alone first
(offsets, with the operator's own check, before merlin-core builds a ``TensorColumn`` from
them; its messages name no input). A request without rows gets the declared outputs with no
rows. A bad request gets ``INVALID_ARG`` with one line naming the input; a server fault gets
``INTERNAL``; the traceback goes to the server's log (:mod:`merlin_t4r_ops.runtime.replies`).

With a batch dimension (``max_batch_size > 0``, the batching runtime), Triton's dynamic
batcher hands ``execute`` several requests: their rows run as one table (at most
``max_batch_rows`` rows, the config parameter) and each request is answered with its own
rows, in order. When a batch fails with a request error it runs again in halves, so a bad
request fails alone and the others are answered.

Where the runtime asked for it (the ``lean_chain`` config parameter) and the graph is the
linear chain workflow >> ``PredictT4RPyTorch`` >> ``DecodeItemIds`` (the workflow and the
decoding optional: the model alone is a chain), the operators run one after the other
(:mod:`merlin_t4r_ops.runtime.chain`) instead of through Merlin's ``LocalExecutor``; the load
report in the server's log says which executor runs.
"""

import json

import triton_python_backend_utils as pb_utils

from merlin.systems.dag.runtimes.triton import TritonExecutorRuntime
from merlin.systems.triton.conversions import (
    _to_array_lib,
    match_representations,
    tensor_names,
)
from merlin.systems.triton.models.executor_model import (
    TritonPythonModel as MerlinExecutorModel,
)
from merlin_t4r_ops.runtime.batching import (
    answer_each,
    concat_requests,
    request_rows,
    row_groups,
    split_outputs,
    with_batch_dim,
)
from merlin_t4r_ops.runtime.replies import (
    empty_outputs,
    is_request_error,
    log_message,
    wire_message,
)

from merlin_t4r_ops.runtime.chain import lean_chain, why_not_a_chain
from merlin_t4r_ops.runtime.runtime import LEAN_CHAIN_PARAMETER, MAX_BATCH_ROWS_PARAMETER


class TritonPythonModel(MerlinExecutorModel):
    """Merlin's executor model: errors named and coded, batched across requests if declared."""

    def initialize(self, args):
        """Load the ensemble and its operators' artifacts: Merlin's ``initialize``.

        Its frame, like this one, holds ``args``: the operator reads the instance's device
        from it (:func:`merlin_t4r_ops.ops.device.triton_instance_args`).
        """
        super().initialize(args)
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.batch_dim = int(config.get("max_batch_size", 0)) > 0
        parameters = config.get("parameters", {})
        max_rows = parameters.get(MAX_BATCH_ROWS_PARAMETER, {}).get("string_value")
        self.max_rows = int(max_rows) if max_rows else None
        self.runtime = TritonExecutorRuntime()
        self.input_names = tensor_names(self.ensemble.input_schema)
        wanted = parameters.get(LEAN_CHAIN_PARAMETER, {}).get("string_value") == "true"
        self.chain = lean_chain(self.ensemble) if wanted else None
        pb_utils.Logger.log_info(f"{self.name}: " + _executor_report(wanted, self.ensemble,
                                                                       self.chain))

    def execute(self, requests):
        """One response per request, in order: its rows' outputs, or its own error."""
        responses = [None] * len(requests)
        batch = []
        for index, request in enumerate(requests):
            try:
                # Inputs are declared optional (TritonRuntime.adapt_config), so that a missing
                # one reaches request_rows, which names it in one line; Triton's own refusal
                # lists every input.
                # One pass over the request's tensors (get_input_tensor_by_name walks them all
                # for each name).
                sent = {tensor.name(): tensor for tensor in request.inputs()}
                arrays = {name: _to_array_lib(sent[name])
                          for name in self.input_names if name in sent}
                rows = request_rows(arrays, self.ensemble.input_schema, self.input_names,
                                    batch_dim=self.batch_dim)
            except Exception as exc:  # noqa: BLE001 - the request is answered with it
                responses[index] = self._error_response(exc)
                continue
            if rows.rows == 0:
                responses[index] = self._response(empty_outputs(self.ensemble.output_schema))
            else:
                batch.append((index, rows))
        groups = (row_groups([rows.rows for _, rows in batch], self.max_rows)
                  if self.batch_dim else [[i] for i in range(len(batch))])
        for group in groups:
            members = [batch[i] for i in group]
            answers = answer_each(self._run, [rows for _, rows in members],
                                  self._error_response)
            for (index, _), response in zip(members, answers):
                responses[index] = response
        return responses

    def _run(self, requests):
        table = concat_requests(requests, self.ensemble.input_schema)
        if self.chain is not None:
            outputs = self.chain.transform(table)
        else:
            outputs = self.ensemble.transform(table, runtime=self.runtime)
        return [self._response(piece)
                for piece in split_outputs(outputs, [rows.rows for rows in requests])]

    def _response(self, arrays):
        arrays = match_representations(self.ensemble.output_schema, arrays)
        if self.batch_dim:
            arrays = with_batch_dim(arrays)
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor(name, array) for name, array in arrays.items()])

    def _error_response(self, exc):
        if is_request_error(exc):
            pb_utils.Logger.log_verbose(log_message(self.name, exc))
            code = pb_utils.TritonError.INVALID_ARG
        else:
            pb_utils.Logger.log_error(log_message(self.name, exc))
            code = pb_utils.TritonError.INTERNAL
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(wire_message(exc), code))


def _executor_report(wanted, ensemble, chain):
    if not wanted:
        return "Merlin's LocalExecutor runs the graph (lean_chain=False)"
    if chain is not None:
        report = f"the lean chain runs the graph ({' >> '.join(chain.names)})"
        if not chain.decodes:
            return report
        where = ("the model's device, after its top-k" if chain.decodes_in_graph
                 else "the host (DecodeItemIds)")
        return f"{report}; ids decoded on {where}"
    why = why_not_a_chain(ensemble)
    return f"Merlin's LocalExecutor runs the graph: it is not the lean chain, {why}"
