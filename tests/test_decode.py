"""DecodeItemIds: the top-k in the shop's own item ids, on Triton and in the local runtime.

Every reference is built the slow, obvious way: the workflow's transform in process, the eager
model at its own width, reserved and seen items masked to minus infinity, ``torch.topk``,
and the unique-values table of Categorify read with pandas.
"""

import pickle

import numpy as np
import pandas as pd
import pytest
import torch

import t4r_factories as factories
from conftest import MASKED_TOP_K, TOP_K
from merlin_t4r_ops import DecodeItemIds
from merlin_t4r_ops.errors import ArtifactError, SchemaMismatchError, T4ROpsError
from merlin_t4r_ops.serving.client import arrays_to_inputs, infer_dataframe

ITEM = "item_id-list"
RTOL, ATOL = 1e-5, 1e-6


# -- references ---------------------------------------------------------------------------
def unique_values(workflow) -> pd.Series:
    """Categorify's table as pandas reads it: index = encoded id, value = raw item id."""
    return pd.read_parquet(workflow.output_schema[ITEM].properties["cat_path"])[ITEM]


def encode(workflow, raw: pd.DataFrame) -> pd.DataFrame:
    from merlin.io import Dataset

    return workflow.transform(Dataset(raw, npartitions=1)).to_ddf().compute()


def reference_top_k(workflow, model, raw: pd.DataFrame, exclude_seen: bool,
                    k: int = MASKED_TOP_K):
    """(raw ids, scores) of each session's top-k, built without any of the package's code:
    every id without a row in the table is reserved, every id of the session is seen."""
    encoded = encode(workflow, raw)
    scores = factories.eager_scores(model, encoded)
    table = unique_values(workflow)
    reserved = np.setdiff1d(np.arange(scores.shape[1]), table.index.to_numpy())
    sessions = encoded[ITEM].to_list() if exclude_seen else None
    ids, top_scores = factories.reference_top_k(scores, k, reserved, sessions)
    raw_ids = np.array([[table[i] for i in row] for row in ids], dtype=table.dtype)
    return raw_ids, top_scores


def stacked(frame: pd.DataFrame, column: str) -> np.ndarray:
    return np.stack([np.asarray(row) for row in frame[column]])


def assert_same_top_k(got: pd.DataFrame, expected, prefix: str = ""):
    ids, scores = expected
    np.testing.assert_array_equal(stacked(got, prefix + "item_ids"), ids)
    np.testing.assert_allclose(stacked(got, prefix + "item_id_scores"), scores,
                               rtol=RTOL, atol=ATOL)


def assert_matches_references(got: pd.DataFrame, workflow, model, raw: pd.DataFrame):
    """``item_ids`` without the session's items, ``all_item_ids`` with them (only reserved
    ids out), both in raw ids: what ``seen_and_plain_ensemble(decode=True)`` serves."""
    assert_same_top_k(got, reference_top_k(workflow, model, raw, exclude_seen=True))
    assert_same_top_k(got, reference_top_k(workflow, model, raw, exclude_seen=False), "all_")


def decoded_ensemble(workflow, model):
    """Raw sessions in; ``item_ids`` with exclude_seen and ``all_item_ids`` without, decoded."""
    return factories.seen_and_plain_ensemble(workflow, model, MASKED_TOP_K, decode=True)


def with_recommendations_in_front(workflow, model, raw: pd.DataFrame) -> pd.DataFrame:
    """Sessions longer than the model's width whose dropped head is what the model would
    recommend from the kept tail alone: only exclude_seen over the whole session removes it."""
    long_enough = raw[raw[ITEM].map(len) >= factories.SEQ_LEN].head(12).reset_index(drop=True)
    tails = long_enough.apply(lambda col: col.map(lambda s: np.asarray(s)[-factories.SEQ_LEN:]))
    heads, _ = reference_top_k(workflow, model, tails, exclude_seen=True)
    longer = tails.copy()
    longer[ITEM] = [np.concatenate([head, tail]) for head, tail in zip(heads, tails[ITEM])]
    for name in tails.columns.drop(ITEM):  # the other lists get as many leading items
        longer[name] = [np.concatenate([np.repeat(tail[:1], len(heads[0])), tail])
                        for tail in tails[name]]
    return longer, heads


@pytest.fixture(params=["int64", "string"])
def any_workflow(request, session_workflow, string_session_workflow):
    return session_workflow if request.param == "int64" else string_session_workflow


