"""Top-k in process: T4R's own ``model.top_k``, the catalogue's size, reserved and seen ids.

Every answer is compared with a reference built the slow, obvious way in the test: the
eager model at its own width, reserved and seen ids set to -inf one by one, ``torch.topk``.
"""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from merlin.schema import Tags
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch, T4ROpsError
from merlin_t4r_ops.ops.inputs import to_model_inputs
from merlin_t4r_ops.ops.masking import FILLER_ID, reserved_item_ids
from merlin_t4r_ops.ops.predict_t4r import SEEN_IN_GRAPH

RTOL, ATOL = 1e-5, 1e-6
ITEMS = "item_id-list"


@pytest.fixture
def model():
    return factories.next_item_model("xlnet-causal", seed=21)


def _served(op, df):
    return op.predict(TensorTable.from_df(df))


def _sessions_hiding_top_items(model, n, seed, k, hidden=3, reserved=(0,)):
    """Sessions whose oldest ``hidden`` items are what the model ranks best for the rest.

    Each session is SEQ_LEN recent items (what the model sees) behind ``hidden`` older
    ones that cropping to the model's width drops; the older ones are the top of the
    reference top-k of the recent part, so only an exclusion that sees the whole session
    as sent keeps them out. Returns (sessions, hidden ids per row).
    """
    recent = factories.random_sessions(n, np.random.default_rng(seed), min_len=factories.SEQ_LEN,
                                       max_len=factories.SEQ_LEN)
    top, _ = factories.reference_top_k(factories.eager_scores(model, recent), k, reserved,
                                       recent[ITEMS])
    older = top[:, :hidden]
    full = recent.copy()
    full[ITEMS] = [np.concatenate([o, s]) for o, s in zip(older.astype(np.int64), recent[ITEMS])]
    full["category-list"] = [np.concatenate([np.ones(hidden, np.int64), s])
                             for s in recent["category-list"]]
    full["price-list"] = [np.concatenate([np.full(hidden, 0.5, np.float32), s])
                          for s in recent["price-list"]]
    return full, older


# -- issue 10 defect 2: T4R's own model.top_k ------------------------------------------------
def test_model_top_k_is_adopted(model):
    """Before: item_ids declared float32 and "'tuple' object has no attribute 'float'"."""
    model.top_k = 5
    op = PredictT4RPyTorch(model)
    schema = op.compute_output_schema(None, None)
    assert schema.column_names == ["item_ids", "item_id_scores"]
    # Adopted from T4R, answered as T4R does: int64, as model(batch) and its output_schema.
    # (Review finding 5; before: int32, but int64 when model.output_schema was passed.)
    assert schema["item_ids"].dtype.to_numpy == np.int64
    assert model.output_schema["item_ids"].dtype.to_numpy == np.int64
    assert [d.max for d in schema["item_ids"].shape.dims] == [None, 5]
    df = factories.random_sessions(9, np.random.default_rng(1))
    out = _served(op, df)
    ids, scores = factories.reference_top_k(factories.eager_scores(op.model, df), 5)
    np.testing.assert_array_equal(out["item_ids"], ids)
    np.testing.assert_allclose(out["item_id_scores"], scores, rtol=RTOL, atol=ATOL)
    # The caller's model keeps T4R's behaviour: model(batch) is still its own top-k.
    assert model.top_k == 5
    with torch.inference_mode():
        t4r_answer = model(factories.reference_inputs(df))
    assert isinstance(t4r_answer, tuple)
    assert out["item_ids"].dtype == t4r_answer[1].numpy().dtype == np.int64


def test_operator_top_k_answers_int32_ids(model):
    """The operator's own top_k keeps the compact dtype; model.top_k does not change it."""
    for model_top_k in (None, 5):
        model.top_k = model_top_k
        op = PredictT4RPyTorch(model, top_k=3)
        assert op.compute_output_schema(None, None)["item_ids"].dtype.to_numpy == np.int32
        out = _served(op, factories.random_sessions(2, np.random.default_rng(7)))
        assert out["item_ids"].dtype == np.int32


def test_operator_top_k_takes_precedence_over_the_models(model):
    """Before: "top_k applies to next-item prediction only"."""
    model.top_k = 5
    op = PredictT4RPyTorch(model, top_k=3)
    out = _served(op, factories.random_sessions(4, np.random.default_rng(2)))
    assert out["item_ids"].shape == out["item_id_scores"].shape == (4, 3)


