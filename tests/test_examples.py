"""Both examples run end to end on a small config: real NVTabular, T4R, fit and tritonserver."""

import math
import subprocess
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


def test_the_demo_prints_progress_metrics_and_answers_without_warnings(tmp_path):
    """What ``scripts/demo`` prints, run as it runs (a fresh interpreter, progress bar on), on
    the small config: the lines a user needs and not one warning."""
    args = [arg for arg in SMALL if arg != "--no-progress"] + ["--output-dir", str(tmp_path)]
    run = subprocess.run([sys.executable, str(EXAMPLES / "session_based.py"), *args],
                         capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert [line for line in output.splitlines() if "Warning" in line] == []
    for needed in ("epoch 1/1", "held-out NDCG@20=", "top-20: [", "Triton vs in-process"):
        assert needed in output, output


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


def test_fit_logs_the_loss_and_the_example_plots_it_where_matplotlib_is(next_item):
    out, results = next_item
    log = pd.read_csv(out / "logs" / "log.csv")
    loss = log[log["name"] == "train/loss"]
    assert len(loss) >= 1 and np.isfinite(loss["value"]).all()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "loss.png").exists()
    else:
        assert (out / "loss.png").stat().st_size > 0


def test_recommendations_are_original_item_ids(next_item):
    """The server answers in the shop's ids: K distinct known items, none of the session's."""
    _, results = next_item
    recommendations = results["recommendations"]
    assert len(recommendations) == len(results["requests"]) == 6
    for top, session in zip(recommendations, results["requests"]["item_id-list"]):
        assert len(top) == session_based.K
        assert len(set(top)) == len(top)
        assert set(top) <= results["raw_item_ids"]
        assert set(top).isdisjoint(list(session))
    assert np.stack(results["served"]["item_ids"]).dtype == np.int64


def test_served_ids_round_trip_the_requests(next_item):
    """Encoding a raw request with the served workflow and decoding it with the vocabulary
    that DecodeItemIds exports gives it back; items new in the held-out period are OOV."""
    import nvtabular as nvt
    from merlin.io import Dataset

    from merlin_t4r_ops import DecodeItemIds

    out, results = next_item
    requests = results["requests"].reset_index(drop=True)
    workflow = nvt.Workflow.load(str(out / "workflow"))
    encoded = workflow.transform(Dataset(requests, npartitions=1)).to_ddf().compute()
    vocabulary = DecodeItemIds(workflow).vocabulary
    (path,) = (out / "categories").glob("unique.item_id*.parquet")
    known = set(pd.read_parquet(path)["item_id-list"].tolist())
    checked = 0
    for raw, codes in zip(requests["item_id-list"], encoded["item_id-list"]):
        for raw_id, code in zip(raw, codes):
            if raw_id in known:
                assert vocabulary.decode(np.array([code]))[0] == raw_id
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
