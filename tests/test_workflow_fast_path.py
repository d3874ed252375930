"""The workflow fast path (``merlin_t4r_ops.workflow``) against NVTabular's own transform.

Random sessions with unknown ids, nulls, empty and long lists, int and string ids go through
a fitted workflow twice, ``workflow.transform`` and the compiled graph, and must come out
identical: values, offsets, dtypes and the output schema. A workflow with an op the fast path
does not know falls back to NVTabular with a warning; a ``Filter`` is refused. Served top-k
through the fast path equals the NVTabular-path export on the shared tritonserver.
"""

import numpy as np
import pandas as pd
import pytest
from merlin.schema import Tags
from merlin.table import TensorTable

import tutorial_factories as etl
from conftest import FAST_DECODED
from merlin_t4r_ops.errors import UnservableWorkflowError, WorkflowFallbackWarning

SESSIONS = 10_000


def _sessions(n, rng, string_ids, vocabulary=300):
    """Sessions of 0 to 60 items (empty and long), ids in a range the fit saw part of."""
    lengths = rng.integers(0, 61, size=n)
    lengths[rng.random(n) < 0.05] = 0

    def ids(length):
        raw = rng.integers(0, vocabulary, size=length) * 7919 + 100_000
        return np.array([f"sku-{i}" for i in raw], dtype=object) if string_ids else raw

    shops = np.array([f"shop-{i}" for i in rng.integers(0, 40, size=n)], dtype=object)
    shops[rng.random(n) < 0.1] = None  # null scalars: Categorify's null id
    return pd.DataFrame({
        "item_id-list": [ids(length) for length in lengths],
        "price-list": [rng.random(length).astype(np.float32) for length in lengths],
        "shop": shops,
        "region": rng.integers(0, 30, size=n).astype(np.int32),
        "age": rng.uniform(10.0, 80.0, size=n).astype(np.float32),
    })


def _fit(directory, rng, string_ids, **categorify):
    """Categorify of list and scalar ids, ListSlice, Rename, AddTags/TagAs*, ValueCount,
    LogOp and Normalize on a continuous list and a scalar."""
    import nvtabular as nvt
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    cat = dict(out_path=str(directory), **categorify)
    items = (["item_id-list"] >> nvt.ops.ListSlice(-20) >> nvt.ops.Categorify(**cat)
             >> nvt.ops.TagAsItemID() >> nvt.ops.AddTags([Tags.CATEGORICAL, Tags.LIST])
             >> nvt.ops.ValueCount())
    logged = ["price-list"] >> nvt.ops.ListSlice(1, 11) >> nvt.ops.LogOp()
    # One parent, two children: the normalized prices and the log prices under a new name.
    prices = logged >> nvt.ops.Normalize() >> nvt.ops.AddMetadata(tags=[Tags.LIST])
    prices = prices + (logged >> nvt.ops.Rename(postfix="_log"))
    age = ["age"] >> nvt.ops.Normalize() >> nvt.ops.Rename(postfix="_norm")
    shop = ["shop"] >> nvt.ops.Categorify(**cat) >> nvt.ops.Rename(name="shop_id")
    region = ["region"] >> nvt.ops.Categorify(**cat) >> nvt.ops.Rename(postfix="_code")
    workflow = nvt.Workflow(items + prices + shop + region + age)
    with cpu_datasets_quiet():
        # Fit on part of the ids, so that requests carry unknown ones.
        workflow.fit(Dataset(_sessions(500, rng, string_ids, vocabulary=150), npartitions=1))
    return workflow


def _nvtabular(workflow, df):
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    with cpu_datasets_quiet():
        out = workflow.transform(Dataset(df, npartitions=1)).to_ddf().compute()
    return TensorTable.from_df(out.reset_index(drop=True))


def _fast(workflow, df):
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops.workflow import compile_workflow

    compiled = compile_workflow(TransformWorkflow(workflow))
    assert compiled is not None
    assert compiled.output_schema == workflow.output_schema  # Categorify's properties too
    return compiled.transform(None, TensorTable.from_df(df))