def test_t4r_top_k_output_schema_is_recognised(model):
    """T4R's schema (item_id_scores, item_ids as wide as the catalogue) declares top_k columns."""
    model.top_k = 4
    op = PredictT4RPyTorch(model, model.input_schema, model.output_schema)
    schema = op.compute_output_schema(None, None)
    assert [d.max for d in schema["item_ids"].shape.dims] == [None, 4]
    assert schema["item_ids"].dtype.to_numpy == np.int64  # T4R declares the item column's
    out = _served(op, factories.random_sessions(3, np.random.default_rng(3)))
    assert out["item_ids"].dtype == np.int64 and out["item_ids"].shape == (3, 4)


# -- issue 10 defect 3: top_k larger than the catalogue ----------------------------------------
@pytest.mark.parametrize("top_k", [500, factories.ITEMS])
def test_top_k_larger_than_the_catalogue_is_refused(model, top_k):
    """Before: top_k=500 was accepted, declared [-1, 500] and answered (rows, 100)."""
    with pytest.raises(T4ROpsError, match=rf"top_k={top_k} is more than the model can "
                                          rf"recommend: it scores 100 item ids, and 1 of them "
                                          rf"are reserved \[0\], which leaves 99"):
        PredictT4RPyTorch(model, top_k=top_k)


def test_top_k_up_to_the_unreserved_catalogue_is_accepted(model):
    op = PredictT4RPyTorch(model, top_k=factories.ITEMS - 1)
    out = _served(op, factories.random_sessions(2, np.random.default_rng(4)))
    assert out["item_ids"].shape == (2, factories.ITEMS - 1)
    assert 0 not in out["item_ids"]


# -- review of issue 10, finding 7: one check of integer knobs ---------------------------------
@pytest.mark.parametrize("top_k", [True, 0, 2.0, "3"])
def test_top_k_that_is_not_a_count_is_refused(model, top_k):
    """Before: top_k=True was taken as 1."""
    with pytest.raises(T4ROpsError, match=rf"top_k must be a positive int or None, "
                                          rf"got {re.escape(repr(top_k))}"):
        PredictT4RPyTorch(model, top_k=top_k)


def test_numpy_integers_are_counts(model):
    """Before: np.int64(5), as a config or a DataFrame gives it, was refused."""
    op = PredictT4RPyTorch(model, top_k=np.int64(5), max_sequence_length=np.int32(factories.SEQ_LEN),
                           cuda_graph_buckets=[np.int64(8), 1])
    assert (type(op.top_k), op.top_k, op.max_sequence_length) == (int, 5, factories.SEQ_LEN)
    assert op.cuda_graph_buckets == (1, 8) and type(op.cuda_graph_buckets[1]) is int
    out = _served(op, factories.random_sessions(2, np.random.default_rng(6)))
    assert out["item_ids"].shape == (2, 5)


# -- issue 11: reserved ids, read from the schema ----------------------------------------------
def test_a_column_not_made_by_categorify_reserves_only_padding(model):
    assert reserved_item_ids(model.input_schema[ITEMS], padding_id=0) == (0,)
    assert PredictT4RPyTorch(model, top_k=3).reserved_item_ids == (0,)


@pytest.mark.parametrize("categorify", [{}, {"num_buckets": 4, "freq_threshold": 2}])
def test_reserved_ids_follow_categorify(tmp_path, categorify):
    """Whatever Categorify's own metadata table says comes before the first real item."""
    import nvtabular as nvt
    from merlin.io import Dataset

    # Event rows (one item per row): NVTabular 23.08 cannot hash list columns on the CPU.
    rng = np.random.default_rng(5)
    raw = pd.DataFrame({"item_id": rng.integers(0, 300, size=2000) * 7919 + 100_000})
    items = (["item_id"] >> nvt.ops.Categorify(out_path=str(tmp_path), **categorify)
             >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.ITEM, Tags.CATEGORICAL]))
    workflow = nvt.Workflow(items)
    workflow.fit(Dataset(raw))
    column = workflow.output_schema["item_id"]

    meta = pd.read_parquet(Path(column.properties["cat_path"]).parent / "meta.item_id.parquet")
    first_item = int(meta.set_index("kind").loc["unique", "offset"])
    assert reserved_item_ids(column, padding_id=0) == tuple(range(first_item))


