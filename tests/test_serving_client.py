"""``infer_dataframe``, ``infer_arrays`` and friends: what a request may hold, what comes back,
how many RPCs."""

import numpy as np
import pandas as pd
import pytest

import t4r_factories as factories
from merlin_t4r_ops.errors import InvalidRequestError
from merlin_t4r_ops.serving.client import (
    checked_arrays, dataframe_arrays, infer_arrays, infer_dataframe)

DTYPES = {"item_id-list__values": np.int64, "item_id-list__offsets": np.int32,
          "category-list__values": np.int64, "category-list__offsets": np.int32,
          "price-list__values": np.float32, "price-list__offsets": np.int32}


def _sessions(rows=3, seed=0):
    return factories.random_sessions(rows, np.random.default_rng(seed))


@pytest.mark.parametrize("bad, shown", [(3.5, "3.5"), (np.nan, "nan"), (np.inf, "inf")])
def test_float_ids_with_a_fraction_or_nan_are_refused_naming_the_column(bad, shown):
    df = _sessions()
    df.at[1, "item_id-list"] = np.r_[df.at[1, "item_id-list"].astype(float), bad]
    df.at[1, "category-list"] = np.r_[df.at[1, "category-list"], 1]
    df.at[1, "price-list"] = np.r_[df.at[1, "price-list"], 1.0]
    with pytest.raises(InvalidRequestError,
                       match=rf"column 'item_id-list' row 1: expected integer ids \(int64\), "
                             rf"got {shown}"):
        dataframe_arrays(df, DTYPES)


def test_whole_float_ids_are_sent_as_the_integers_they_are():
    df = _sessions()
    floats = df.assign(**{"item_id-list": [ids.astype(float) for ids in df["item_id-list"]]})
    for name, array in dataframe_arrays(floats, DTYPES).items():
        np.testing.assert_array_equal(array, dataframe_arrays(df, DTYPES)[name])


def test_a_scalar_id_column_with_nan_is_refused():
    df = pd.DataFrame({"user": [4.0, np.nan]})
    with pytest.raises(InvalidRequestError,
                       match=r"column 'user' row 1: expected integer ids \(int64\), got nan"):
        dataframe_arrays(df, {"user": np.int64})


@pytest.mark.parametrize("bad", [7, None])
def test_a_scalar_or_none_where_a_list_belongs_is_named(bad):
    df = _sessions()
    df["item_id-list"] = df["item_id-list"].astype(object)
    df.at[2, "item_id-list"] = bad
    with pytest.raises(InvalidRequestError,
                       match=rf"column 'item_id-list' row 2: expected a list of values, "
                             rf"got {bad!r}"):
        dataframe_arrays(df, DTYPES)


def test_top_1_answers_a_list_of_one_per_row(client, served_models):
    df = _sessions(rows=4, seed=3)
    got = infer_dataframe(client, df, model_name="next_item_top1")
    expected = np.argmax(factories.eager_scores(served_models["next_item_topk"], df), axis=1)
    assert [np.asarray(ids).shape for ids in got["item_ids"]] == [(1,)] * 4
    np.testing.assert_array_equal(np.stack(got["item_ids"])[:, 0], expected)


def _counting(client, monkeypatch):
    calls = []
    for name in ("get_model_metadata", "get_model_config", "infer"):
        method = getattr(client, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)
        monkeypatch.setattr(client, name, counted)
    return calls


def test_metadata_is_read_once_per_client_and_model(triton, monkeypatch):
    client = triton.client()
    calls = _counting(client, monkeypatch)
    df = _sessions()
    first = infer_dataframe(client, df, model_name="next_item_full")
    assert sorted(calls) == ["get_model_config", "get_model_metadata", "infer"]
    calls.clear()
    for _ in range(3):
        again = infer_dataframe(client, df, model_name="next_item_full")
    assert calls == ["infer"] * 3
    np.testing.assert_array_equal(np.stack(again["next-item"]), np.stack(first["next-item"]))
    calls.clear()
    infer_dataframe(client, df, model_name="next_item_full", refresh_metadata=True)
    assert sorted(calls) == ["get_model_config", "get_model_metadata", "infer"]


@pytest.mark.parametrize("extra", ["session_id", "item_id_list__values"])
def test_a_dtypes_name_the_model_does_not_declare_is_refused_naming_it(client, extra):
    df = _sessions().assign(session_id=1)
    with pytest.raises(InvalidRequestError,
                       match=rf"^dtypes names '{extra}', which model 'next_item_full' does not "
                             r"declare; it declares \['category-list__offsets', .*"
                             r"'price-list__values'\]$"):
        infer_dataframe(client, df, model_name="next_item_full",
                        dtypes={**DTYPES, extra: np.int64})


# ---- infer_arrays: flat arrays in, arrays out ----------------------------------------------------


@pytest.mark.parametrize("model_name, output", [("next_item_full", "next-item"),
                                                ("next_item_top1", "item_ids")])
