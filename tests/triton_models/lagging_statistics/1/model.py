"""Answers a request, then holds its ``execute`` call until a file exists.

The answer leaves through the request's response sender; Triton counts the request when
``execute`` returns. Between the two, a client holds its answer while the statistics show
nothing of it: what a loaded machine makes likely, made certain. ``RELEASE`` is the path of
the file that ends the hold.
"""

import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

# A test that never releases must not hold the model's only instance forever.
HOLD_LIMIT_S = 60


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            release = pb_utils.get_input_tensor_by_name(request, "RELEASE").as_numpy()
            answer = pb_utils.Tensor("ANSWER", np.array([1], dtype=np.int32))
            request.get_response_sender().send(
                pb_utils.InferenceResponse([answer]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            _wait_for(os.fsdecode(release.reshape(-1)[0]))
        return None


def _wait_for(path):
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
