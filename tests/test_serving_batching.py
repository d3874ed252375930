"""Batching across requests (BatchingTritonRuntime) against the shared real tritonserver.

Concurrent clients each get the eager answer for their own rows, while Triton's statistics
show that ``execute`` calls held several requests; a bad request in a batch fails alone; bad
offsets get an error that names the input.
"""

import re
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import t4r_factories as factories
from conftest import BATCHED_MODEL, BATCHED_WORKFLOW, TOP_K
from merlin_t4r_ops.serving.client import (
    arrays_to_inputs, dataframe_arrays, infer_arrays, infer_dataframe)
from merlin_t4r_ops.serving.statistics import counts, counts_since

RTOL, ATOL = 1e-5, 1e-6
DTYPES = {"item_id-list__values": np.int64, "item_id-list__offsets": np.int32,
          "category-list__values": np.int64, "category-list__offsets": np.int32,
          "price-list__values": np.float32, "price-list__offsets": np.int32}


def _concurrently(triton, clients, requests_each, ask):
    """Run ``ask(client, rng)`` from ``clients`` threads; return what went wrong."""
    problems, deadline = [], time.monotonic() + 300
    start = threading.Barrier(clients)

    def worker(index):
        rng = np.random.default_rng(1000 + index)
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        try:
            start.wait()
            for _ in range(requests_each):
                if time.monotonic() > deadline:
                    problems.append(f"client {index}: time limit reached")
                    return
                problem = ask(client, rng)
                if problem:
                    problems.append(f"client {index}: {problem}")
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return problems


def test_concurrent_clients_get_the_eager_answer_for_their_own_rows(triton, client,
                                                                    served_models):
    pool = factories.random_sessions(300, np.random.default_rng(21))
    expected = factories.eager_scores(served_models["next_item_full"], pool)
    before = counts(client, BATCHED_MODEL)

    def ask(client, rng):
        rows = rng.choice(len(pool), size=int(rng.integers(1, 6)), replace=False)
        got = infer_dataframe(client, pool.iloc[rows].reset_index(drop=True),
                              model_name=BATCHED_MODEL, dtypes=DTYPES, batch_dimension=True)
        got = np.stack(got["next-item"])
        if got.shape != (len(rows), factories.ITEMS):
            return f"shape {got.shape} for {len(rows)} rows"
        if not np.allclose(got, expected[rows], rtol=RTOL, atol=ATOL):
            return f"rows {rows.tolist()} differ from eager"
        return None

    problems = _concurrently(triton, clients=12, requests_each=15, ask=ask)
    assert not problems, problems[:5]
    requests, executions = counts_since(client, BATCHED_MODEL, before, expect=12 * 15)
    assert requests == 12 * 15
    # Several requests per execute call, or nothing was batched at all.
    assert executions < requests / 2, (requests, executions)


def test_workflow_in_front_batches_raw_sessions(triton, client, session_workflow):
    from merlin.io import Dataset

    workflow, model, raw = session_workflow
    pool = raw.head(120).reset_index(drop=True)
    encoded = workflow.transform(Dataset(pool)).to_ddf().compute()
    # Categorify reserves 0 (padding), 1 (null) and 2 (out of vocabulary).
    ids, scores = factories.reference_top_k(factories.eager_scores(model, encoded), TOP_K,
                                            reserved=(0, 1, 2))

    def ask(client, rng):
        rows = rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)
        got = infer_dataframe(client, pool.iloc[rows].reset_index(drop=True),
                              model_name=BATCHED_WORKFLOW)
        if not np.array_equal(np.stack(got["item_ids"]), ids[rows]):
            return f"rows {rows.tolist()}: item ids differ from eager"
        if not np.allclose(np.stack(got["item_id_scores"]), scores[rows], rtol=RTOL, atol=ATOL):
            return f"rows {rows.tolist()}: scores differ from eager"
        return None

    assert not _concurrently(triton, clients=6, requests_each=6, ask=ask)


# -- a bad request in a batch fails alone ---------------------------------------------------

def _good(seed, rows=3):
    df = factories.random_sessions(rows, np.random.default_rng(seed))
    return df, dataframe_arrays(df, DTYPES)


def _ids_beyond_the_table(arrays):
    values = arrays["item_id-list__values"].copy()
    values[0] = factories.ITEMS + 7
    return {**arrays, "item_id-list__values": values}


def _decreasing_offsets(arrays):
    offsets = arrays["price-list__offsets"].copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    return {**arrays, "price-list__offsets": offsets}


def _send_together(client, payloads):
    """Send ``payloads`` without waiting between them; return each result or error, in order."""
    results = [None] * len(payloads)
    done = threading.Semaphore(0)

    def callback(index):
        def store(result, error):
            results[index] = error if error is not None else result
            done.release()
        return store

    for index, arrays in enumerate(payloads):
        client.async_infer(BATCHED_MODEL, arrays_to_inputs(arrays, batch_dimension=True),
                           callback(index))
    for _ in payloads:
        assert done.acquire(timeout=120), "a request was never answered"
    return results