def _assert_identical(got, expected):
    assert list(got.columns) == list(expected.columns)
    for name in expected.columns:
        np.testing.assert_array_equal(got[name].values, expected[name].values, err_msg=name)
        assert got[name].values.dtype == expected[name].values.dtype, name
        if expected[name].offsets is None:
            assert got[name].offsets is None, name
        else:
            np.testing.assert_array_equal(got[name].offsets, expected[name].offsets,
                                          err_msg=name)


@pytest.mark.parametrize("string_ids", [False, True], ids=["int-ids", "string-ids"])
@pytest.mark.parametrize("categorify", [{}, {"freq_threshold": 3}, {"max_size": 60}],
                         ids=["plain", "freq_threshold", "max_size"])
def test_the_fast_path_equals_nvtabular_on_random_sessions(tmp_path, string_ids, categorify):
    rng = np.random.default_rng(19)
    workflow = _fit(tmp_path, rng, string_ids, **categorify)
    df = _sessions(SESSIONS, rng, string_ids)
    expected = _nvtabular(workflow, df)
    # The data does reach the rules under test: unknown ids, null shops, empty lists.
    assert (expected["item_id-list"].values == 2).any()
    assert (expected["shop_id"].values == 1).any()
    assert (np.diff(expected["item_id-list"].offsets) == 0).any()
    _assert_identical(_fast(workflow, df), expected)


def test_a_workflow_with_an_unknown_op_falls_back_whole_and_says_so(tmp_path):
    import nvtabular as nvt
    from merlin.io import Dataset
    from merlin.systems.dag.ops.workflow import TransformWorkflow
    from merlin.systems.dag.runtimes.triton.ops.workflow import TransformWorkflowTriton

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from merlin_t4r_ops.workflow import serve_workflow, unknown_ops

    df = pd.DataFrame({"item": [3, 5, 5, 9], "price": [1.0, 2.0, 3.0, 4.0]})
    workflow = nvt.Workflow((["item"] >> nvt.ops.Categorify(out_path=str(tmp_path)))
                            + (["price"] >> nvt.ops.Clip(min_value=2.0)))
    with cpu_datasets_quiet():
        workflow.fit(Dataset(df, npartitions=1))
    assert unknown_ops(workflow) == ["Clip"]
    with pytest.warns(WorkflowFallbackWarning, match=r"workflow ops without a fast path \(Clip\): "
                                                     r"the whole workflow is served by NVTabular"):
        served = serve_workflow(TransformWorkflow(workflow))
    assert type(served) is TransformWorkflowTriton


def test_a_row_filter_is_refused_with_how_to_serve_without_it(tmp_path):
    import nvtabular as nvt
    from merlin.io import Dataset
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from merlin_t4r_ops.workflow import serve_workflow

    df = pd.DataFrame({"item": [3, 5, 5, 9]})
    workflow = nvt.Workflow(["item"] >> nvt.ops.Filter(lambda frame: frame["item"] > 3)
                            >> nvt.ops.Categorify(out_path=str(tmp_path)))
    with cpu_datasets_quiet():
        workflow.fit(Dataset(df, npartitions=1))
    with pytest.raises(UnservableWorkflowError, match=r"holds a Filter, which drops rows.*serve "
                                                      r"a workflow without it: TransformWorkflow"
                                                      r"\(merlin_t4r_ops.workflow.without_filters"):
        serve_workflow(TransformWorkflow(workflow))


def _tutorial_with_filter(directory, rng):
    """T4R's tutorial ETL with its Filter on the session length (3 events at least)."""
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    workflow = etl.tutorial_workflow(directory, minimum_length=3, with_count=True)
    with cpu_datasets_quiet():
        workflow.fit(Dataset(etl.events(rng, 100, etl.item_catalogue(40)), npartitions=1))
    return workflow


