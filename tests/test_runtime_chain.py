"""The lean chain (workflow >> model >> decode, run directly) answers as Merlin's executor does.

Each ensemble is exported twice into one repository, with ``TritonRuntime()`` (the lean
chain) and ``TritonRuntime(lean_chain=False)`` (Merlin's ``LocalExecutor``), and served by
one real tritonserver; the two answers must be identical, errors included.
"""

import re

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

import t4r_factories as factories
from merlin_t4r_ops.serving.client import arrays_to_inputs, dataframe_arrays, infer_dataframe

TOP_K = 20
ITEM = "item_id-list"
LEAN, MERLIN = "chain_lean", "chain_merlin"
BRANCHES = "branches"  # two top-k's side by side: not a chain
BATCHED = "chain_batched"  # the chain behind Triton's dynamic batcher
COLUMNS = (ITEM, "category-list", "price-list")


def raw_dtypes(df):
    """The executor's input dtypes for the raw sessions of ``df``."""
    dtypes = {f"{column}__values": df[column][0].dtype for column in COLUMNS}
    return {**dtypes, **{f"{column}__offsets": np.dtype(np.int32) for column in COLUMNS}}


def chain_ensemble(workflow, model, top_k=TOP_K, device=None):
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch

    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow)
                >> PredictT4RPyTorch(model, top_k=top_k, exclude_seen=True, device=device)
                >> DecodeItemIds(workflow))
    return Ensemble(pipeline, workflow.input_schema)


@pytest.fixture(scope="module")
def chain_server(tmp_path_factory, session_workflow, string_session_workflow):
    """``chain_lean``/``chain_merlin`` (int ids), the same with ``_str`` (string ids),
    ``branches`` exported with the lean chain asked for, and ``chain_batched``."""
    from merlin_t4r_ops.runtime import BatchingTritonRuntime, TritonRuntime
    from merlin_t4r_ops.serving import triton_server

    path = tmp_path_factory.mktemp("chain_repository")
    for suffix, (workflow, model, _) in (("", session_workflow),
                                         ("_str", string_session_workflow)):
        chain_ensemble(workflow, model).export(str(path), name=LEAN + suffix,
                                               runtime=TritonRuntime())
        chain_ensemble(workflow, model).export(str(path), name=MERLIN + suffix,
                                               runtime=TritonRuntime(lean_chain=False))
    workflow, model, _ = session_workflow
    factories.seen_and_plain_ensemble(workflow, model, TOP_K, decode=True).export(
        str(path), name=BRANCHES, runtime=TritonRuntime())
    chain_ensemble(workflow, model).export(
        str(path), name=BATCHED, runtime=BatchingTritonRuntime(max_queue_delay_us=5000))
    with triton_server(path, timeout=600) as server:
        yield server


def requests(raw, rng):
    """Batches of 1 and 32 sessions, one in five items unknown to the workflow, and sessions
    longer than the model's width."""
    df = raw.sample(32, random_state=int(rng.integers(1000))).reset_index(drop=True)
    unknown = "sku-unknown" if df[ITEM][0].dtype == object else 13
    df[ITEM] = [np.where(rng.random(len(ids)) < 0.2, unknown, ids).astype(ids.dtype)
                for ids in df[ITEM]]
    long = df.head(2).copy()
    long[ITEM] = [np.concatenate([ids] * 4) for ids in long[ITEM]]
    for column in ("category-list", "price-list"):
        long[column] = [np.concatenate([values] * 4) for values in long[column]]
    return [df.head(1), df, long]


def assert_identical(lean, merlin, score_rtol=0.0):
    """Same columns, dtypes and values; scores within ``score_rtol`` (rows run in another
    batch sum their floats in another order)."""
    assert list(lean.columns) == list(merlin.columns)
    for column in lean.columns:
        got, expected = np.stack(lean[column]), np.stack(merlin[column])
        assert got.dtype == expected.dtype, column
        if column.endswith("scores") and score_rtol:
            np.testing.assert_allclose(got, expected, rtol=score_rtol, atol=1e-6, err_msg=column)
        else:
            np.testing.assert_array_equal(got, expected, err_msg=column)


@pytest.mark.parametrize("suffix", ["", "_str"], ids=["int ids", "string ids"])
def test_the_lean_chain_answers_as_merlins_executor(chain_server, session_workflow,
                                                   string_session_workflow, suffix):
    raw = (session_workflow if suffix == "" else string_session_workflow)[2]
    client = chain_server.client()
    for df in requests(raw, np.random.default_rng(3)):
        lean = infer_dataframe(client, df, model_name=LEAN + suffix)
        merlin = infer_dataframe(client, df, model_name=MERLIN + suffix)
        assert_identical(lean, merlin)
        seen = [set(ids) for ids in df[ITEM]]
        assert all(seen_ids.isdisjoint(top) for seen_ids, top in zip(seen, lean["item_ids"]))