@pytest.fixture
def categorify_model(session_workflow):
    workflow, model, _ = session_workflow
    return model


def test_operator_reads_categorifys_reserved_ids(categorify_model):
    assert PredictT4RPyTorch(categorify_model, top_k=3).reserved_item_ids == (0, 1, 2)
    with pytest.raises(T4ROpsError, match=r"scores 400 item ids, and 3 of them are reserved "
                                          r"\[0, 1, 2\], which leaves 397"):
        PredictT4RPyTorch(categorify_model, top_k=398)


def test_reserved_ids_never_reach_a_top_k(model):
    k = 60
    df = factories.random_sessions(40, np.random.default_rng(6))
    scores = factories.eager_scores(model, df)
    unmasked = torch.topk(torch.from_numpy(scores), k).indices.numpy()
    assert (unmasked == 0).any(), "precondition: the padding id scores inside a plain top-k"
    out = _served(PredictT4RPyTorch(model, top_k=k), df)
    ids, values = factories.reference_top_k(scores, k)
    assert not (out["item_ids"] == 0).any()
    np.testing.assert_array_equal(out["item_ids"], ids)
    np.testing.assert_allclose(out["item_id_scores"], values, rtol=RTOL, atol=ATOL)


# -- issue 11: exclude_seen -------------------------------------------------------------------
def test_exclude_seen_removes_items_that_cropping_drops(model):
    k = 10
    df, hidden = _sessions_hiding_top_items(model, 12, seed=7, k=k)
    assert (df[ITEMS].map(len) > factories.SEQ_LEN).all()
    scores = factories.eager_scores(model, df)  # the model at its own width: recent items
    seen = PredictT4RPyTorch(model, top_k=k, exclude_seen=True)
    out = _served(seen, df)
    ids, values = factories.reference_top_k(scores, k, sessions=df[ITEMS])
    np.testing.assert_array_equal(out["item_ids"], ids)
    np.testing.assert_allclose(out["item_id_scores"], values, rtol=RTOL, atol=ATOL)
    for row, older in enumerate(hidden):
        assert not set(older) & set(out["item_ids"][row])
        assert not set(df[ITEMS][row]) & set(out["item_ids"][row])
    # Excluding only what the model sees would recommend the dropped items first.
    cropped = df[ITEMS].map(lambda s: s[-factories.SEQ_LEN:])
    crop_only, _ = factories.reference_top_k(scores, k, sessions=cropped)
    np.testing.assert_array_equal(crop_only[:, :3], hidden)


def test_exclude_seen_on_fixed_width_requests(model):
    k = 10
    df, _ = _sessions_hiding_top_items(model, 5, seed=8, k=k)
    width = int(df[ITEMS].map(len).max())
    padded = {name: np.stack([np.pad(s, (0, width - len(s))) for s in df[name]])
              for name in df.columns}
    out = PredictT4RPyTorch(model, top_k=k, exclude_seen=True).predict(TensorTable(padded))
    ids, _ = factories.reference_top_k(factories.eager_scores(model, df), k, sessions=df[ITEMS])
    np.testing.assert_array_equal(out["item_ids"], ids)


def test_a_row_with_fewer_items_left_than_top_k_is_filled(model):
    """99 ids are recommendable; a session of 5 distinct items leaves 94 for a top-99."""
    df = factories.random_sessions(1, np.random.default_rng(9), min_len=5, max_len=5)
    df.at[0, ITEMS] = np.array([11, 12, 13, 14, 15], dtype=np.int64)
    out = _served(PredictT4RPyTorch(model, top_k=99, exclude_seen=True), df)
    ids, scores = out["item_ids"][0], out["item_id_scores"][0]
    assert ids.shape == (99,)
    np.testing.assert_array_equal(ids[94:], [FILLER_ID] * 5)
    assert np.isneginf(scores[94:]).all() and np.isfinite(scores[:94]).all()
    assert sorted(ids[:94]) == sorted(set(range(1, 100)) - {11, 12, 13, 14, 15})


def test_exclude_seen_needs_top_k(model):
    with pytest.raises(T4ROpsError, match=r"exclude_seen=True needs top_k"):
        PredictT4RPyTorch(model, exclude_seen=True)


