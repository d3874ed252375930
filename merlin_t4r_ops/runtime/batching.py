"""Merge the requests of one ``execute`` call into one table of rows, and split the answer back.

The batching runtime gives every Merlin tensor of a request a leading batch dimension of 1
(``<col>__values`` ``[1, n]``, ``<col>__offsets`` ``[1, rows + 1]``, a scalar column
``[1, rows]``), so that Triton's dynamic batcher, which needs one batch dimension shared by
every input of a request, can hand one ``execute`` several requests. Here each request is
checked on its own (offsets first, before merlin-core builds a ``TensorColumn`` from them),
the good ones are concatenated row-wise, and the graph's outputs are cut back into one piece
per request, in order. Nothing here needs Triton, so it is tested in process.
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, TypeVar

import numpy as np

from merlin.schema import Schema
from merlin.table import TensorTable
from merlin_t4r_ops.errors import InvalidRequestError
from merlin_t4r_ops.ops.inputs import _lengths_from_offsets

__all__ = ["RequestRows", "answer_each", "request_rows", "row_groups", "concat_requests",
           "split_outputs", "with_batch_dim"]

VALUES, OFFSETS = "__values", "__offsets"
Arrays = Dict[str, np.ndarray]
Request, Answer = TypeVar("Request"), TypeVar("Answer")


class RequestRows(NamedTuple):
    """One request's tensors without their batch dimension, and its number of rows."""

    arrays: Arrays
    rows: int


def _without_batch_dim(name: str, array: np.ndarray) -> np.ndarray:
    if array.ndim == 0 or array.shape[0] != 1:
        raise InvalidRequestError(
            f"input {name!r}: this model takes each request as one batch entry, so its "
            f"leading dimension must be 1, got shape {list(array.shape)}"
        )
    return array[0]


def request_rows(arrays: Arrays, schema: Schema, input_names: Sequence[str], *,
                 batch_dim: bool = True) -> RequestRows:
    """Check one request's tensors against the ensemble's input ``schema``.

    Parameters
    ----------
    arrays : dict of str to numpy.ndarray
        Triton input name to array, each with its leading batch dimension of 1 when
        ``batch_dim`` (a model with ``max_batch_size > 0``), as Merlin declares them otherwise.
    schema : merlin.schema.Schema
        The ensemble's input schema.
    input_names : sequence of str
        The Triton inputs ``schema`` declares (``merlin.systems.triton.conversions.tensor_names``),
        derived once by the caller rather than on every request.
    batch_dim : bool
        Whether every array carries the request's leading batch dimension of 1.

    Raises
    ------
    InvalidRequestError
        Naming the input: a missing input, a batch dimension other than 1, offsets that
        are not integers, do not start at 0, decrease, or miss the number of values, and
        inputs that disagree on the number of rows.
    """
    missing = [name for name in input_names if name not in arrays]
    if missing:
        raise InvalidRequestError(f"input {missing[0]!r} is missing: the request sent "
                                  f"{len(arrays)} of the {len(input_names)} inputs")
    stripped = ({name: _without_batch_dim(name, array) for name, array in arrays.items()}
                if batch_dim else arrays)
    rows = {}
    for column in schema:
        if column.is_ragged:
            values, offsets = column.name + VALUES, column.name + OFFSETS
            lengths = _lengths_from_offsets(offsets, stripped[offsets], len(stripped[values]))
            rows[offsets] = len(lengths)
        else:
            rows[column.name] = len(stripped[column.name])
    if len(set(rows.values())) > 1:
        raise InvalidRequestError(f"inputs disagree on the number of rows: {rows}")
    return RequestRows(stripped, next(iter(rows.values()), 0))


def row_groups(rows: Sequence[int], max_rows: Optional[int]) -> List[List[int]]:
    """Indices of requests of ``rows`` rows, in order, grouped to at most ``max_rows`` rows.

    Triton's ``max_batch_size`` counts requests, not rows: 64 requests of 100 rows each would
    make one table of 6,400 rows, beyond the operator's largest CUDA-graph bucket. A request
    of more than ``max_rows`` rows runs alone; ``None`` puts every request in one group.
    """
    groups: List[List[int]] = []
    total = 0
    for index, count in enumerate(rows):
        if not groups or (max_rows is not None and total + count > max_rows):
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += count
    return groups


