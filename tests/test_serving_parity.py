"""Triton's answers equal the in-process eager model's, for every kind of T4R model served."""

import numpy as np
import pytest

import t4r_factories as factories
from conftest import TOP_K
from merlin_t4r_ops.serving.client import infer_dataframe

RTOL, ATOL = 1e-5, 1e-6


def _sessions(n, seed, **kwargs):
    return factories.random_sessions(n, np.random.default_rng(seed), **kwargs)


@pytest.mark.parametrize("rows", [1, 17, 500])
@pytest.mark.parametrize("name", ["next_item_full", "next_item_masked"])
def test_next_item_full_scores_match_eager(client, served_models, name, rows):
    df = _sessions(rows, seed=rows)
    served = infer_dataframe(client, df, model_name=name)
    expected = factories.eager_scores(served_models[name], df)
    got = np.stack(served["next-item"].to_list())
    assert got.shape == (rows, factories.ITEMS)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_top_k_matches_eager_top_k(client, served_models):
    df = _sessions(64, seed=3)
    served = infer_dataframe(client, df, model_name="next_item_topk")
    # Without Categorify, the padding id 0 is the one reserved id.
    expected_ids, expected_scores = factories.reference_top_k(
        factories.eager_scores(served_models["next_item_topk"], df), TOP_K, reserved=(0,))
    ids = np.stack(served["item_ids"].to_list())
    scores = np.stack(served["item_id_scores"].to_list())
    assert ids.shape == scores.shape == (64, TOP_K)
    np.testing.assert_allclose(scores, expected_scores, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(ids, expected_ids)


def test_two_top_ks_of_one_model_load_it_once_and_answer_as_eager(
        triton, client, served_models, model_repository):
    df = _sessions(12, seed=6)
    served = infer_dataframe(client, df, model_name="two_top_ks")
    scores = factories.eager_scores(served_models["next_item_topk"], df)
    for prefix, k in (("a_", 20), ("b_", 5)):
        ids, top = factories.reference_top_k(scores, k)
        np.testing.assert_array_equal(np.stack(served[f"{prefix}item_ids"].to_list()), ids)
        np.testing.assert_allclose(np.stack(served[f"{prefix}item_id_scores"].to_list()), top,
                                   rtol=RTOL, atol=ATOL)
    [folder] = (model_repository / "two_top_ks" / "1" / "ensemble").glob("t4r_model_*")
    assert f"shares the model of {folder.name} already loaded" in triton.logs()


def test_top_k_is_declared_in_the_served_config(client):
    outputs = {o["name"]: o for o in
               client.get_model_metadata("next_item_topk", as_json=True)["outputs"]}
    assert set(outputs) == {"item_ids", "item_id_scores"}
    assert outputs["item_ids"]["shape"][-1] == str(TOP_K)


def test_binary_classification_matches_eager(client, served_models):
    df = _sessions(33, seed=4)
    served = infer_dataframe(client, df, model_name="binary")
    expected = factories.eager_scores(served_models["binary"], df).reshape(-1)
    got = served["click/binary_classification_task"].to_numpy()
    assert got.shape == (33,)
    assert ((got > 0) & (got < 1)).all()
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_long_sessions_keep_their_most_recent_items(client, served_models):
    """A session longer than the model's window is scored on its last SEQ_LEN items."""
    df = _sessions(8, seed=5, min_len=factories.SEQ_LEN + 3, max_len=factories.SEQ_LEN * 3)
    tail = df.apply(lambda col: col.map(lambda s: s[-factories.SEQ_LEN:]))
    head = df.apply(lambda col: col.map(lambda s: s[: factories.SEQ_LEN]))
    served = np.stack(infer_dataframe(client, df, model_name="next_item_full")["next-item"])
    model = served_models["next_item_full"]
    np.testing.assert_allclose(served, factories.eager_scores(model, tail), rtol=RTOL, atol=ATOL)
    assert not np.allclose(served, factories.eager_scores(model, head), rtol=RTOL, atol=ATOL)


def test_workflow_in_front_turns_raw_ids_into_recommendations(client, session_workflow):
    """Raw shop ids go in; the ensemble Categorifies them and returns the model's top-k."""
    workflow, model, raw = session_workflow
    df = raw.head(40).reset_index(drop=True)
    served = infer_dataframe(client, df, model_name="session_topk")
    encoded = workflow.transform(factories_dataset(df)).to_ddf().compute()
    # Categorify reserves 0 (padding), 1 (null) and 2 (out of vocabulary).
    ids, scores = factories.reference_top_k(factories.eager_scores(model, encoded), TOP_K,
                                            reserved=(0, 1, 2))
    np.testing.assert_array_equal(np.stack(served["item_ids"]), ids)
    np.testing.assert_allclose(np.stack(served["item_id_scores"]), scores, rtol=RTOL, atol=ATOL)


def test_local_runtime_agrees_with_triton(client, session_workflow):
    workflow, model, raw = session_workflow
    df = raw.tail(25).reset_index(drop=True)
    local = factories.workflow_ensemble(workflow, model, top_k=TOP_K).transform(df)
    served = infer_dataframe(client, df, model_name="session_topk")
    np.testing.assert_array_equal(np.stack(local["item_ids"]), np.stack(served["item_ids"]))
    np.testing.assert_allclose(np.stack(local["item_id_scores"]),
                               np.stack(served["item_id_scores"]), rtol=RTOL, atol=ATOL)


def factories_dataset(df):
    from merlin.io import Dataset

    return Dataset(df)
