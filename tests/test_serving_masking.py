"""Against the real tritonserver: top-k's without reserved ids, and without the session's items.

The served ensemble ``session_unseen`` (tests/conftest.py) Categorifies raw sessions and
answers two top-k's of one model: ``item_ids`` with ``exclude_seen=True`` and ``all_item_ids``
without. Each is compared with a reference built the slow, obvious way here: the workflow's
transform in process, the eager model at its own width, reserved and seen ids set to -inf
one by one, ``torch.topk``, and the unique-values table read with pandas.
"""

import numpy as np
import pandas as pd
import pytest
import torch

import t4r_factories as factories
from conftest import MASKED_TOP_K as K
from merlin_t4r_ops.serving.client import infer_dataframe

RTOL, ATOL = 1e-5, 1e-6
ITEMS = "item_id-list"
RESERVED = (0, 1, 2)  # NVTabular 23.08 Categorify: padding, null, out-of-vocabulary
HIDDEN = 3


def _encode(workflow, df):
    from merlin.io import Dataset

    return workflow.transform(Dataset(df)).to_ddf().compute().reset_index(drop=True)


@pytest.fixture(scope="module")
def hiding_sessions(session_workflow):
    """Raw sessions whose 3 oldest items, dropped by cropping, are the model's best picks.

    Returns (raw sessions, the hidden items' encoded ids per row).
    """
    workflow, model, raw = session_workflow
    long = raw[raw[ITEMS].map(len) >= factories.SEQ_LEN].head(24).reset_index(drop=True)
    recent = long.apply(lambda col: col.map(lambda s: s[-factories.SEQ_LEN:]))
    encoded = _encode(workflow, recent)
    top, _ = factories.reference_top_k(factories.eager_scores(model, encoded), K, RESERVED,
                                       encoded[ITEMS])
    hidden = top[:, :HIDDEN]
    unique = pd.read_parquet(workflow.output_schema[ITEMS].properties["cat_path"])
    raw_id = unique[ITEMS]  # indexed by encoded id
    full = recent.copy()
    full[ITEMS] = [np.concatenate([raw_id.loc[ids].to_numpy(), s])
                   for ids, s in zip(hidden, recent[ITEMS])]
    full["category-list"] = [np.concatenate([np.repeat(s[:1], HIDDEN), s])
                             for s in recent["category-list"]]
    full["price-list"] = [np.concatenate([np.full(HIDDEN, 0.5, np.float32), s])
                          for s in recent["price-list"]]
    return full, hidden


def test_served_top_k_leaves_out_reserved_and_seen_items(client, session_workflow,
                                                         hiding_sessions):
    workflow, model, _ = session_workflow
    full, hidden = hiding_sessions
    served = infer_dataframe(client, full, model_name="session_unseen")

    encoded = _encode(workflow, full)
    assert (encoded[ITEMS].map(len) > factories.SEQ_LEN).all()
    scores = factories.eager_scores(model, encoded)  # the model at its own width
    unmasked = torch.topk(torch.from_numpy(scores), K).indices.numpy()
    assert np.isin(unmasked, RESERVED).any(), "precondition: reserved ids rank inside top-k"

    for prefix, sessions in (("", encoded[ITEMS]), ("all_", None)):
        ids, values = factories.reference_top_k(scores, K, RESERVED, sessions)
        got_ids = np.stack(served[prefix + "item_ids"])
        assert got_ids.shape == (len(full), K)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(np.stack(served[prefix + "item_id_scores"]), values,
                                   rtol=RTOL, atol=ATOL)
        assert not np.isin(got_ids, RESERVED).any()

    unseen = np.stack(served["item_ids"])
    for row, session in enumerate(encoded[ITEMS]):
        assert not set(session) & set(unseen[row])
    # The dropped items are what a top-k that excluded only the model's window would give.
    window = encoded[ITEMS].map(lambda s: s[-factories.SEQ_LEN:])
    window_only, _ = factories.reference_top_k(scores, K, RESERVED, window)
    np.testing.assert_array_equal(window_only[:, :HIDDEN], hidden)


def test_both_top_ks_are_declared_under_their_own_names(client):
    outputs = {o["name"]: o for o in
               client.get_model_metadata("session_unseen", as_json=True)["outputs"]}
    assert set(outputs) == {"item_ids", "item_id_scores", "all_item_ids", "all_item_id_scores"}
    assert {o["shape"][-1] for o in outputs.values()} == {str(K)}
