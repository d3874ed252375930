"""Triton Python-backend model that runs a Merlin ensemble once for all the requests it is handed.

:class:`~merlin_t4r_ops.runtime.BatchingTritonRuntime` copies this file as the executor's
``model.py`` in place of Merlin's ``executor_model.py``. Triton's dynamic batcher hands
``execute`` several requests; Merlin's executor would run the graph once per request, this
one checks each request alone, runs the graph once on their rows concatenated, and answers
each request with its own rows, in order. A request that fails its checks is answered with
its error and left out of the batch; when the batch itself fails, it is run again in halves,
down to single requests, so that a bad request fails alone and the others are answered.
"""

import traceback

import triton_python_backend_utils as pb_utils

from merlin.systems.dag.runtimes.triton import TritonExecutorRuntime
from merlin.systems.triton.conversions import (
    _array_from_triton_tensor,
    match_representations,
    tensor_names,
)
from merlin.systems.triton.models.executor_model import (
    TritonPythonModel as MerlinExecutorModel,
)
from merlin_t4r_ops.errors import T4ROpsError
from merlin_t4r_ops.runtime.batching import (
    answer_each,
    concat_requests,
    request_rows,
    split_outputs,
    with_batch_dim,
)


class TritonPythonModel(MerlinExecutorModel):
    """Merlin's executor model, batched across the requests of one ``execute`` call."""

    def initialize(self, args):
        """Load the ensemble and its operators' artifacts: Merlin's ``initialize``.

        Its frame, like this one, holds ``args``: the operator reads the instance's device
        from it (:func:`merlin_t4r_ops.ops.device.triton_instance_args`).
        """
        super().initialize(args)
        self.runtime = TritonExecutorRuntime()
        self.input_names = tensor_names(self.ensemble.input_schema)

    def execute(self, requests):
        """One response per request, in order: its rows' outputs, or its own error."""
        responses = [None] * len(requests)
        batch = []
        for index, request in enumerate(requests):
            try:
                arrays = {name: _array_from_triton_tensor(request, name)
                          for name in self.input_names}
                rows = request_rows(arrays, self.ensemble.input_schema)
            except Exception as exc:  # noqa: BLE001 - the request is answered with it
                responses[index] = _error_response(exc)
                continue
            batch.append((index, rows))
        # A request without rows gets the operators' own answer to it, alone.
        alone = [(i, r) for i, r in batch if r.rows == 0]
        together = [(i, r) for i, r in batch if r.rows > 0]
        for group in [together] + [[item] for item in alone]:
            if group:
                answers = self._answer_each([rows for _, rows in group])
                for (index, _), response in zip(group, answers):
                    responses[index] = response
        return responses

    def _answer_each(self, requests):
        """Run ``requests`` as one batch; if that fails, in halves, so a bad one fails alone."""
        return answer_each(self._run, requests, _error_response)

    def _run(self, requests):
        table = concat_requests(requests, self.ensemble.input_schema)
        outputs = self.ensemble.transform(table, runtime=self.runtime)
        schema = self.ensemble.output_schema
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor(name, array)
                for name, array in with_batch_dim(match_representations(schema, piece)).items()
            ])
            for piece in split_outputs(outputs, [rows.rows for rows in requests])
        ]


def _error_response(exc):
    # The package's own errors say what is wrong with the request; anything else keeps its
    # traceback, as Merlin's executor does.
    if isinstance(exc, T4ROpsError):
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "".join(traceback.format_exception(exc))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
