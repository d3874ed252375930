"""``Groupby`` of event rows into sessions on the workflow fast path, against NVTabular.

Event rows (one per click, shuffled, with items the fit never saw, ties in the sort column,
null session ids and null timestamps) go through a fitted workflow twice,
``workflow.transform`` and the compiled graph, and must come out identical: the sessions'
order, the order of each list, ``count``/``first``/``last``, dtypes and offsets. T4R's
getting-started ETL (``tutorial_factories``) compiles whole, and agrees on 10,000 sessions.
"""

import numpy as np
import pandas as pd
import pytest

import tutorial_factories as etl
from test_workflow_fast_path import _assert_identical, _fast, _nvtabular


def _events(rng, sessions, vocabulary, string_ids=False, string_sessions=False):
    """Shuffled event rows of ``sessions`` sessions of 1 to 30 clicks (1% of 100 to 300).

    Raw item ids range over ``vocabulary`` values; timestamps repeat within a session.
    """
    lengths = rng.integers(1, 31, size=sessions)
    long = rng.random(sessions) < 0.01
    lengths[long] = rng.integers(100, 301, size=long.sum())
    session = np.repeat(rng.permutation(sessions) * 13 + 5, lengths)
    rows = len(session)
    items = rng.integers(0, vocabulary, size=rows) * 7919 + 100_003
    frame = pd.DataFrame({
        etl.SESSION: session,
        "user": (session % 7).astype(np.int32),
        "item_id": np.array([f"sku-{i}" for i in items], dtype=object) if string_ids else items,
        "category": (items % 11 + 500).astype(np.int32),
        "price": rng.random(rows).astype(np.float32),
        "timestamp": rng.integers(0, 40, size=rows) * 60 + 1_700_000_000,
    })
    frame["seen_at"] = frame["timestamp"].astype(np.float64)  # a float sort column
    if string_sessions:
        frame[etl.SESSION] = np.array([f"s{i}" for i in session], dtype=object)
    return frame.sample(frac=1.0, random_state=int(rng.integers(1 << 31))).reset_index(drop=True)


def _fitted(workflow, rng, **events):
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    with cpu_datasets_quiet():
        # Fit on half the ids, so that requests carry unknown ones.
        workflow.fit(Dataset(_events(rng, 300, vocabulary=200, **events), npartitions=1))
    return workflow


def test_the_tutorial_etl_compiles_whole_and_equals_nvtabular_on_10000_sessions(tmp_path):
    from merlin_t4r_ops.workflow import unknown_ops

    rng = np.random.default_rng(19)
    workflow = _fitted(etl.tutorial_workflow(tmp_path, with_count=True), rng)
    assert unknown_ops(workflow) == []
    events = _events(rng, 10_000, vocabulary=400)
    expected = _nvtabular(workflow, events)
    assert len(expected[etl.SESSION].values) == 10_000
    assert (expected[etl.ITEM].values == 2).any()  # unknown items: the OOV id
    assert (np.diff(expected[etl.ITEM].offsets) == etl.MAX_LEN).any()  # long ones cut
    _assert_identical(_fast(workflow, events), expected)


def _groupby_workflow(out_path, keys, sort_cols, ascending):
    """Categorify of events, Groupby with every aggregation the fast path knows, ListSlice
    and Rename of the lists (some sessions left empty by ``ListSlice(2, 5)``)."""
    import nvtabular as nvt

    categorified = ["item_id", "category"] >> nvt.ops.Categorify(out_path=str(out_path))
    inputs = list(dict.fromkeys([*keys, *sort_cols, "timestamp", "price"]))
    grouped = (inputs + categorified) >> nvt.ops.Groupby(
        groupby_cols=keys, sort_cols=sort_cols, ascending=ascending, name_sep="-",
        aggs={"item_id": ["list", "count", "first", "last"], "category": ["list", "last"],
              "price": ["list", "first"], "timestamp": ["first", "last", "count"]})
    items = grouped["item_id-list"] >> nvt.ops.ListSlice(-20) >> nvt.ops.Rename(postfix="_seq")
    middle = grouped["category-list"] >> nvt.ops.ListSlice(2, 5) >> nvt.ops.Rename(postfix="_mid")
    return nvt.Workflow(grouped + items + middle)


@pytest.mark.parametrize("ascending", [True, False], ids=["ascending", "descending"])
@pytest.mark.parametrize("keys, sort_cols, events", [
    ([etl.SESSION], ["timestamp"], {}),
    ([etl.SESSION], ["timestamp", "price"], {"string_ids": True}),
    ([etl.SESSION, "user"], [], {}),
    ([etl.SESSION], ["timestamp"], {"string_sessions": True, "string_ids": True}),
], ids=["int-sessions", "two-sort-cols-string-ids", "two-keys-unsorted", "string-sessions"])
def test_groupby_equals_nvtabular_on_random_events(tmp_path, keys, sort_cols, events,
                                                   ascending):
    rng = np.random.default_rng(7)
    workflow = _fitted(_groupby_workflow(tmp_path, keys, sort_cols, ascending), rng, **events)
    request = _events(rng, 1_500, vocabulary=400, **events)
    if events.get("string_sessions"):  # null session ids: pandas drops their rows
        request.loc[rng.random(len(request)) < 0.02, etl.SESSION] = None
    expected = _nvtabular(workflow, request)
    assert (np.diff(expected["category-list_mid"].offsets) == 0).any()  # empty lists
    _assert_identical(_fast(workflow, request), expected)


@pytest.mark.parametrize("ascending", [True, False], ids=["ascending", "descending"])
def test_null_sort_values_sort_last_and_null_values_stay_exact(tmp_path, ascending):
    rng = np.random.default_rng(11)
    events = _events(rng, 500, vocabulary=400)
    events.loc[rng.random(len(events)) < 0.05, "seen_at"] = np.nan
    workflow = _fitted(_groupby_workflow(tmp_path, [etl.SESSION], ["seen_at"], ascending), rng)
    _assert_identical(_fast(workflow, events), _nvtabular(workflow, events))
    # Nulls in an aggregated column: NVTabular's lists and counts of them, through the op.
    events["price"] = events["price"].where(rng.random(len(events)) > 0.05)
    _assert_identical(_fast(workflow, events), _nvtabular(workflow, events))


def test_a_groupby_with_another_aggregation_falls_back_whole(tmp_path):
    import nvtabular as nvt
    from merlin.systems.dag.ops.workflow import TransformWorkflow
    from merlin.systems.dag.runtimes.triton.ops.workflow import TransformWorkflowTriton

    from merlin_t4r_ops.errors import WorkflowFallbackWarning
    from merlin_t4r_ops.workflow import serve_workflow

    workflow = _fitted(nvt.Workflow(
        [etl.SESSION, "price"] >> nvt.ops.Groupby(groupby_cols=[etl.SESSION],
                                                  aggs={"price": ["list", "mean"]})),
        np.random.default_rng(3))
    with pytest.warns(WorkflowFallbackWarning, match=r"without a fast path \(Groupby\)"):
        served = serve_workflow(TransformWorkflow(workflow))
    assert type(served) is TransformWorkflowTriton