def test_batched_requests_through_the_lean_chain_get_their_own_answers(chain_server,
                                                                        session_workflow):
    """Eight clients at once through BatchingTritonRuntime: whatever the batcher merges, the
    chain runs it as one table, and each answer is what Merlin's executor gives that request
    alone."""
    from concurrent.futures import ThreadPoolExecutor

    raw = session_workflow[2]
    frames = [raw.sample(n, random_state=n).reset_index(drop=True) for n in range(1, 9)]

    def ask(df):
        return infer_dataframe(chain_server.client(), df, model_name=BATCHED)

    with ThreadPoolExecutor(len(frames)) as pool:
        answers = list(pool.map(ask, frames))
    client = chain_server.client()
    for df, answer in zip(frames, answers):
        assert_identical(answer, infer_dataframe(client, df, model_name=MERLIN), score_rtol=1e-5)


def _disagreeing_lists(arrays, df):
    """Session 0 with 3 items and 5 categories: the model's input check refuses it."""
    df = df.copy()
    df.at[0, ITEM] = df.at[0, ITEM][:1].repeat(3)
    df.at[0, "category-list"] = df.at[0, "category-list"][:1].repeat(5)
    df.at[0, "price-list"] = np.ones(3, np.float32)
    return dataframe_arrays(df, {name: a.dtype for name, a in arrays.items()})


def _decreasing_offsets(arrays, df):
    offsets = arrays["price-list__offsets"].copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    return {**arrays, "price-list__offsets": offsets}


def _missing_input(arrays, df):
    return {k: v for k, v in arrays.items() if k != "category-list__offsets"}


