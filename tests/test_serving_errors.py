"""Bad requests get an error that names the input and the problem; the server keeps serving."""

import re

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

import t4r_factories as factories
from merlin_t4r_ops.serving.client import (
    arrays_to_inputs,
    dataframe_arrays,
    infer_dataframe,
)

MODEL = "next_item_full"


# Triton refuses these before any model runs, in words of its own (Triton 2.51, from
# nvidia-pytriton 0.7.0), pinned so that a change in its wording is noticed. An input the
# model does not declare: the refusal lists every input sent (in an order of Triton's).
TRITON_UNDECLARED_INPUT = re.compile(
    r"\[request id: <id_unknown>\] expected number of inputs between 0 and (?P<declared>\d+) "
    r"but got (?P<sent>\d+) inputs for model '[^']+'\. Got input\(s\) \[(?P<names>[^]]*)\], "
    r"but missing required input\(s\) \]\. Please provide all required input\(s\)\."
)
# An input of another dtype than declared: one short line.
TRITON_WRONG_DTYPE = re.compile(
    r"\[request id: <id_unknown>\] inference input '[^']+' data-type is '[A-Z0-9]+', but "
    r"model '[^']+' expects '[A-Z0-9]+'"
)


def assert_one_short_line(message):
    """One line of at most 200 characters, no traceback; Triton's own refusal excepted.

    A missing input reaches the executor (inputs are optional) and is named in one line, but
    Triton refuses an input the model does not declare before any model runs, with a message
    of its own that lists every input sent (300-odd characters here). Triton's own refusals
    (they start with ``[request id: ``) must be one of the texts pinned above.
    """
    if message.startswith("[request id: "):
        undeclared = TRITON_UNDECLARED_INPUT.fullmatch(message)
        assert undeclared or TRITON_WRONG_DTYPE.fullmatch(message), (
            f"Triton's own refusal is none of the pinned texts (a new Triton?): {message}")
        if undeclared:  # nothing missing, one input beyond the declared ones
            names = undeclared["names"].split(",")
            assert int(undeclared["sent"]) == len(names) == int(undeclared["declared"]) + 1
            return
    first_line, *rest = message.splitlines()
    assert len(first_line) <= 200 and not rest, message
    assert "Traceback" not in message


def _good_arrays(n=4, seed=0):
    df = factories.random_sessions(n, np.random.default_rng(seed))
    dtypes = {"item_id-list__values": np.int64, "item_id-list__offsets": np.int32,
              "category-list__values": np.int64, "category-list__offsets": np.int32,
              "price-list__values": np.float32, "price-list__offsets": np.int32}
    return df, dataframe_arrays(df, dtypes)


def _infer(client, arrays):
    return client.infer(MODEL, arrays_to_inputs(arrays))


def _assert_still_serving(client, served_models):
    df = factories.random_sessions(3, np.random.default_rng(99))
    got = np.stack(infer_dataframe(client, df, model_name=MODEL)["next-item"])
    np.testing.assert_allclose(got, factories.eager_scores(served_models[MODEL], df),
                               rtol=1e-5, atol=1e-6)


def _drop(arrays, name):
    return {k: v for k, v in arrays.items() if k != name}


def _replace(arrays, name, value):
    return {**arrays, name: value}


def _ids_out_of_range(arrays):
    values = arrays["item_id-list__values"].copy()
    values[-1] = factories.ITEMS + 5
    return _replace(arrays, "item_id-list__values", values)


def _negative_ids(arrays):
    values = arrays["category-list__values"].copy()
    values[0] = -3
    return _replace(arrays, "category-list__values", values)


def _decreasing_offsets(arrays):
    offsets = arrays["price-list__offsets"].copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    return _replace(arrays, "price-list__offsets", offsets)


def _short_offsets(arrays):
    offsets = arrays["item_id-list__offsets"].copy()
    offsets[-1] -= 1
    return _replace(arrays, "item_id-list__offsets", offsets)


def _lists_that_disagree(arrays):
    """Session 1 holds 3 items, 5 categories and 1 price; every offsets array is valid."""
    df = factories.random_sessions(4, np.random.default_rng(5))
    df.at[1, "item_id-list"] = np.array([1, 2, 3], dtype=np.int64)
    df.at[1, "category-list"] = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    df.at[1, "price-list"] = np.array([0.5], dtype=np.float32)
    return dataframe_arrays(df, {name: a.dtype for name, a in arrays.items()})


def _empty_batch(arrays):
    return {name: (np.zeros(1, dtype=a.dtype) if name.endswith("__offsets")
                   else np.zeros(0, dtype=a.dtype)) for name, a in arrays.items()}


BAD_REQUESTS = {
    "missing input": (lambda a: _drop(a, "price-list__offsets"), r"price-list__offsets"),
    "wrong dtype": (
        lambda a: _replace(a, "item_id-list__values",
                           a["item_id-list__values"].astype(np.float32)),
        r"item_id-list__values.*(FP32|TYPE_INT64|INT64)",
    ),
    "ids beyond the embedding table": (
        _ids_out_of_range,
        rf"'item_id-list': ids must be < {factories.ITEMS}.*got {factories.ITEMS + 5} in row 3",
    ),
    "negative ids": (_negative_ids, r"'category-list': ids must be >= 0, got -3 in row 0"),
    # Merlin's executor builds its TensorTable, and checks offsets, before any operator runs,
    # with messages that name no input; TritonRuntime's executor checks them first.
    "decreasing offsets": (
        _decreasing_offsets, r"input 'price-list__offsets': offsets must not decrease, but "
                             r"offsets\[2\]=\d+ < offsets\[1\]=\d+"),
    "offsets that miss values": (
        _short_offsets, r"input 'item_id-list__offsets': the last offset must equal the "
                        r"number of values \(\d+\), got \d+"
    ),
    "list columns that disagree in length": (
        _lists_that_disagree,
        r"row 1: the list inputs disagree on the session's length: "
        r"\{'item_id-list': 3, 'category-list': 5, 'price-list': 1\}",
    ),
    "extra input": (
        lambda a: _replace(a, "not_a_feature", np.zeros(4, dtype=np.float32)), r"not_a_feature"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_named_and_the_next_one_succeeds(client, served_models, case):
    """INVALID_ARGUMENT, with one short first line that names the input; no traceback."""
    corrupt, message = BAD_REQUESTS[case]
    _, arrays = _good_arrays()
    with pytest.raises(InferenceServerException, match=message) as caught:
        _infer(client, corrupt(arrays))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    assert_one_short_line(caught.value.message())
    _assert_still_serving(client, served_models)


def test_a_request_without_rows_gets_the_declared_outputs_without_rows(client):
    _, arrays = _good_arrays()
    answer = _infer(client, _empty_batch(arrays))
    assert answer.as_numpy("next-item").shape == (0, factories.ITEMS)


def test_client_helper_names_a_missing_column(client):
    df, _ = _good_arrays()
    with pytest.raises(ValueError, match=r"column 'price-list' is missing"):
        infer_dataframe(client, df.drop(columns=["price-list"]), model_name=MODEL)
