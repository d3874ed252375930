"""Triton's inference statistics of one model, read once they have settled.

Triton counts a request after its response has left: the Python backend reports an
``execute`` call's statistics when ``execute`` returns, after its responses were sent. A
client that reads the statistics as soon as its answers arrive can see none of them (more so
on a loaded machine), so whoever compares counts (tests, benchmarks) polls, with a bound.
"""

import time
from typing import NamedTuple

__all__ = ["Counts", "counts", "counts_since", "model_statistics", "settled_statistics"]

POLL_S = 0.05


class Counts(NamedTuple):
    """Requests Triton counted for a model (failed ones too), and its ``execute`` calls."""

    requests: int
    executions: int


def model_statistics(client, model: str) -> dict:
    """Triton's cumulative statistics of ``model`` (its ``model_stats`` entry, as JSON)."""
    return client.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]


def _counts(statistics: dict) -> Counts:
    return Counts(int(statistics.get("inference_count", 0) or 0),
                  int(statistics.get("execution_count", 0) or 0))


def counts(client, model: str) -> Counts:
    """What Triton has counted for ``model`` so far; pass it as ``before`` to the readers below."""
    return _counts(model_statistics(client, model))


def settled_statistics(client, model: str, before: Counts, expect: int,
                       timeout: float = 60.0) -> dict:
    """``model``'s statistics once they count ``expect`` requests since ``before``, and hold.

    Polls until at least ``expect`` more requests are counted and the counts did not change
    since the previous read (Triton may count a batch's requests before its ``execute``
    call). At ``timeout`` seconds it returns what it read last, for the caller's check to
    show; ``timeout=0`` reads once.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient or tritonclient.http.InferenceServerClient
        A client of the server.
    model : str
        The model's name.
    before : Counts
        :func:`counts` read before the requests were sent.
    expect : int
        How many requests were sent since ``before`` (at least).
    timeout : float
        Seconds to wait at most.
    """
    deadline = time.monotonic() + timeout
    last = None
    while True:
        statistics = model_statistics(client, model)
        now = _counts(statistics)
        if now == last and now.requests - before.requests >= expect:
            return statistics
        if time.monotonic() >= deadline:
            return statistics
        last = now
        time.sleep(POLL_S)


def counts_since(client, model: str, before: Counts, expect: int,
                 timeout: float = 60.0) -> Counts:
    """(requests, executions) counted since ``before``, once settled.

    See :func:`settled_statistics` for the wait and its bound.
    """
    now = _counts(settled_statistics(client, model, before, expect, timeout))
    return Counts(now.requests - before.requests, now.executions - before.executions)
