"""What the executor model answers a request with when it has no rows, or cannot be answered.

The client reads the first line of an error, and its status says whose fault it is: a
request error (:class:`~merlin_t4r_ops.errors.InvalidRequestError`, the inputs are wrong) is
Triton's ``INVALID_ARG`` (gRPC ``INVALID_ARGUMENT``, HTTP 400), anything else is a server
fault, ``INTERNAL``. Either way the client gets one short line; the traceback goes to the
server's log. Nothing here needs Triton, so it is tested in process.
"""

import traceback
from typing import Dict

import numpy as np

from merlin.schema import Schema
from merlin_t4r_ops.errors import InvalidRequestError

__all__ = ["MESSAGE_LIMIT", "is_request_error", "wire_message", "log_message", "empty_outputs"]

MESSAGE_LIMIT = 200  # characters of the one line a client gets


def is_request_error(error: BaseException) -> bool:
    """Whether ``error`` is the request's fault (answered ``INVALID_ARG``), not the server's."""
    return isinstance(error, InvalidRequestError)


def wire_message(error: BaseException, limit: int = MESSAGE_LIMIT) -> str:
    """One line of at most ``limit`` characters: the error's type and its first line.

    A server fault says that the traceback is in the server's log.
    """
    lines = str(error).strip().splitlines() or [""]
    if is_request_error(error):
        line = f"{type(error).__name__}: {lines[0]}"
    else:
        line = f"server error (traceback in the server log): {type(error).__name__}: {lines[0]}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def log_message(model_name: str, error: BaseException) -> str:
    """What the server's log gets for ``error``: the model and the whole traceback."""
    return f"{model_name}: request failed:\n" + "".join(traceback.format_exception(error))


def empty_outputs(schema: Schema) -> Dict[str, np.ndarray]:
    """The graph's declared output columns with zero rows: the answer to a request of none.

    A ragged column is values ``[0]`` and offsets ``[1]``; a fixed list ``[0, length]``.
    """
    arrays = {}
    for column in schema:
        # Strings travel as object arrays (Triton BYTES), as the executor answers them.
        text = column.dtype.element_type.value in ("string", "object")
        dtype = object if text else column.dtype.to_numpy
        if column.is_ragged:
            arrays[column.name + "__values"] = np.zeros(0, dtype=dtype)
            arrays[column.name + "__offsets"] = np.zeros(1, dtype=np.int32)
        else:
            width = [int(dim.max) for dim in (column.shape.dims or ())[1:]]
            arrays[column.name] = np.zeros([0, *width], dtype=dtype)
    return arrays
