"""Both examples run end to end on a small config: real NVTabular, T4R, fit and tritonserver."""

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import binary_classification  # noqa: E402
import session_based  # noqa: E402

SMALL = ["--sessions", "300", "--items", "200", "--epochs", "1", "--requests", "6",
         "--batch-size", "64", "--no-progress"]


@pytest.fixture(scope="module")
def next_item(tmp_path_factory):
    out = tmp_path_factory.mktemp("session_based")
    return out, session_based.main(SMALL + ["--output-dir", str(out)])


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    out = tmp_path_factory.mktemp("binary")
    return out, binary_classification.main(SMALL + ["--output-dir", str(out)])


def _in_unit_interval(metrics):
    return all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in metrics.values())


def test_next_item_metrics_are_finite_and_in_unit_interval(next_item):
    _, results = next_item
    assert set(results["metrics"]) == {"ndcg@20", "recall@20"}
    assert _in_unit_interval(results["metrics"]), results["metrics"]
    assert math.isfinite(results["history"][-1]["train_loss"])


def test_recommendations_are_original_item_ids(next_item):
    out, results = next_item
    recommendations = results["recommendations"]
    assert len(recommendations) == len(results["requests"]) == 6
    for top in recommendations:
        assert len(top) == session_based.K
        assert len(set(top)) == len(top)
        assert set(top) <= results["raw_item_ids"]
    # Decoded independently of the example's helper: the vocabulary file's index is the
    # encoded id, reserved ids (pad, null, OOV) have no row and are skipped.
    (path,) = (out / "categories").glob("unique.item_id*.parquet")
    vocabulary = pd.read_parquet(path)["item_id-list"]
    for ids, top in zip(results["served"]["item_ids"], recommendations):
        expected = [int(vocabulary[i]) for i in ids if i in vocabulary.index]
        assert top == expected[: session_based.K]


def test_vocabulary_round_trips_the_requests(next_item):
    """Encoding a raw request with the served workflow and decoding it gives it back."""
    import nvtabular as nvt
    from merlin.io import Dataset

    out, results = next_item
    requests = results["requests"].reset_index(drop=True)
    workflow = nvt.Workflow.load(str(out / "workflow"))
    encoded = workflow.transform(Dataset(requests, npartitions=1)).to_ddf().compute()
    vocabulary = session_based.common.item_vocabulary(out / "categories")
    known = set(vocabulary[vocabulary >= 0].tolist())
    checked = 0
    for raw, codes in zip(requests["item_id-list"], encoded["item_id-list"]):
        for raw_id, code in zip(raw, codes):
            if raw_id in known:
                assert vocabulary[code] == raw_id
                checked += 1
            else:  # an item first seen in the held-out period
                assert code == 2
    assert checked > 0


def test_next_item_triton_agrees_with_in_process(next_item):
    _, results = next_item
    served, local = results["served"], results["local"]
    np.testing.assert_array_equal(np.stack(served["item_ids"]), np.stack(local["item_ids"]))
    np.testing.assert_allclose(np.stack(served["item_id_scores"]),
                               np.stack(local["item_id_scores"]), rtol=1e-5, atol=1e-6)
    assert results["agreement"]["ids_equal"] and results["agreement"]["scores_close"]


def test_binary_triton_agrees_with_in_process(binary):
    _, results = binary
    served, local = results["served"], results["local"]
    assert served.shape == local.shape == (6,)
    assert ((served > 0) & (served < 1)).all()
    np.testing.assert_allclose(served, local, rtol=1e-5, atol=1e-6)


def test_binary_metrics_are_finite_and_in_unit_interval(binary):
    _, results = binary
    assert set(results["metrics"]) == {"accuracy", "precision", "recall"}
    assert _in_unit_interval(results["metrics"]), results["metrics"]