def test_arrays_answer_what_the_dataframe_answers(client, model_name, output):
    df = _sessions(rows=5, seed=11)
    arrays = dataframe_arrays(df, DTYPES)
    got = infer_arrays(client, arrays, model_name=model_name)
    expected = infer_dataframe(client, df, model_name=model_name)
    assert isinstance(got[output], np.ndarray) and len(got[output]) == 5
    np.testing.assert_array_equal(got[output], np.stack(expected[output]))


def test_arrays_of_the_wrong_integer_width_are_cast_as_declared(client):
    arrays = dataframe_arrays(_sessions(rows=3, seed=12), DTYPES)
    narrow = {name: (a.astype(np.int32) if a.dtype == np.int64 else a)
              for name, a in arrays.items()}
    got = infer_arrays(client, narrow, model_name="next_item_top1")
    np.testing.assert_array_equal(
        got["item_ids"], infer_arrays(client, arrays, model_name="next_item_top1")["item_ids"])


def test_an_array_the_model_does_not_declare_is_refused_naming_it(client):
    arrays = {**dataframe_arrays(_sessions(), DTYPES), "session_id": np.arange(3)}
    with pytest.raises(InvalidRequestError,
                       match=r"^arrays names 'session_id', which model 'next_item_full' does not "
                             r"declare; it declares \['category-list__offsets', "):
        infer_arrays(client, arrays, model_name="next_item_full")


def test_a_missing_input_is_refused_naming_it(client):
    arrays = dataframe_arrays(_sessions(), DTYPES)
    del arrays["price-list__offsets"]
    with pytest.raises(InvalidRequestError,
                       match=r"^arrays lack 'price-list__offsets': model 'next_item_full' takes "
                             r"\['category-list__offsets', .*the arrays hold \["):
        infer_arrays(client, arrays, model_name="next_item_full")


def test_a_fractional_id_in_flat_values_is_refused_naming_its_session(client):
    arrays = dataframe_arrays(_sessions(rows=3), DTYPES)
    values = arrays["item_id-list__values"].astype(float)
    values[arrays["item_id-list__offsets"][2]] = 4.5  # the third session's first item
    with pytest.raises(InvalidRequestError,
                       match=r"^input 'item_id-list__values' session 2: expected integer ids "
                             r"\(int64\), got 4.5$"):
        infer_arrays(client, {**arrays, "item_id-list__values": values},
                     model_name="next_item_full")


def test_an_array_of_another_rank_is_refused_naming_it(client):
    arrays = dataframe_arrays(_sessions(rows=3), DTYPES)
    values = arrays["price-list__values"]
    with pytest.raises(InvalidRequestError,
                       match=rf"^input 'price-list__values': the model takes shape \[-1\], "
                             rf"the array is \[{len(values)}, 1\]$"):
        infer_arrays(client, {**arrays, "price-list__values": values[:, None]},
                     model_name="next_item_full")


IDS = {"x__values": np.int64, "x__offsets": np.int32, "user": np.int64}


def _flat(values, offsets=(0, 2, 3), user=(7, 8)):
    return {"x__values": np.asarray(values), "x__offsets": np.asarray(offsets),
            "user": np.asarray(user)}


@pytest.mark.parametrize("values", [np.array(["1", "x", "3"]), np.array([b"1", b"x", b"3"]),
                                    np.array(["1", "x", "3"], dtype=object)])
def test_text_that_is_no_number_is_refused_naming_the_input(values):
    with pytest.raises(InvalidRequestError,
                       match=r"^input 'x__values': expected integer ids \(int64\), got values "
                             r"that are not numbers of that range \(could not convert"):
        checked_arrays(_flat(values), IDS, None)


@pytest.mark.parametrize("arrays, shown", [
    (_flat([1, 2, 3], offsets=np.array([0, 2, 2**31], dtype=np.int64)),
     r"input 'x__offsets' position 2: expected integer ids \(int32\), got 2147483648"),
    (_flat(np.array([1.0, 1e30, 3.0])),
     r"input 'x__values' session 0: expected integer ids \(int64\), got 1e\+30"),
    (_flat([1, 2, 3], user=np.array([7, 2**64 - 1], dtype=np.uint64)),
     r"input 'user' position 1: expected integer ids \(int64\), got 18446744073709551615"),
])
def test_ids_outside_the_declared_range_are_refused_not_wrapped(arrays, shown):
    with pytest.raises(InvalidRequestError, match=rf"^{shown}$"):
        checked_arrays(arrays, IDS, None)


def test_arrays_are_cast_and_shaped_as_declared():
    got = checked_arrays(_flat([1.0, 2.0, 3.0], offsets=np.array([0, 2, 3], dtype=np.int64),
                               user=[7, 8]),
                         IDS, {"x__values": [-1], "x__offsets": [-1], "user": [-1, 1]})
    assert {name: (a.dtype, a.shape) for name, a in got.items()} == {
        "x__values": (np.dtype(np.int64), (3,)), "x__offsets": (np.dtype(np.int32), (3,)),
        "user": (np.dtype(np.int64), (2, 1))}
    np.testing.assert_array_equal(got["x__values"], [1, 2, 3])