# -- the vocabulary ------------------------------------------------------------------------
def test_vocabulary_is_the_unique_values_table(any_workflow):
    workflow, _, _ = any_workflow
    table = unique_values(workflow)
    op = DecodeItemIds(workflow)
    decoded = op.vocabulary.decode(table.index.to_numpy())
    assert decoded.dtype == table.dtype
    np.testing.assert_array_equal(decoded, table.to_numpy())
    assert op.vocabulary.first_id == table.index.min() == 3  # 0 pad, 1 null, 2 OOV


def test_decode_inverts_the_workflows_encoding(any_workflow):
    workflow, _, raw = any_workflow
    codes = np.concatenate(encode(workflow, raw)[ITEM].to_list())
    np.testing.assert_array_equal(DecodeItemIds(workflow).vocabulary.decode(codes),
                                  np.concatenate(raw[ITEM].to_list()))


def test_decode_inverts_categorify_with_large_ids_and_oov_buckets(tmp_path):
    """Raw ids beyond int32, rare items hashed into 4 OOV buckets: the reserved ids are what
    this Categorify reserves (0 to 5), not a constant. (NVTabular 23.08 cannot hash list
    columns on the CPU, hence a scalar item column.)"""
    import nvtabular as nvt
    from merlin.io import Dataset
    from merlin.schema import Tags

    rng = np.random.default_rng(3)
    raw = pd.DataFrame({"item_id": rng.zipf(1.3, size=3000) % 500 * 1_000_003 + 3_000_000_000})
    items = (["item_id"] >> nvt.ops.Categorify(out_path=str(tmp_path), num_buckets=4,
                                               freq_threshold=3)
             >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.CATEGORICAL]))
    workflow = nvt.Workflow(items)
    workflow.fit(Dataset(raw))
    codes = encode(workflow, raw)["item_id"].to_numpy()
    vocabulary = DecodeItemIds(workflow).vocabulary
    assert vocabulary.first_id == 6 and vocabulary.raw_ids.dtype == np.int64
    known = codes >= vocabulary.first_id
    assert known.any() and (~known).any()
    np.testing.assert_array_equal(vocabulary.decode(codes[known]), raw["item_id"][known])
    with pytest.raises(T4ROpsError, match=r"encoded id 5, which has no raw item id.*below 6"):
        vocabulary.decode(np.array([[7, 5]]))


def test_item_ids_without_categorify_are_refused(tmp_path):
    import nvtabular as nvt
    from merlin.io import Dataset
    from merlin.schema import Tags

    raw = factories.raw_sessions(20, np.random.default_rng(0))
    tagged = [ITEM] >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.CATEGORICAL])
    categories = ["category-list"] >> nvt.ops.Categorify(out_path=str(tmp_path))
    workflow = nvt.Workflow(tagged + categories)
    workflow.fit(Dataset(raw))
    with pytest.raises(SchemaMismatchError, match=r"'item_id-list' is not encoded by a Categ"):
        DecodeItemIds(workflow)
    with pytest.raises(SchemaMismatchError, match=r"Tags.ITEM_ID, it tags \[\]"):
        DecodeItemIds(nvt.Workflow(categories))


@pytest.fixture(scope="module")
def filtered_tutorial(tmp_path_factory):
    """T4R's tutorial ETL with its Filter on the session length: (workflow, events)."""
    import tutorial_factories as tutorial
    from merlin.io import Dataset

    rng = np.random.default_rng(11)
    events = tutorial.events(rng, 80, tutorial.item_catalogue(50))
    workflow = tutorial.tutorial_workflow(tmp_path_factory.mktemp("filtered"), minimum_length=3,
                                          with_count=True)
    workflow.fit(Dataset(events))
    return workflow, events


def test_decode_follows_the_item_ids_through_the_tutorial_etl(filtered_tutorial):
    """Categorify on the event rows, then Groupby's list, ListSlice, Rename, TagAsItemID,
    Filter and ValueCount: the vocabulary is Categorify's table of the event-level column."""
    import tutorial_factories as tutorial

    workflow, events = filtered_tutorial
    vocabulary = DecodeItemIds(workflow).vocabulary
    assert vocabulary.column == tutorial.ITEM
    table = pd.read_parquet(workflow.output_schema[tutorial.ITEM].properties["cat_path"])
    np.testing.assert_array_equal(vocabulary.raw_ids, table["item_id"].to_numpy())
    sessions = encode(workflow, events).set_index(tutorial.SESSION)[tutorial.ITEM]
    raw = events.sort_values("timestamp").groupby(tutorial.SESSION)["item_id"].agg(list)
    for session, codes in sessions.items():
        np.testing.assert_array_equal(vocabulary.decode(np.asarray(codes)),
                                      raw[session][-tutorial.MAX_LEN:])