@pytest.mark.parametrize("compile_workflows", [True, False], ids=["fast-path", "nvtabular"])
def test_the_export_refuses_the_tutorials_filter(compile_workflows, tmp_path):
    """NVTabular would drop the short sessions' rows silently, so neither path serves it."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops.runtime import TritonRuntime

    workflow = _tutorial_with_filter(tmp_path, np.random.default_rng(5))
    ensemble = Ensemble(workflow.input_schema.column_names >> TransformWorkflow(workflow),
                        workflow.input_schema)
    runtime = TritonRuntime(compile_workflows=compile_workflows)
    with pytest.raises(UnservableWorkflowError, match=r"holds a Filter.*without_filters"):
        ensemble.export(str(tmp_path / "repository"), runtime=runtime)
    assert not (tmp_path / "repository").exists()


def test_without_filters_serves_every_session_on_the_fast_path(tmp_path):
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops.runtime import TritonRuntime
    from merlin_t4r_ops.workflow import unknown_ops, without_filters

    rng = np.random.default_rng(5)
    workflow = _tutorial_with_filter(tmp_path, rng)
    served = without_filters(workflow)
    assert unknown_ops(served) == []
    with pytest.raises(UnservableWorkflowError):  # the user's workflow still filters
        unknown_ops(workflow)
    events = etl.events(rng, 300, etl.item_catalogue(60), max_len=8)
    every = _nvtabular(served, events)
    _assert_identical(_fast(served, events), every)
    sessions = every[etl.SESSION].values
    assert sorted(sessions) == sorted(events[etl.SESSION].unique())
    # The sessions the Filter keeps come out as the filtering workflow gives them.
    filtered = _nvtabular(workflow, events)
    kept = np.isin(sessions, filtered[etl.SESSION].values)
    assert 0 < kept.sum() < len(sessions)
    np.testing.assert_array_equal(every["item_id-count"].values[kept],
                                  filtered["item_id-count"].values)
    repository = tmp_path / "repository"
    Ensemble(served.input_schema.column_names >> TransformWorkflow(served),
             served.input_schema).export(str(repository), runtime=TritonRuntime())
    assert not (repository / "0_transformworkflowtriton").exists()  # inside the executor


def test_the_fast_path_export_runs_the_workflow_inside_the_executor(model_repository):
    assert (model_repository / FAST_DECODED).is_dir()
    # The NVTabular-path ensembles' workflow model; the fast path adds none of its own.
    workflow_models = [p.name for p in model_repository.iterdir()
                       if p.name.endswith("transformworkflowtriton")]
    assert workflow_models == ["0_transformworkflowtriton"]


def test_served_top_k_through_the_fast_path_equals_the_nvtabular_path(client, session_workflow):
    from merlin_t4r_ops.serving.client import infer_dataframe

    workflow, _, raw = session_workflow
    rng = np.random.default_rng(3)
    df = raw.sample(40, random_state=4).reset_index(drop=True)
    # Unknown raw ids in some sessions: the workflow gives them the out-of-vocabulary id.
    df["item_id-list"] = [np.where(rng.random(len(ids)) < 0.2, 13, ids)
                          for ids in df["item_id-list"]]
    nvtabular = infer_dataframe(client, df, model_name="session_decoded")
    fast = infer_dataframe(client, df, model_name=FAST_DECODED)
    assert set(fast) == set(nvtabular)
    for name in nvtabular:
        np.testing.assert_array_equal(np.stack(fast[name]), np.stack(nvtabular[name]), name)


def test_nulls_inside_lists_get_nvtabulars_own_answer(tmp_path):
    """NVTabular gives a null inside a list the out-of-vocabulary id, not the null id of a
    null scalar; the fast path hands such a column to the fitted op, and agrees."""
    import nvtabular as nvt
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    fit = pd.DataFrame({"tags": [np.array(["a", "b"], dtype=object),
                                 np.array(["b", "c"], dtype=object)]})
    workflow = nvt.Workflow(["tags"] >> nvt.ops.Categorify(out_path=str(tmp_path)))
    with cpu_datasets_quiet():
        workflow.fit(Dataset(fit, npartitions=1))
    df = pd.DataFrame({"tags": [np.array(["c", None, "a"], dtype=object),
                                np.array(["z"], dtype=object),
                                np.array([None, "b"], dtype=object)]})
    _assert_identical(_fast(workflow, df), _nvtabular(workflow, df))


@pytest.mark.parametrize("compile_workflows", [True, False])
def test_the_runtime_compiles_a_workflow_unless_told_not_to(tmp_path, compile_workflows):
    import nvtabular as nvt
    from merlin.io import Dataset
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from merlin_t4r_ops.runtime import TritonRuntime

    workflow = nvt.Workflow(["item"] >> nvt.ops.Categorify(out_path=str(tmp_path / "cats")))
    with cpu_datasets_quiet():
        workflow.fit(Dataset(pd.DataFrame({"item": [3, 5, 5, 9]}), npartitions=1))
    ensemble = Ensemble(["item"] >> TransformWorkflow(workflow), workflow.input_schema)
    repository = tmp_path / "repository"
    ensemble.export(str(repository), runtime=TritonRuntime(compile_workflows=compile_workflows))
    assert (repository / "0_transformworkflowtriton").exists() is not compile_workflows
    assert (repository / "executor_model").is_dir()


def _string_categorify(tmp_path, vocabulary):
    """A ``Categorify`` of scalar string ids fitted on ``vocabulary``, and its array twin."""
    import nvtabular as nvt
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from merlin_t4r_ops.workflow.arrays import CategorifyArrays

    op = nvt.ops.Categorify(out_path=str(tmp_path))
    workflow = nvt.Workflow(["item"] >> op)
    with cpu_datasets_quiet():
        workflow.fit(Dataset(pd.DataFrame({"item": vocabulary}), npartitions=1))
    return workflow, CategorifyArrays(op, ["item"], {"item": np.int64})


def test_many_string_ids_are_hashed_and_get_nvtabulars_ids(tmp_path, monkeypatch):
    """From 512 ids a column of str is looked up in a hash index of the vocabulary: the ids
    are NVTabular's, nulls and unknown ids included, and those the sorted lookup gives."""
    from merlin_t4r_ops.workflow import arrays

    hashed, real = [], arrays._hashed  # the lengths of the columns that were hashed
    monkeypatch.setattr(arrays, "_hashed", lambda *a: hashed.append(len(a[0])) or real(*a))
    rng = np.random.default_rng(7)
    workflow, twin = _string_categorify(
        tmp_path, np.array([f"sku-{i}" for i in range(0, 6000, 3)], dtype=object))
    items = np.array([f"sku-{i}" for i in rng.integers(0, 6000, 700)], dtype=object)
    items[::10] = None  # null scalars: the null id; two in three of the rest unknown
    df = pd.DataFrame({"item": items})
    got = twin.column("item", TensorTable.from_df(df)["item"])
    _assert_identical(TensorTable({"item": got}), _nvtabular(workflow, df))
    assert hashed == [630]

    sorted_values, ids = twin.vocabularies["item"]
    index = twin.string_indexes["item"]
    plain = items[1::10]
    nul = plain.copy()
    nul[::3] = [f"{v}\x00" for v in nul[::3]]  # fixed-width text drops trailing NULs
    mixed = plain.copy()
    mixed[::7] = 3  # an int among strings: cast to text, not hashed
    for values in (plain.repeat(8), nul.repeat(8), mixed.repeat(8),
                   plain.repeat(8).astype(str)):
        np.testing.assert_array_equal(twin._lookup(values, sorted_values, ids, index),
                                      arrays._bisect(values.astype(str), sorted_values, ids))
    assert hashed == [630, 560, 560]


def test_an_exported_string_vocabulary_carries_no_index_and_gets_one_when_loaded(tmp_path):
    import pickle

    _, twin = _string_categorify(tmp_path, np.array(["b", "a", "c"], dtype=object))
    assert "string_indexes" not in twin.__getstate__()
    loaded = pickle.loads(pickle.dumps(twin))
    assert list(loaded.string_indexes["item"]) == ["a", "b", "c"]
    values = np.array(["c", "z", "a"] * 200, dtype=object)  # 600 ids: hashed
    sorted_values, ids = loaded.vocabularies["item"]
    np.testing.assert_array_equal(
        loaded._lookup(values, sorted_values, ids, loaded.string_indexes["item"]),
        twin._lookup(values, *twin.vocabularies["item"]))
