"""One operator, many threads: what ``Ensemble.transform`` behind a threaded web server does.

T4R keeps per-call tensors on its modules (the item sequence, the masking schema), so two
calls inside one forward pass used to score with each other's sessions.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch

THREADS, CALLS = 4, 300


@pytest.mark.parametrize("top_k", [None, 10])
def test_concurrent_calls_answer_like_eager(top_k):
    """Before: 300 calls on 4 threads gave wrong answers and IndexErrors (issue 10, defect 6)."""
    from merlin.systems.dag import Ensemble

    model = factories.next_item_model("xlnet-causal", seed=31)
    ensemble = Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model, top_k=top_k),
                        model.input_schema)
    rng = np.random.default_rng(0)
    # Different batch sizes and lengths, so that a call scoring with another's state shows.
    requests = [factories.random_sessions(int(rng.integers(1, 12)), rng) for _ in range(16)]
    expected = [factories.eager_scores(model, df) for df in requests]
    if top_k is not None:
        expected = [factories.reference_top_k(scores, top_k)[0] for scores in expected]

    def call(i):
        out = ensemble.transform(requests[i % len(requests)])
        return np.stack(out["next-item" if top_k is None else "item_ids"])

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(call, range(CALLS)))  # re-raises the first error
    wrong = []
    for i, answer in enumerate(answers):
        want = expected[i % len(requests)]
        same = answer.shape == want.shape and (
            np.array_equal(answer, want) if top_k else np.allclose(answer, want, 1e-5, 1e-6))
        if not same:
            wrong.append(i)
    assert not wrong, f"{len(wrong)} of {CALLS} answers differ from eager, calls {wrong[:10]}"


def test_two_operators_over_one_model_answer_like_eager_from_threads():
    """Two top-k's of one model in one ensemble (output_prefix) share the model's modules.

    Before, each operator had its own lock: 4 threads x 200 calls gave 14 wrong answers,
    34 of mismatched shapes and 55 IndexErrors (review of issue 10, defect 6).
    """
    from merlin.systems.dag import Ensemble

    model = factories.next_item_model("xlnet-causal", seed=31)
    columns = model.input_schema.column_names
    both = (columns >> PredictT4RPyTorch(model, top_k=5)) + (
        columns >> PredictT4RPyTorch(model, top_k=5, output_prefix="b_"))
    ensemble = Ensemble(both, model.input_schema)
    rng = np.random.default_rng(0)
    requests = [factories.random_sessions(int(rng.integers(1, 12)), rng) for _ in range(16)]
    expected = [factories.reference_top_k(factories.eager_scores(model, df), 5)[0]
                for df in requests]

    def call(i):
        out = ensemble.transform(requests[i % len(requests)])
        return [np.stack(out[prefix + "item_ids"]) for prefix in ("", "b_")]

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(call, range(200)))  # re-raises the first error
    wrong = [i for i, pair in enumerate(answers)
             if not all(np.array_equal(got, expected[i % len(requests)]) for got in pair)]
    assert not wrong, f"{len(wrong)} of 200 answers differ from eager, calls {wrong[:10]}"
