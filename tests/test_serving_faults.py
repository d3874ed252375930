"""Serving under load and faults: concurrent clients, fuzzed payloads, killed stubs.

All traffic goes to the test's own server on 127.0.0.1; every loop is bounded in count and time.
"""

import os
import re
import signal
import threading
import time

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from merlin.systems.dag import Ensemble
from tritonclient.utils import InferenceServerException

import t4r_factories as factories
from test_serving_errors import assert_one_short_line
from merlin_t4r_ops import PredictT4RPyTorch
from merlin_t4r_ops.serving import triton_server
from merlin_t4r_ops.serving.client import (
    arrays_to_inputs,
    dataframe_arrays,
    infer_dataframe,
)

pytestmark = pytest.mark.slow

MODEL = "next_item_full"
DTYPES = {"item_id-list__values": np.int64, "item_id-list__offsets": np.int32,
          "category-list__values": np.int64, "category-list__offsets": np.int32,
          "price-list__values": np.float32, "price-list__offsets": np.int32}
RTOL, ATOL = 1e-5, 1e-6


def _stub_rss(server, model):
    for proc in psutil.Process(server.process.pid).children():
        if any(f"/{model}/" in arg for arg in proc.cmdline()):
            return proc.memory_info().rss
    raise AssertionError(f"no stub process serves {model}")


def _infer_arrays(client, arrays):
    return client.infer(MODEL, arrays_to_inputs(arrays))


def test_eight_concurrent_clients_get_their_own_answers(triton, served_models):
    clients, requests_each, deadline = 8, 200, time.monotonic() + 600
    pool = factories.random_sessions(400, np.random.default_rng(0))
    expected = factories.eager_scores(served_models[MODEL], pool)
    for _ in range(5):  # warm-up, so the memory baseline holds the allocator's steady state
        infer_dataframe(triton.client(), pool.head(32), model_name=MODEL)
    rss_before = _stub_rss(triton, MODEL)
    errors, mismatches, served = [], [], [0] * clients

    def worker(index):
        rng = np.random.default_rng(100 + index)
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        try:
            for _ in range(requests_each):
                if time.monotonic() > deadline:
                    errors.append(f"client {index}: time limit reached")
                    return
                rows = rng.choice(len(pool), size=int(rng.integers(1, 33)), replace=False)
                try:
                    got = infer_dataframe(client, pool.iloc[rows].reset_index(drop=True),
                                          model_name=MODEL, dtypes=DTYPES)
                except InferenceServerException as exc:
                    errors.append(f"client {index}: {exc}")
                    continue
                if not np.allclose(np.stack(got["next-item"]), expected[rows],
                                   rtol=RTOL, atol=ATOL):
                    mismatches.append((index, rows.tolist()))
                served[index] += 1
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    rss_after = _stub_rss(triton, MODEL)
    print(f"\nload: {sum(served)} requests in {elapsed:.1f} s, {len(errors)} errors, "
          f"stub RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")
    assert errors == []
    assert mismatches == []
    assert sum(served) == clients * requests_each
    assert rss_after - rss_before < 64 * 2**20


def _good(rng, rows=4):
    df = factories.random_sessions(rows, rng)
    return df, dataframe_arrays(df, DTYPES)