BAD_REQUESTS = {
    "lists that disagree (the model's check, after the workflow)": (
        _disagreeing_lists, r"^SessionLengthError: row 0: the list inputs disagree on the "
                            r"session's length: \{'item_id-list': 3, 'category-list': 5"),
    "decreasing offsets": (
        _decreasing_offsets, r"^InvalidRequestError: input 'price-list__offsets': offsets must "
                             r"not decrease"),
    "missing input": (
        _missing_input, r"^InvalidRequestError: input 'category-list__offsets' is missing"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_gets_the_same_error_from_both(chain_server, session_workflow, case):
    corrupt, message = BAD_REQUESTS[case]
    df = session_workflow[2].head(4).reset_index(drop=True)
    client = chain_server.client()
    bad = corrupt(dataframe_arrays(df, raw_dtypes(df)), df)
    errors = []
    for name in (LEAN, MERLIN):
        with pytest.raises(InferenceServerException) as caught:
            client.infer(name, arrays_to_inputs(bad))
        errors.append((caught.value.status(), caught.value.message()))
    assert errors[0] == errors[1]
    assert errors[0][0] == "StatusCode.INVALID_ARGUMENT", errors[0]
    assert re.match(message, errors[0][1]), errors[0][1]
    ok = infer_dataframe(client, df, model_name=LEAN)  # and the next request is answered
    assert len(ok) == len(df)


def test_the_server_log_says_which_executor_runs(chain_server):
    def report(name):
        lines = [line for line in chain_server.logs().splitlines() if f"{name}: " in line
                 and "runs the graph" in line]
        assert lines, f"no executor report for {name}"
        return lines[-1]

    assert "the lean chain runs the graph" in report(LEAN)
    assert "ids decoded on the model's device" in report(LEAN)
    assert "ids decoded on the host (DecodeItemIds)" in report(LEAN + "_str")
    assert "LocalExecutor runs the graph (lean_chain=False)" in report(MERLIN)
    assert "the lean chain runs the graph" in report(BATCHED)
    assert "LocalExecutor runs the graph: it is not the lean chain" in report(BRANCHES)


def test_a_graph_with_branches_is_not_a_chain(tmp_path, session_workflow):
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops.runtime import TritonRuntime
    from merlin_t4r_ops.runtime.chain import lean_chain, why_not_a_chain

    workflow, model, _ = session_workflow
    factories.seen_and_plain_ensemble(workflow, model, TOP_K, decode=True).export(
        str(tmp_path), name=BRANCHES, runtime=TritonRuntime())
    loaded = Ensemble.load(str(tmp_path / BRANCHES / "1" / "ensemble"))
    assert lean_chain(loaded) is None
    assert "not the chain ['SelectionOp', 'CompiledWorkflow (optional)', 'PredictT4RPyTorch', " \
           "'DecodeItemIds (optional)']" in why_not_a_chain(loaded)


SHORTER = {"model alone": (False, False), "model >> decode": (False, True),
           "workflow >> model": (True, False)}


@pytest.mark.parametrize("shape", SHORTER)
def test_shorter_chains_run_lean_and_answer_as_the_executor(tmp_path, session_workflow, shape):
    """The model alone (encoded sessions in), with only the decoding, or only the workflow:
    chains too, run directly, and the answers are the executor's (the full chain: above)."""
    from merlin.dag import ColumnSelector
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow
    from merlin.table import TensorTable

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch
    from merlin_t4r_ops.runtime import TritonRuntime
    from merlin_t4r_ops.runtime.chain import lean_chain, why_not_a_chain
    from merlin_t4r_ops.workflow import compile_workflow

    with_workflow, decode = SHORTER[shape]
    workflow, model, raw = session_workflow
    tables = [TensorTable(dataframe_arrays(raw.head(rows), raw_dtypes(raw))) for rows in (1, 16)]
    head, schema = workflow.input_schema.column_names, workflow.input_schema
    if with_workflow:
        head = head >> TransformWorkflow(workflow)
    else:  # encoded sessions, as the workflow hands them over
        encode = compile_workflow(TransformWorkflow(workflow))
        tables = [encode.transform(ColumnSelector(), table) for table in tables]
        head, schema = model.input_schema.column_names, model.input_schema
    pipeline = head >> PredictT4RPyTorch(model, top_k=TOP_K, exclude_seen=True)
    if decode:
        pipeline = pipeline >> DecodeItemIds(workflow)
    Ensemble(pipeline, schema).export(str(tmp_path), name="shorter", runtime=TritonRuntime())
    loaded = factories.load_exported(str(tmp_path / "shorter" / "1" / "ensemble"))
    assert why_not_a_chain(loaded) is None
    chain = lean_chain(loaded)
    assert chain.decodes == decode and chain.decodes_in_graph == decode
    for table in tables:
        expected = loaded.transform(table).to_dict()
        got = chain.transform(table).to_dict()
        assert list(got) == list(expected)
        for name in got:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the lookup inside CUDA graphs")])]


@pytest.mark.parametrize("device", DEVICES)
def test_in_process_the_chain_equals_the_executor(tmp_path, session_workflow, device):
    """The exported graph, loaded as the executor loads it, run both ways on tables of 1 and
    16 rows; the chain leaves the graph's operators as they were, so the executor still
    decodes once. On CUDA the chain's operator replays its graphs, the lookup inside."""
    from merlin.dag import postorder_iter_nodes
    from merlin.systems.dag import Ensemble
    from merlin.table import TensorTable

    from merlin_t4r_ops.runtime import TritonRuntime
    from merlin_t4r_ops.runtime.chain import lean_chain

    workflow, model, raw = session_workflow
    chain_ensemble(workflow, model, device=device).export(
        str(tmp_path), name=LEAN, runtime=TritonRuntime())
    folder = tmp_path / LEAN / "1" / "ensemble"
    loaded = Ensemble.load(str(folder))
    for node in postorder_iter_nodes(loaded.graph.output_node):
        node.op.load_artifacts(str(folder))
    tables = [TensorTable(dataframe_arrays(raw.head(rows), raw_dtypes(raw))) for rows in (1, 16)]
    expected = [loaded.transform(table).to_dict() for table in tables]  # before the chain
    chain = lean_chain(loaded)
    assert chain is not None and chain.decodes_in_graph  # int64 ids: looked up by the model
    predict = chain.steps[1][0]
    assert (predict._graph_runner() is not None) == (device == "cuda")
    for table, wanted in zip(tables, expected):
        got = chain.transform(table).to_dict()
        after = loaded.transform(table).to_dict()  # the executor, once the chain took over
        for answer in (got, after):
            assert list(answer) == list(wanted)
            for name in answer:
                np.testing.assert_array_equal(answer[name], wanted[name], err_msg=name)


# -- the raw ids looked up right after the top-k (in the CUDA graph on a GPU) --------------
def _ops_of(ensemble):
    decode_node = ensemble.graph.output_node
    return decode_node.parents[0].op, decode_node.op


def _encoded(workflow, df):
    from merlin.io import Dataset
    from merlin.table import TensorTable

    return TensorTable.from_df(workflow.transform(Dataset(df, npartitions=1)).to_ddf().compute())


@pytest.mark.parametrize("longer", [False, True], ids=["short", "longer-than-the-graph-holds"])
def test_decoding_in_the_top_k_equals_decode_item_ids(tmp_path, longer):
    """What a replay returns once the op decodes (the captured function, on the CPU), and its
    eager path, equal the top-k decoded by ``DecodeItemIds``; a slot no item was left for
    (eleven items, a top-11) is the filler -1 either way."""
    from test_ops_top_k import _replay_on_the_cpu

    from merlin_t4r_ops.ops.inputs import to_model_inputs
    from merlin_t4r_ops.ops.predict_t4r import SEEN_IN_GRAPH

    workflow, model, raw = factories.fit_session_workflow(
        tmp_path, np.random.default_rng(9), n=60, items=12)
    df = raw.head(6).reset_index(drop=True)
    if longer:  # the even rows longer than the graph's seen matrix
        df = df.copy()
        for column in COLUMNS:
            df[column] = [np.resize(v, SEEN_IN_GRAPH + 5) if i % 2 == 0 else v
                          for i, v in enumerate(df[column])]
    ensemble = chain_ensemble(workflow, model, top_k=11)  # every item: filler slots too
    predict, decode = _ops_of(ensemble)
    expected = ensemble.transform(df)  # Merlin's executor, DecodeItemIds on the host
    table = _encoded(workflow, df)
    assert predict.decode_with(decode.vocabulary)
    inputs = to_model_inputs(table, predict._specs, predict.max_sequence_length,
                             torch.device("cpu"))
    with torch.inference_mode():
        replayed = predict._replay_excluding_seen(_replay_on_the_cpu(predict, bucket=8),
                                                  inputs, table)
    eager = predict.predict(table)
    for got in ({k: v.numpy() for k, v in replayed.items()}, eager):
        assert got["item_ids"].dtype == np.int64
        np.testing.assert_array_equal(got["item_ids"], np.stack(expected["item_ids"]))
        np.testing.assert_allclose(got["item_id_scores"], np.stack(expected["item_id_scores"]),
                                   rtol=1e-5, atol=1e-6)  # a padded batch: float sums differ
    assert (np.stack(expected["item_ids"]) == -1).any()


def test_string_ids_and_decode_in_graph_false_stay_on_the_host(session_workflow,
                                                               string_session_workflow):
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch

    workflow, model, _ = string_session_workflow
    predict, decode = _ops_of(chain_ensemble(workflow, model))
    assert not predict.decode_with(decode.vocabulary)  # strings: one numpy take on the host
    workflow, model, _ = session_workflow
    refused = PredictT4RPyTorch(model, top_k=TOP_K, decode_in_graph=False)
    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow) >> refused
                >> DecodeItemIds(workflow))
    predict, decode = _ops_of(Ensemble(pipeline, workflow.input_schema))
    assert not predict.decode_with(decode.vocabulary)