def test_a_count_of_the_item_ids_is_not_decoded(filtered_tutorial):
    """Groupby's ``item_id-count`` carries Categorify's properties, but holds no item ids."""
    workflow, _ = filtered_tutorial
    with pytest.raises(SchemaMismatchError, match=(
            r"'item_id-count' is an aggregation of 'item_id' by Groupby that is not one of "
            r"\['list', 'first', 'last'\]")):
        DecodeItemIds(workflow, column="item_id-count")


def test_an_unfitted_workflow_is_refused(tmp_path):
    import tutorial_factories as tutorial

    with pytest.raises(SchemaMismatchError, match=r"needs a fitted workflow.*call workflow.fit"):
        DecodeItemIds(tutorial.tutorial_workflow(tmp_path))


def test_a_parent_without_item_ids_is_refused(session_workflow):
    from merlin.schema import ColumnSchema, Schema
    from merlin.systems.dag import Ensemble

    workflow, _, _ = session_workflow
    schema = Schema([ColumnSchema("item_id_scores", dtype=np.float32, dims=(None, TOP_K))])
    with pytest.raises(SchemaMismatchError, match=r"needs column 'item_ids'.*\['item_id_scores'"):
        Ensemble(schema.column_names >> DecodeItemIds(workflow), schema)


def test_ids_column_picks_the_top_k_to_decode_and_leaves_the_others(session_workflow):
    """After ``PredictT4RPyTorch(output_prefix="cart_")`` the ids are ``cart_item_ids``."""
    from merlin.schema import ColumnSchema, Schema
    from merlin.systems.dag import Ensemble

    workflow, _, _ = session_workflow
    table = unique_values(workflow)
    schema = Schema([ColumnSchema(name, dtype=np.int32, dims=(None, TOP_K))
                     for name in ("cart_item_ids", "item_ids")])
    ensemble = Ensemble(schema.column_names
                        >> DecodeItemIds(workflow, ids_column="cart_item_ids"), schema)
    codes = table.index.to_numpy()[None, :TOP_K].astype(np.int32)
    out = ensemble.transform(pd.DataFrame({"cart_item_ids": list(codes),
                                           "item_ids": list(codes)}))
    np.testing.assert_array_equal(stacked(out, "cart_item_ids"), table.to_numpy()[None, :TOP_K])
    np.testing.assert_array_equal(stacked(out, "item_ids"), codes)
    assert ensemble.output_schema["cart_item_ids"].dtype.name == "int64"
    assert ensemble.output_schema["item_ids"].dtype.name == "int32"


