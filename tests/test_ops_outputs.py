"""Output names: two models in one ensemble, each under its own names, and collisions refused."""

import numpy as np
import pytest

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch, SchemaMismatchError

RTOL, ATOL = 1e-5, 1e-6
K = 5


@pytest.fixture(scope="module")
def models():
    return (factories.next_item_model("xlnet-causal", seed=41),
            factories.next_item_model("gpt2", seed=42))


def _ensemble(node, model):
    from merlin.systems.dag import Ensemble

    return Ensemble(node, model.input_schema)


def test_two_operators_with_the_same_outputs_are_refused(models):
    """Before: both wrote item_ids/item_id_scores and only the second survived, silently."""
    first, second = models
    columns = first.input_schema.column_names
    a = columns >> PredictT4RPyTorch(first, top_k=K)
    b = columns >> PredictT4RPyTorch(second, top_k=K)
    with pytest.raises(SchemaMismatchError,
                       match=r"output columns \['item_ids', 'item_id_scores'\] of "
                             r"PredictT4RPyTorch collide .* output_prefix="):
        _ensemble(a + b, first)


def test_full_score_outputs_that_collide_are_refused(models):
    first, second = models
    columns = first.input_schema.column_names
    with pytest.raises(SchemaMismatchError, match=r"output columns \['next-item'\]"):
        _ensemble((columns >> PredictT4RPyTorch(first)) + (columns >> PredictT4RPyTorch(second)),
                  first)


def test_output_prefix_serves_both_models_side_by_side(models):
    first, second = models
    columns = first.input_schema.column_names
    a = columns >> PredictT4RPyTorch(first, top_k=K)
    b = columns >> PredictT4RPyTorch(second, top_k=K, output_prefix="gpt_")
    ensemble = _ensemble(a + b, first)
    assert ensemble.output_schema.column_names == [
        "item_ids", "item_id_scores", "gpt_item_ids", "gpt_item_id_scores"]
    df = factories.random_sessions(7, np.random.default_rng(44))
    out = ensemble.transform(df)
    for prefix, model in (("", first), ("gpt_", second)):
        ids, scores = factories.reference_top_k(factories.eager_scores(model, df), K)
        np.testing.assert_array_equal(np.stack(out[prefix + "item_ids"]), ids)
        np.testing.assert_allclose(np.stack(out[prefix + "item_id_scores"]), scores,
                                   rtol=RTOL, atol=ATOL)


def test_output_prefix_names_full_scores_too(models):
    first, _ = models
    schema = PredictT4RPyTorch(first, output_prefix="a_").compute_output_schema(None, None)
    assert schema.column_names == ["a_next-item"]