def test_decoding_stays_on_the_host_unless_the_vocabulary_covers_the_item_table(
        session_workflow):
    """The device lookup has no range check; the host's DecodeItemIds refuses by name."""
    workflow, model, _ = session_workflow
    predict, decode = _ops_of(chain_ensemble(workflow, model))
    predict._embedding_rows = {}  # a model whose item table was not found
    assert not predict.decode_with(decode.vocabulary)


def test_the_lookup_inverts_the_encoding_filler_included(session_workflow):
    """One table: numpy's take (DecodeItemIds) and torch's (the graph) give the same ids."""
    from merlin_t4r_ops import DecodeItemIds

    vocabulary = DecodeItemIds(session_workflow[0]).vocabulary
    encoded = np.array([[-1, vocabulary.first_id, vocabulary.first_id + len(vocabulary.raw_ids)
                         - 1]])
    on_device = torch.take(vocabulary.device_lookup("cpu"), torch.from_numpy(encoded) + 1)
    np.testing.assert_array_equal(on_device.numpy(), vocabulary.decode(encoded))
    np.testing.assert_array_equal(vocabulary.decode(encoded)[0],
                                  [-1, vocabulary.raw_ids[0], vocabulary.raw_ids[-1]])


def test_the_chain_takes_its_operators_in_order_and_nothing_else(session_workflow):
    """Which operator sequences are a chain: the model once, the optional ones in place."""
    from merlin.dag.ops import SelectionOp
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch
    from merlin_t4r_ops.runtime.chain import _fits_the_chain
    from merlin_t4r_ops.workflow import compile_workflow

    workflow, model, _ = session_workflow
    select, predict = SelectionOp(), PredictT4RPyTorch(model, top_k=TOP_K)
    compiled, decode = compile_workflow(TransformWorkflow(workflow)), DecodeItemIds(workflow)
    chains = [[select, predict], [select, compiled, predict], [select, predict, decode],
              [select, compiled, predict, decode]]
    not_chains = [[select], [predict], [select, compiled], [select, decode],
                  [select, predict, predict], [select, decode, predict],
                  [select, predict, compiled], [select, compiled, compiled, predict],
                  [select, TransformWorkflow(workflow), predict],
                  [select, compiled, predict, decode, decode]]
    assert all(_fits_the_chain(ops) for ops in chains)
    assert not any(_fits_the_chain(ops) for ops in not_chains)