def test_local_runtime_masks_categorify_reserved_and_seen_ids(session_workflow):
    """Raw sessions through the workflow and the operator, in Merlin's local runtime."""
    from merlin.io import Dataset
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    workflow, model, raw = session_workflow
    k = 120
    df = raw.head(30).reset_index(drop=True)
    op = PredictT4RPyTorch(model, top_k=k, exclude_seen=True)
    ensemble = Ensemble(workflow.input_schema.column_names >> TransformWorkflow(workflow) >> op,
                        workflow.input_schema)
    out = ensemble.transform(df)

    encoded = workflow.transform(Dataset(df)).to_ddf().compute().reset_index(drop=True)
    assert (encoded[ITEMS].map(len) > factories.SEQ_LEN).any()
    scores = factories.eager_scores(model, encoded)
    unmasked = torch.topk(torch.from_numpy(scores), k).indices.numpy()
    assert np.isin(unmasked, [0, 1, 2]).any(), "precondition: reserved ids score in a top-k"
    ids, values = factories.reference_top_k(scores, k, (0, 1, 2), encoded[ITEMS])
    np.testing.assert_array_equal(np.stack(out["item_ids"]), ids)
    np.testing.assert_allclose(np.stack(out["item_id_scores"]), values, rtol=RTOL, atol=ATOL)


# -- issue 11, cost: the seen items inside a CUDA graph ----------------------------------------
def _replay_on_the_cpu(op, bucket):
    """What a CUDA-graph replay of ``op._captured_top_k`` returns, computed on the CPU: the
    request padded with empty rows to ``bucket``, run, and cut back to its own rows."""
    from merlin_t4r_ops.ops.cuda_graphs import cut_rows, pad_rows

    def replay(inputs, outputs):
        rows = len(next(iter(inputs.values())))
        out = op._captured_top_k({k: pad_rows(v, bucket) for k, v in inputs.items()})
        return cut_rows({name: out[name] for name in outputs}, rows)
    return replay


@pytest.mark.parametrize("longer", [False, True], ids=["short", "longer-than-the-graph-holds"])
@pytest.mark.parametrize("form", ["ragged", "fixed"])
def test_captured_exclusion_of_seen_items_equals_the_reference(model, longer, form):
    """The graph masks each session's recent items itself; older ones are masked after it.

    Sessions longer than the graph's seen matrix (``SEEN_IN_GRAPH`` items) need both
    halves; the answer is the slow reference over the whole session either way.
    """
    k, rows, rng = 10, 6, np.random.default_rng(int(longer))
    df = (factories.sessions_some_longer_than(rows, rng, SEEN_IN_GRAPH) if longer
          else factories.random_sessions(rows, rng))
    width = int(df[ITEMS].map(len).max())
    table = TensorTable.from_df(df) if form == "ragged" else TensorTable(
        {name: np.stack([np.pad(s, (0, width - len(s))) for s in df[name]])
         for name in df.columns})
    op = PredictT4RPyTorch(model, top_k=k, exclude_seen=True)
    inputs = to_model_inputs(table, op._specs, op.max_sequence_length, torch.device("cpu"))
    with torch.inference_mode():  # as predict runs it
        got = op._replay_excluding_seen(_replay_on_the_cpu(op, bucket=8), inputs, table)
    ids, values = factories.reference_top_k(factories.eager_scores(model, df), k,
                                            sessions=df[ITEMS])
    np.testing.assert_array_equal(got["item_ids"].numpy(), ids)
    np.testing.assert_allclose(got["item_id_scores"].numpy(), values, rtol=RTOL, atol=ATOL)
    assert set(got) == {"item_ids", "item_id_scores"}


def test_seen_matrix_keeps_the_recent_items_and_lists_the_older_ones():
    from merlin_t4r_ops.ops.masking import seen_matrix

    table = TensorTable({"items__values": np.array([5, 6, 7, 8, 9, 10, 11]),
                         "items__offsets": np.array([0, 3, 4, 7])})
    recent, older = seen_matrix(table, "items", width=2, filler=1)
    np.testing.assert_array_equal(recent, [[6, 7], [8, 1], [10, 11]])
    np.testing.assert_array_equal(older[0], [0, 2])  # rows
    np.testing.assert_array_equal(older[1], [5, 9])  # their ids
    assert seen_matrix(table, "items", width=3, filler=1)[1] is None  # every session fits