# -- the artifact ----------------------------------------------------------------------------
def test_vocabulary_is_a_checked_artifact_outside_ensemble_pkl(tmp_path, string_session_workflow):
    from merlin.dag import postorder_iter_nodes
    from merlin.systems.dag import Ensemble

    workflow, _, _ = string_session_workflow
    factories.decode_ensemble(workflow, TOP_K).export(str(tmp_path))
    ensemble_dir = tmp_path / "executor_model" / "1" / "ensemble"
    assert b"sku-" not in (ensemble_dir / "ensemble.pkl").read_bytes()
    (artifact,) = ensemble_dir.glob("item_vocabulary_*")
    assert {p.name for p in artifact.iterdir()} == {
        "manifest.json", "raw_ids.parquet", "vocabulary.json", "export.json"}

    # The local runtime loads the exported vocabulary just as the Triton executor does.
    loaded = Ensemble.load(str(ensemble_dir))
    (op,) = [node.op for node in postorder_iter_nodes(loaded.graph.output_node)
             if isinstance(node.op, DecodeItemIds)]
    assert op.vocabulary is None
    op.load_artifacts(str(ensemble_dir))
    table = unique_values(workflow)
    codes = table.index.to_numpy()[:TOP_K].reshape(1, -1).astype(np.int32)
    scores = np.linspace(1, 0, TOP_K, dtype=np.float32).reshape(1, -1)
    out = loaded.transform(pd.DataFrame({"item_ids": list(codes), "item_id_scores": list(scores)}))
    np.testing.assert_array_equal(stacked(out, "item_ids"), table.to_numpy()[None, :TOP_K])

    data = bytearray((artifact / "raw_ids.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (artifact / "raw_ids.parquet").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="raw_ids.parquet"):
        pickle.loads(pickle.dumps(op)).load_artifacts(str(ensemble_dir))


def test_re_export_replaces_the_earlier_vocabulary_and_keeps_the_model(tmp_path,
                                                                      session_workflow):
    from merlin.dag import postorder_iter_nodes

    workflow, model, _ = session_workflow
    decoded_ensemble(workflow, model).export(str(tmp_path))
    ensemble = decoded_ensemble(workflow, model)
    ensemble.export(str(tmp_path))
    ensemble_dir = tmp_path / "executor_model" / "1" / "ensemble"
    folders = sorted({node.op._artifact_dir for node in postorder_iter_nodes(
        ensemble.graph.output_node) if hasattr(node.op, "_artifact_dir")})
    # Two vocabularies, and one folder for the one model behind both top-k's.
    assert [name[:10] for name in folders] == ["item_vocab"] * 2 + ["t4r_model_"]
    assert sorted(p.name for p in ensemble_dir.iterdir() if p.is_dir()) == folders


# -- the local runtime ------------------------------------------------------------------------
def test_local_runtime_returns_raw_ids_with_and_without_the_seen_items(any_workflow):
    workflow, model, raw = any_workflow
    df = raw.head(30).reset_index(drop=True)
    assert_matches_references(decoded_ensemble(workflow, model).transform(df),
                              workflow, model, df)


@pytest.mark.parametrize("string_ids, filler", [(False, -1), (True, "")])
def test_a_slot_no_item_was_left_for_decodes_to_the_filler(tmp_path, string_ids, filler):
    """Eleven items, a top-11 without the session's own: the rest of each row is filler."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import PredictT4RPyTorch

    workflow, model, raw = factories.fit_session_workflow(
        tmp_path, np.random.default_rng(9), n=60, string_ids=string_ids, items=12)
    table = unique_values(workflow)
    k = len(table)
    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow)
                >> PredictT4RPyTorch(model, top_k=k, exclude_seen=True) >> DecodeItemIds(workflow))
    df = raw.head(8).reset_index(drop=True)
    got = Ensemble(pipeline, workflow.input_schema).transform(df)
    for ids, scores, session in zip(got["item_ids"], got["item_id_scores"], df[ITEM]):
        unseen = set(table) - set(session)
        assert set(ids[:len(unseen)]) == unseen
        assert list(ids[len(unseen):]) == [filler] * (k - len(unseen))
        assert np.isneginf(scores[len(unseen):]).all() and np.isfinite(scores[:len(unseen)]).all()


def test_local_runtime_excludes_items_cropped_from_long_sessions(session_workflow):
    workflow, model, raw = session_workflow
    longer, heads = with_recommendations_in_front(workflow, model, raw)
    got = decoded_ensemble(workflow, model).transform(longer)
    assert_same_top_k(got, reference_top_k(workflow, model, longer, exclude_seen=True))
    for row, head in zip(stacked(got, "item_ids"), heads):
        assert set(row).isdisjoint(head)


# -- Triton ---------------------------------------------------------------------------------
def _decode_request(client, model_name, codes, scores):
    response = client.infer(model_name, arrays_to_inputs(
        {"item_ids": codes.astype(np.int32), "item_id_scores": scores}))
    return {name: response.as_numpy(name) for name in ("item_ids", "item_id_scores")}


def test_triton_decodes_ids_to_bytes_and_passes_scores_through(string_client,
                                                               string_session_workflow):
    table = unique_values(string_session_workflow[0])
    rng = np.random.default_rng(11)
    codes = rng.choice(table.index.to_numpy(), size=(64, TOP_K))
    scores = rng.standard_normal((64, TOP_K)).astype(np.float32)
    raw = _decode_request(string_client, "decode_only_str", codes, scores)
    expected = table.loc[codes.reshape(-1)].to_numpy().reshape(codes.shape)
    assert raw["item_ids"].dtype == object and isinstance(raw["item_ids"][0, 0], bytes)
    np.testing.assert_array_equal(raw["item_ids"],
                                  np.char.encode(expected.astype(str), "utf-8").astype(object))
    np.testing.assert_array_equal(raw["item_id_scores"], scores)  # untouched, bit for bit


def test_triton_declares_raw_dtypes(client, string_client):
    def item_ids(c, name):
        outputs = c.get_model_metadata(name, as_json=True)["outputs"]
        return next(o for o in outputs if o["name"] == "item_ids")

    assert item_ids(client, "session_decoded")["datatype"] == "INT64"
    assert item_ids(string_client, "session_decoded_str")["datatype"] == "BYTES"
    assert item_ids(client, "session_decoded")["shape"][-1] == str(MASKED_TOP_K)


def test_triton_reserved_id_is_an_error_and_the_server_keeps_serving(string_client,
                                                                     string_session_workflow):
    from tritonclient.utils import InferenceServerException

    table = unique_values(string_session_workflow[0])
    codes = np.tile(table.index.to_numpy()[:TOP_K], (2, 1))
    scores = np.zeros((2, TOP_K), np.float32)
    codes[1, 4] = 1
    with pytest.raises(InferenceServerException, match=r"encoded id 1, which has no raw item"):
        _decode_request(string_client, "decode_only_str", codes, scores)
    ok = _decode_request(string_client, "decode_only_str", codes[:1], scores[:1])
    assert [b.decode() for b in ok["item_ids"][0]] == table.to_list()[:TOP_K]


def test_triton_serves_raw_int64_ids_with_and_without_the_seen_items(client, session_workflow):
    workflow, model, raw = session_workflow
    df = raw.sample(40, random_state=1).reset_index(drop=True)
    served = infer_dataframe(client, df, model_name="session_decoded")
    assert stacked(served, "item_ids").dtype == stacked(served, "all_item_ids").dtype == np.int64
    assert stacked(served, "item_ids").max() > 1_000_000  # the shop's ids run into millions
    assert_matches_references(served, workflow, model, df)


def test_triton_serves_raw_string_ids_with_and_without_the_seen_items(string_client,
                                                                      string_session_workflow):
    workflow, model, raw = string_session_workflow
    df = raw.sample(40, random_state=2).reset_index(drop=True)
    served = infer_dataframe(string_client, df, model_name="session_decoded_str")
    assert isinstance(served["item_ids"][0][0], str)
    assert_matches_references(served, workflow, model, df)


def test_triton_excludes_items_cropped_from_long_sessions(client, session_workflow):
    workflow, model, raw = session_workflow
    longer, heads = with_recommendations_in_front(workflow, model, raw)
    assert longer[ITEM].map(len).min() > factories.SEQ_LEN
    served = infer_dataframe(client, longer, model_name="session_decoded")
    assert_same_top_k(served, reference_top_k(workflow, model, longer, exclude_seen=True))
    for row, head in zip(stacked(served, "item_ids"), heads):
        assert set(row).isdisjoint(head)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_unsigned_raw_ids_get_their_largest_value_as_filler(dtype):
    """An unsigned id cannot be -1. Before: numpy wrapped -1 with a DeprecationWarning
    (numpy 1.26), and numpy 2 raises OverflowError."""
    import warnings

    from merlin_t4r_ops.ops.vocabulary import ItemVocabulary

    vocabulary = ItemVocabulary(ITEM, 3, np.array([10, 20], dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw = vocabulary.decode(np.array([[4, 3, -1]], dtype=np.int32))
    np.testing.assert_array_equal(raw, np.array([[20, 10, np.iinfo(dtype).max]], dtype=dtype))
    assert raw.dtype == dtype


@pytest.mark.parametrize("raw_ids", [np.array([7, -1], np.int64),
                                     np.array([7, np.iinfo(np.uint64).max], np.uint64),
                                     np.array(["a", ""], object)],
                         ids=["int64", "uint64", "string"])
def test_a_raw_id_equal_to_the_filler_is_warned_about(raw_ids):
    from merlin_t4r_ops.errors import AmbiguousFillerWarning
    from merlin_t4r_ops.ops.vocabulary import ItemVocabulary

    with pytest.warns(AmbiguousFillerWarning, match=r"'item_id-list' holds the raw item id"):
        ItemVocabulary(ITEM, 3, raw_ids)


def test_a_fixed_width_request_wider_than_the_seen_matrix_keeps_its_items_in_it():
    """Right padding is not a session's items: before, a 200-wide request of short sessions
    filled the 128 slots with padding and sent every real id to the slow path."""
    from merlin.table import TensorTable

    from merlin_t4r_ops.ops.masking import seen_matrix

    padded = np.zeros((2, 200), np.int64)
    padded[0, :3], padded[1, :2] = [5, 6, 7], [8, 9]
    recent, older = seen_matrix(TensorTable({ITEM: padded}), ITEM, width=128, filler=0)
    assert older is None
    np.testing.assert_array_equal(recent[:, :3], [[5, 6, 7], [8, 9, 0]])