@pytest.mark.parametrize("spoil, message", [
    # Fails inside the graph: the batch is run again request by request.
    (_ids_beyond_the_table, rf"input 'item_id-list': ids must be < {factories.ITEMS} "),
    # Fails the executor's own check, before the graph runs.
    (_decreasing_offsets, r"input 'price-list__offsets': offsets must not decrease, but "
                          r"offsets\[2\]=\d+ < offsets\[1\]=\d+"),
])
def test_a_bad_request_fails_alone_and_its_batch_is_answered(client, served_models, spoil,
                                                             message):
    model = served_models["next_item_full"]
    goods = [_good(seed) for seed in range(7)]
    bad_at = 3
    payloads = [arrays for _, arrays in goods]
    payloads.insert(bad_at, spoil(_good(99)[1]))
    for _ in range(5):  # until the requests shared one execute call (on a loaded machine)
        before = counts(client, BATCHED_MODEL)
        results = _send_together(client, payloads)
        requests, executions = counts_since(client, BATCHED_MODEL, before,
                                           expect=len(payloads))
        if executions < len(goods):
            break
    assert executions < len(goods), "the requests never shared an execute call"
    assert requests == len(payloads)  # Triton counts the failed one too

    assert isinstance(results[bad_at], InferenceServerException)
    assert results[bad_at].status() == "StatusCode.INVALID_ARGUMENT", results[bad_at]
    assert re.search(message, results[bad_at].message()), results[bad_at].message()
    answers = results[:bad_at] + results[bad_at + 1:]
    for (df, _), answer in zip(goods, answers):
        assert not isinstance(answer, Exception), answer
        np.testing.assert_allclose(answer.as_numpy("next-item")[0],
                                   factories.eager_scores(model, df), rtol=RTOL, atol=ATOL)


# -- offsets are checked before merlin-core builds a TensorColumn ---------------------------

@pytest.mark.parametrize("name, offsets, message", [
    ("item_id-list__offsets", lambda o: np.r_[o[:-1], o[-1] + 4],
     r"input 'item_id-list__offsets': the last offset must equal the number of values "
     r"\(\d+\), got \d+"),
    ("category-list__offsets", lambda o: np.r_[o[0], o[2], o[1], o[3:]],
     r"input 'category-list__offsets': offsets must not decrease"),
    ("price-list__offsets", lambda o: o + 1,
     r"input 'price-list__offsets': offsets must start at 0, got 1"),
])
def test_bad_offsets_get_an_error_naming_the_input(client, served_models, name, offsets,
                                                   message):
    _, arrays = _good(5, rows=4)
    arrays[name] = offsets(arrays[name]).astype(np.int32)
    with pytest.raises(InferenceServerException, match=message) as caught:
        client.infer(BATCHED_MODEL, arrays_to_inputs(arrays, batch_dimension=True))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    # and the server keeps serving
    df, good = _good(6)
    answer = client.infer(BATCHED_MODEL, arrays_to_inputs(good, batch_dimension=True))
    np.testing.assert_allclose(answer.as_numpy("next-item")[0],
                               factories.eager_scores(served_models["next_item_full"], df),
                               rtol=RTOL, atol=ATOL)


def test_a_request_without_rows_gets_the_declared_outputs_without_rows(client):
    _, arrays = _good(7, rows=1)
    empty = {name: (np.zeros(1, dtype=a.dtype) if name.endswith("__offsets")
                    else np.zeros(0, dtype=a.dtype)) for name, a in arrays.items()}
    answer = client.infer(BATCHED_MODEL, arrays_to_inputs(empty, batch_dimension=True))
    assert answer.as_numpy("next-item").shape == (1, 0, factories.ITEMS)


def test_the_http_client_reaches_the_batched_model(triton, served_models):
    import tritonclient.http as httpclient

    df = factories.random_sessions(6, np.random.default_rng(31))
    with httpclient.InferenceServerClient(triton.http_url) as client:
        got = np.stack(infer_dataframe(client, df, model_name=BATCHED_MODEL)["next-item"])
    np.testing.assert_allclose(got, factories.eager_scores(served_models["next_item_full"], df),
                               rtol=RTOL, atol=ATOL)


def test_a_workflow_ensemble_answers_zero_rows_with_its_declared_columns(client,
                                                                         session_workflow):
    """NVTabular's traceback before: the executor answers a request without rows itself."""
    _, _, raw = session_workflow
    got = infer_dataframe(client, raw.head(0), model_name=BATCHED_WORKFLOW)
    assert set(got.columns) == {"item_ids", "item_id_scores"} and len(got) == 0


def test_arrays_reach_the_batched_model_without_its_batch_dimension(client, served_models):
    df = factories.random_sessions(4, np.random.default_rng(32))
    got = infer_arrays(client, dataframe_arrays(df, DTYPES), model_name=BATCHED_MODEL)
    assert got["next-item"].shape == (4, factories.ITEMS)  # the request's batch entry dropped
    np.testing.assert_allclose(got["next-item"],
                               factories.eager_scores(served_models["next_item_full"], df),
                               rtol=RTOL, atol=ATOL)