def concat_requests(requests: Sequence[RequestRows], schema: Schema) -> TensorTable:
    """One ``TensorTable`` holding the rows of ``requests`` one after the other.

    :func:`request_rows` checked each request's offsets, so merlin-core's own check (a
    Python loop over the rows) is skipped, and one request's arrays are its table.
    """
    if len(requests) == 1:
        return TensorTable(requests[0].arrays, _unsafe=True)
    merged = {}
    for column in schema:
        if column.is_ragged:
            values, offsets = column.name + VALUES, column.name + OFFSETS
            merged[values] = np.concatenate([r.arrays[values] for r in requests])
            merged[offsets] = _concat_offsets([r.arrays[offsets] for r in requests])
        else:
            merged[column.name] = np.concatenate([r.arrays[column.name] for r in requests])
    return TensorTable(merged, _unsafe=True)


def _concat_offsets(parts: List[np.ndarray]) -> np.ndarray:
    shifted, base = [parts[0][:1]], 0
    for offsets in parts:
        shifted.append(offsets[1:] + (base - offsets[0]))
        base += int(offsets[-1] - offsets[0])
    return np.concatenate(shifted).astype(parts[0].dtype, copy=False)


def split_outputs(outputs: TensorTable, rows: Sequence[int]) -> List[Arrays]:
    """Cut the graph's ``outputs`` into one dict of arrays per request of ``rows`` rows.

    The outputs of a single request are its answer whatever their number of rows.

    Raises
    ------
    ValueError
        When, for several requests, an output column does not have one row per input row (a
        graph that filters or adds rows cannot be split back by row).
    """
    if len(rows) == 1:
        return [{name: _numpy(array) for name, array in outputs.to_dict().items()}]
    bounds = np.cumsum([0, *rows])
    pieces: List[Arrays] = [{} for _ in rows]
    for name in outputs.columns:
        column = outputs[name]
        values = _numpy(column.values)
        offsets = None if column.offsets is None else _numpy(column.offsets)
        n_rows = len(values) if offsets is None else len(offsets) - 1
        if n_rows != bounds[-1]:
            raise ValueError(
                f"output {name!r} has {n_rows} rows for {bounds[-1]} input rows; "
                "only a graph that keeps one output row per input row can be batched"
            )
        for piece, start, stop in zip(pieces, bounds[:-1], bounds[1:]):
            if offsets is None:
                piece[name] = values[start:stop]
            else:
                piece[name + VALUES] = values[offsets[start]:offsets[stop]]
                piece[name + OFFSETS] = offsets[start:stop + 1] - offsets[start]
    return pieces


def _numpy(array) -> np.ndarray:
    if hasattr(array, "get"):  # cupy
        array = array.get()
    elif hasattr(array, "cpu"):  # torch
        array = array.cpu().numpy()
    return np.asarray(array)


def with_batch_dim(arrays: Arrays) -> Arrays:
    """``arrays`` with the leading batch dimension of 1 that the responses carry."""
    return {name: np.ascontiguousarray(array)[None] for name, array in arrays.items()}


def answer_each(run: Callable[[List[Request]], List[Answer]], requests: List[Request],
                failed: Callable[[Exception], Answer]) -> List[Answer]:
    """``run(requests)``; when that raises, each request's own answer or ``failed(error)``.

    A batch that fails with a request error (:class:`InvalidRequestError`) is split in
    halves, and each half run again, down to single requests: a bad request among ``n``
    costs about ``2 log2(n)`` more runs rather than ``n``, and every good request is still
    answered. Any other error is the server's fault, which would fail every retry too: each
    request of the batch is answered with it, and nothing runs again.
    """
    try:
        return run(requests)
    except InvalidRequestError as error:  # one request's fault: find it
        if len(requests) == 1:
            return [failed(error)]
    except Exception as error:  # noqa: BLE001 - a server fault, answered to every request
        return [failed(error) for _ in requests]
    half = len(requests) // 2
    return (answer_each(run, requests[:half], failed)
            + answer_each(run, requests[half:], failed))
