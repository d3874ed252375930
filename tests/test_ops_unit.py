"""The operator's contract, in process: schemas, padding, unwrapping and argument errors."""

import numpy as np
import pytest
import torch
from merlin.schema import Schema
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import InvalidRequestError, PredictT4RPyTorch, SchemaMismatchError, T4ROpsError
from merlin_t4r_ops.ops.inputs import input_specs, to_model_inputs


@pytest.fixture(scope="module")
def model():
    return factories.next_item_model("xlnet-causal", seed=11)


def test_ragged_and_fixed_lists_pad_right_and_keep_the_latest_items(model):
    specs = input_specs(model.input_schema)
    df = factories.random_sessions(6, np.random.default_rng(0))
    padded = to_model_inputs(TensorTable.from_df(df), specs, 5, torch.device("cpu"))
    assert padded["item_id-list"].shape == (6, 5)
    for row, session in enumerate(df["item_id-list"]):
        recent = list(session[-5:])
        assert padded["item_id-list"][row, : len(recent)].tolist() == recent
        assert (padded["item_id-list"][row, len(recent):] == 0).all()

    fixed = TensorTable({
        "item_id-list": np.array([[4, 5, 6, 0, 0, 0], [1, 2, 3, 4, 5, 6]], dtype=np.int64),
        "category-list": np.array([[1, 1, 1, 0, 0, 0], [2, 2, 2, 2, 2, 3]], dtype=np.int64),
        "price-list": np.arange(12, dtype=np.float32).reshape(2, 6),
    })
    tensors = to_model_inputs(fixed, specs, 4, torch.device("cpu"))
    assert tensors["item_id-list"].tolist() == [[4, 5, 6, 0], [3, 4, 5, 6]]
    assert tensors["price-list"].tolist() == [[0, 1, 2, 0], [8, 9, 10, 11]]


def test_fixed_and_ragged_requests_score_the_same(model):
    df = factories.random_sessions(5, np.random.default_rng(1), max_len=factories.SEQ_LEN)
    op = PredictT4RPyTorch(model)
    ragged = op.predict(TensorTable.from_df(df))["next-item"]
    padded = factories.reference_inputs(df)
    fixed = op.predict(TensorTable({k: v.numpy() for k, v in padded.items()}))["next-item"]
    np.testing.assert_allclose(ragged, fixed, rtol=1e-6)


def test_wrapped_models_are_unwrapped(model):
    op = PredictT4RPyTorch(torch.nn.DataParallel(model))
    assert op.model is model


def test_the_dp_strategys_model_is_unwrapped_as_training_does(model):
    """One unwrap for training and serving. Before: the operator kept ReplicaLoss."""
    from merlin_t4r_ops.training import unwrap_model
    from merlin_t4r_ops.training.data_parallel import ReplicaLoss

    wrapped = torch.nn.DataParallel(ReplicaLoss(model))  # what strategy "dp" trains
    assert unwrap_model(wrapped) is model
    assert PredictT4RPyTorch(wrapped).model is model


def test_constructor_leaves_the_callers_schemas_alone(model):
    schema = model.input_schema
    before = schema.to_dict() if hasattr(schema, "to_dict") else repr(schema)
    op = PredictT4RPyTorch(model, input_schema=schema, top_k=3)
    after = schema.to_dict() if hasattr(schema, "to_dict") else repr(schema)
    assert before == after
    assert op._input_schema is not schema


def test_top_k_schema_declares_k_not_the_catalogue(model):
    schema = PredictT4RPyTorch(model, top_k=7).compute_output_schema(None, None)
    assert schema.column_names == ["item_ids", "item_id_scores"]
    assert [d.max for d in schema["item_ids"].shape.dims] == [None, 7]


def test_graph_without_a_needed_column_names_it(model):
    from merlin.systems.dag import Ensemble

    schema = model.input_schema
    partial = Schema([schema["item_id-list"], schema["price-list"]])
    with pytest.raises(SchemaMismatchError, match=r"needs column 'category-list'"):
        Ensemble(partial.column_names >> PredictT4RPyTorch(model), partial)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "10"])
def test_top_k_must_be_a_positive_int(model, bad):
    with pytest.raises(T4ROpsError, match=r"top_k must be a positive int"):
        PredictT4RPyTorch(model, top_k=bad)


def test_top_k_refused_for_classification():
    with pytest.raises(T4ROpsError, match=r"top_k applies to next-item prediction only"):
        PredictT4RPyTorch(factories.binary_model(), top_k=5)


def test_rows_that_disagree_are_refused(model):
    table = TensorTable({
        "item_id-list": np.ones((3, 4), dtype=np.int64),
        "category-list": np.ones((2, 4), dtype=np.int64),
        "price-list": np.ones((3, 4), dtype=np.float32),
    })
    with pytest.raises(InvalidRequestError, match=r"disagree on the number of rows"):
        PredictT4RPyTorch(model).predict(table)


def test_nan_price_is_answered_not_refused(model):
    """NaN in a continuous feature is a valid float: the model answers, with NaN scores."""
    df = factories.random_sessions(2, np.random.default_rng(2))
    df.at[0, "price-list"] = np.full(len(df.at[0, "price-list"]), np.nan, dtype=np.float32)
    scores = PredictT4RPyTorch(model).predict(TensorTable.from_df(df))["next-item"]
    assert scores.shape == (2, factories.ITEMS)
    assert np.isfinite(scores[1]).all()


@pytest.mark.parametrize("offsets, message", [
    ([0, 3, 2, 6], r"'item_id-list': offsets must not decrease, but offsets\[2\]=2 < offsets\[1\]=3"),
    ([0, 3, 4, 5], r"'item_id-list': the last offset must equal the number of values \(6\), got 5"),
    ([1, 3, 4, 6], r"'item_id-list': offsets must start at 0, got 1"),
    ([[0, 3, 4, 6]], r"'item_id-list': offsets must be a 1-D array"),
])
def test_bad_offsets_are_named(model, offsets, message):
    from merlin_t4r_ops.ops.inputs import _lengths_from_offsets

    with pytest.raises(InvalidRequestError, match=message):
        _lengths_from_offsets("item_id-list", np.array(offsets), 6)


def test_top_k_ids_are_int32_to_keep_responses_small(model):
    from merlin.table import TensorTable as Table

    op = PredictT4RPyTorch(model, top_k=4)
    assert op.compute_output_schema(None, None)["item_ids"].dtype.to_numpy == np.int32
    out = op.predict(Table.from_df(factories.random_sessions(3, np.random.default_rng(4))))
    assert out["item_ids"].dtype == np.int32 and out["item_ids"].shape == (3, 4)


def test_regression_model_returns_one_score_per_row():
    import transformers4rec.torch as tr

    torch.manual_seed(0)
    schema = factories.session_schema()
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=factories.SEQ_LEN, continuous_projection=16,
        aggregation="concat", masking="causal")
    body = tr.SequentialBlock(inputs, tr.MLPBlock([16]))
    head = tr.Head(body, tr.RegressionTask("spend", summary_type="last"), inputs=inputs)
    model = tr.Model(head, max_sequence_length=factories.SEQ_LEN).eval()
    df = factories.random_sessions(6, np.random.default_rng(8))
    out = PredictT4RPyTorch(model).predict(TensorTable.from_df(df))
    (name,) = out
    assert out[name].shape == (6,)
    np.testing.assert_allclose(out[name], factories.eager_scores(model, df).reshape(-1), rtol=1e-6)