def _fuzz_cases(rng):
    """(label, arrays, expected error regex or None when the model should answer)."""
    cases = []
    for _ in range(25):
        _, a = _good(rng, rows=int(rng.integers(2, 9)))
        name = rng.choice(sorted(DTYPES))
        wrong = {np.dtype(np.int64): np.float64, np.dtype(np.int32): np.float32,
                 np.dtype(np.float32): np.int64}[a[name].dtype]
        cases.append(("wrong dtype", {**a, name: a[name].astype(wrong)}, name))

        _, a = _good(rng)
        col = rng.choice(["item_id-list", "category-list", "price-list"])
        offs = a[f"{col}__offsets"].copy()
        kind = rng.integers(3)
        if kind == 0:
            offs[1], offs[2] = offs[2] + 1, offs[1]
            cases.append(("decreasing offsets", {**a, f"{col}__offsets": offs},
                          r"Offsets must be in increasing order|offsets must not decrease"))
        elif kind == 1:
            offs[-1] += int(rng.integers(1, 50))
            cases.append(("offsets out of range", {**a, f"{col}__offsets": offs},
                          r"last offset must (match|equal)"))
        else:
            cases.append(("offsets of the wrong length", {**a, f"{col}__offsets": offs[:-1]},
                          r"last offset must (match|equal)|disagree on the number of rows"))

        _, a = _good(rng)
        ids = a["item_id-list__values"].copy()
        ids[int(rng.integers(len(ids)))] = -int(rng.integers(1, 1000))
        cases.append(("negative ids", {**a, "item_id-list__values": ids},
                      r"'item_id-list': ids must be >= 0"))

        _, a = _good(rng)
        ids = a["category-list__values"].copy()
        ids[int(rng.integers(len(ids)))] = factories.CATEGORIES + int(rng.integers(0, 10**6))
        cases.append(("ids beyond the table", {**a, "category-list__values": ids},
                      rf"'category-list': ids must be < {factories.CATEGORIES}"))

        _, a = _good(rng)
        ids = a["item_id-list__values"].copy()
        ids[int(rng.integers(len(ids)))] = factories.ITEMS + int(rng.integers(0, 10**6))
        cases.append(("item ids beyond the table", {**a, "item_id-list__values": ids},
                      rf"'item_id-list': ids must be < {factories.ITEMS}.* in row \d"))

        df, _ = _good(rng)
        row = int(rng.integers(len(df)))
        df.at[row, "price-list"] = np.append(df.at[row, "price-list"], np.float32(1.0))
        cases.append(("list columns that disagree", dataframe_arrays(df, DTYPES),
                      rf"row {row}: the list inputs disagree on the session's length"))

        _, a = _good(rng)
        cases.append(("zero rows", {k: (np.zeros(1, v.dtype) if k.endswith("__offsets")
                                        else np.zeros(0, v.dtype)) for k, v in a.items()},
                      None))

        _, a = _good(rng)
        name = rng.choice(sorted(DTYPES))
        cases.append(("missing input", {k: v for k, v in a.items() if k != name}, name))

        _, a = _good(rng)
        cases.append(("extra input", {**a, "session_secret": np.ones(3, np.float32)},
                      r"session_secret"))

        _, a = _good(rng)
        prices = a["price-list__values"].copy()
        prices[: max(1, len(prices) // 3)] = rng.choice([np.nan, np.inf, -np.inf])
        cases.append(("NaN or inf in a continuous feature", {**a, "price-list__values": prices},
                      None))
    return cases


def test_fuzzed_bad_requests_are_named_and_never_break_the_server(triton, served_models):
    """200 bad requests: each INVALID_ARGUMENT, one line under 200 characters naming the input;
    a good request after each gets the eager answer."""
    rng = np.random.default_rng(2024)
    client = triton.client()
    model = served_models[MODEL]
    cases = _fuzz_cases(rng)
    assert sum(message is not None for _, _, message in cases) == 200
    unnamed = []
    for label, arrays, message in cases:
        if message is None:
            scores = _infer_arrays(client, arrays).as_numpy("next-item")
            assert scores.shape == (len(arrays["item_id-list__offsets"]) - 1, factories.ITEMS)
        else:
            with pytest.raises(InferenceServerException) as caught:
                _infer_arrays(client, arrays)
            error = caught.value
            if (not re.search(message, error.message().splitlines()[0])
                    or error.status() != "StatusCode.INVALID_ARGUMENT"):
                unnamed.append((label, message, error.status(), error.message()[:300]))
            assert_one_short_line(error.message())
        df, good = _good(rng, rows=3)
        got = _infer_arrays(client, good).as_numpy("next-item")
        np.testing.assert_allclose(got, factories.eager_scores(model, df), rtol=RTOL, atol=ATOL)
    print(f"\nfuzz: {len(cases)} requests ({len(cases) - len(unnamed)} answered as expected), "
          "each followed by a good one that got the eager answer")
    assert unnamed == []


def test_a_hundred_thousand_rows_are_answered(triton, served_models):
    df = factories.random_sessions(100_000, np.random.default_rng(5), max_len=4)
    got = infer_dataframe(triton.client(), df, model_name="next_item_topk", dtypes=DTYPES)
    assert len(got) == 100_000
    sample = df.iloc[:50].reset_index(drop=True)
    expected = factories.eager_scores(served_models["next_item_topk"], sample)
    np.testing.assert_array_equal(np.stack(got["item_ids"][:50]),
                                  np.argsort(-expected, axis=1, kind="stable")[:, :10])


def test_a_killed_stub_is_detected_and_the_model_comes_back(tmp_path):
    model = factories.binary_model(seed=41)
    Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
             model.input_schema).export(str(tmp_path))
    df = factories.random_sessions(4, np.random.default_rng(1))
    expected = factories.eager_scores(model, df).reshape(-1)
    with triton_server(tmp_path, heal_interval=0.2) as server:
        client = server.client()
        np.testing.assert_allclose(infer_dataframe(client, df).iloc[:, 0], expected, rtol=1e-5)
        (stub,) = [p for p in psutil.Process(server.process.pid).children()
                   if p.pid in server._stub_models]
        killed = time.monotonic()
        os.kill(stub.pid, signal.SIGKILL)
        back, last_error = None, None
        while time.monotonic() - killed < 180 and back is None:
            try:
                got = infer_dataframe(client, df).iloc[:, 0]
                back = time.monotonic() - killed
            except InferenceServerException as exc:
                last_error = str(exc)
                time.sleep(0.2)
        assert back is not None, f"model never came back; last error: {last_error}"
        assert server.dead_stubs() == {}
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        print(f"\nrestart: a killed stub was replaced and served again after {back:.1f} s")
