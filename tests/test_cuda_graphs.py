"""CUDA-graph buckets: the bucket, padding and cutting logic on the CPU, parity on a GPU.

The CPU tests run the operator's own forward (the function a graph captures) on padded
inputs and check that cutting the padding off gives what the unpadded request gives, with
real T4R models. The GPU tests capture real graphs and compare them with eager.
"""

import logging

import numpy as np
import pytest
import torch
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch, T4ROpsError
from merlin_t4r_ops.ops.cuda_graphs import (
    DEFAULT_BUCKETS, CudaGraphBuckets, bucket_for, check_buckets, cut_rows, example_request,
    pad_rows)
from merlin_t4r_ops.ops.inputs import input_specs, to_model_inputs
from merlin_t4r_ops.ops.predict_t4r import SEEN_IN_GRAPH

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU, torch sees none")
KINDS = ["xlnet-causal", "gpt2", "xlnet-mlm", "bert"]  # causal and masked models
RTOL, ATOL = 1e-5, 1e-5
ITEMS = "item_id-list"


def _requests(rows, seed):
    """The same sessions as a ragged request and as a fixed-width (right-padded) one."""
    df = factories.random_sessions(rows, np.random.default_rng(seed), max_len=factories.SEQ_LEN)
    fixed = {k: v.numpy() for k, v in factories.reference_inputs(df).items()}
    return {"ragged": TensorTable.from_df(df), "fixed": TensorTable(fixed)}


def assert_same_top_k(got, want, full_scores=None):
    """Top-k scores agree; ids agree, or (near ties) name items with those scores."""
    np.testing.assert_allclose(got["item_id_scores"], want["item_id_scores"], rtol=RTOL, atol=ATOL)
    if full_scores is None:
        np.testing.assert_array_equal(got["item_ids"], want["item_ids"])
    else:
        picked = np.take_along_axis(full_scores, got["item_ids"].astype(np.int64), axis=1)
        np.testing.assert_allclose(picked, got["item_id_scores"], rtol=RTOL, atol=ATOL)


# -- buckets, padding, cutting (CPU) -------------------------------------------------------
def test_default_buckets_are_powers_of_two_to_256():
    assert DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_buckets_are_sorted_and_unique_and_none_turns_them_off():
    assert check_buckets([8, 2, 8, 32]) == (2, 8, 32)
    assert check_buckets(None) == () and check_buckets([]) == ()


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8", True])
def test_a_bad_bucket_is_named(bad):
    with pytest.raises(T4ROpsError, match=r"cuda_graph_buckets must be positive ints .*got "
                                          + repr(bad).replace(".", r"\.")):
        check_buckets([1, bad])
    with pytest.raises(T4ROpsError, match=r"cuda_graph_buckets must be positive ints"):
        PredictT4RPyTorch(factories.next_item_model(), cuda_graph_buckets=[bad])


@pytest.mark.parametrize("rows, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (200, 256),
                                          (256, 256), (257, None)])
def test_rows_go_to_the_smallest_bucket_that_holds_them(rows, bucket):
    assert bucket_for(rows, DEFAULT_BUCKETS) == bucket


def test_custom_buckets_are_used_as_given():
    assert bucket_for(9, (8, 32)) == 32
    assert bucket_for(33, (8, 32)) is None


def test_padding_appends_zero_rows_and_cutting_removes_them():
    x = torch.arange(6, dtype=torch.int64).reshape(3, 2) + 1
    padded = pad_rows(x, 8)
    assert padded.shape == (8, 2)
    assert torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, 3) is x
    with pytest.raises(T4ROpsError, match=r"cannot pad 3 rows down to 2"):
        pad_rows(x, 2)
    cut = cut_rows({"ids": padded, "scores": padded.float()}, 3)
    assert torch.equal(cut["ids"], x) and cut["scores"].shape == (3, 2)


def test_the_capture_example_is_shaped_like_a_real_request():
    model = factories.next_item_model()
    specs = input_specs(model.input_schema)
    example = example_request(specs, factories.SEQ_LEN)
    real = to_model_inputs(_requests(3, 0)["ragged"], specs, factories.SEQ_LEN,
                           torch.device("cpu"))
    assert set(example) == set(real)
    for name, value in real.items():
        assert example[name].shape == (1, *value.shape[1:])
        assert example[name].dtype == value.dtype


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["ragged", "fixed"])
def test_padding_rows_never_change_the_real_rows(kind, form):
    """What a bucket computes, cut to the request's rows, is what the request alone gives."""
    model = factories.next_item_model(kind, seed=3)
    op = PredictT4RPyTorch(model, top_k=5)
    full = PredictT4RPyTorch(model)
    for rows, bucket in [(1, 2), (3, 4), (5, 8)]:
        table = _requests(rows, seed=rows)[form]
        inputs = to_model_inputs(table, op._specs, op.max_sequence_length, torch.device("cpu"))
        with torch.inference_mode():
            alone = op._device_outputs(inputs)
            padded = op._device_outputs({k: pad_rows(v, bucket) for k, v in inputs.items()})
            scores = full._device_outputs(inputs)["next-item"].numpy()
        cut = cut_rows(padded, rows)
        assert cut["item_ids"].shape == (rows, 5)
        assert_same_top_k({k: v.numpy() for k, v in cut.items()},
                          {k: v.numpy() for k, v in alone.items()}, scores)


def test_on_the_cpu_every_batch_runs_eagerly(caplog):
    model = factories.next_item_model(seed=4)
    op = PredictT4RPyTorch(model, top_k=3)
    with caplog.at_level(logging.INFO, logger="merlin_t4r_ops"):
        out = op.predict(_requests(2, seed=1)["ragged"])
    assert op._graphs is None
    assert "no CUDA graphs; every batch runs eagerly" in caplog.text
    assert out["item_ids"].shape == (2, 3) and out["item_ids"].dtype == np.int32


def test_capturing_needs_a_cuda_device():
    with pytest.raises(T4ROpsError, match=r"CUDA graphs need a CUDA device, got cpu"):
        CudaGraphBuckets(lambda x: x, {}, (1,), torch.device("cpu"))


def test_the_pickled_op_carries_its_buckets_but_no_graphs():
    import pickle

    op = PredictT4RPyTorch(factories.next_item_model(), top_k=3, cuda_graph_buckets=(4, 1))
    op._graphs = object()  # what a capture leaves; it must not reach ensemble.pkl
    state = pickle.loads(pickle.dumps(op)).__dict__
    assert state["cuda_graph_buckets"] == (1, 4) and "_graphs" not in state


# -- parity on a GPU -----------------------------------------------------------------------
GPU_BUCKETS = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module", params=KINDS)
def gpu_ops(request):
    """The same model on CUDA behind a captured op and an eager one."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU, torch sees none")
    model = factories.next_item_model(request.param, seed=7).cuda()
    captured = PredictT4RPyTorch(model, top_k=10, cuda_graph_buckets=GPU_BUCKETS)
    eager = PredictT4RPyTorch(model, top_k=10, cuda_graph_buckets=None)
    full = PredictT4RPyTorch(model, cuda_graph_buckets=None)
    captured._capture_graphs()
    return captured, eager, full


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", ["ragged", "fixed"])
def test_captured_equals_eager_at_every_bucket(gpu_ops, form):
    captured, eager, full = gpu_ops
    graphs = captured._graphs
    assert graphs.covered == GPU_BUCKETS, graphs.summary()
    for rows in sorted({*GPU_BUCKETS, 3, 5, 13}):
        for seed in (rows, rows + 100):  # new inputs written into the same static buffers
            table = _requests(rows, seed)[form]
            got, want = captured.predict(table), eager.predict(table)
            assert got["item_ids"].dtype == np.int32 and got["item_ids"].shape == (rows, 10)
            assert_same_top_k(got, want, full.predict(table)["next-item"])


def _requests_of(df):
    """``df``'s sessions as a ragged request and as a fixed-width (right-padded) one."""
    width = int(df[ITEMS].map(len).max())
    fixed = {name: np.stack([np.pad(s, (0, width - len(s))) for s in df[name]])
             for name in df.columns}
    return {"ragged": TensorTable.from_df(df), "fixed": TensorTable(fixed)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", ["ragged", "fixed"])
@pytest.mark.parametrize("longer", [False, True], ids=["short", "longer-than-the-graph-holds"])
def test_exclude_seen_in_the_graph_equals_eager(form, longer):
    """The graph masks each session's recent items; a longer one's older items after it."""
    model = factories.next_item_model("xlnet-causal", seed=8).cuda()
    captured = PredictT4RPyTorch(model, top_k=10, exclude_seen=True, cuda_graph_buckets=(1, 4, 16))
    eager = PredictT4RPyTorch(model, top_k=10, exclude_seen=True, cuda_graph_buckets=None)
    captured._capture_graphs()
    assert captured._graphs.covered == (1, 4, 16), captured._graphs.summary()
    for rows in (1, 3, 16):
        for seed in (rows, rows + 100):
            rng = np.random.default_rng(seed)
            df = (factories.sessions_some_longer_than(rows, rng, SEEN_IN_GRAPH) if longer
                  else factories.random_sessions(rows, rng))
            table = _requests_of(df)[form]
            got, want = captured.predict(table), eager.predict(table)
            np.testing.assert_array_equal(got["item_ids"], want["item_ids"])
            np.testing.assert_allclose(got["item_id_scores"], want["item_id_scores"],
                                       rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("longer", [False, True], ids=["short", "longer-than-the-graph-holds"])
def test_decoding_in_the_graph_equals_eager_decoding(tmp_path, longer):
    """The raw ids looked up inside the replay equal the eager top-k decoded on the host by
    ``DecodeItemIds``; eleven items and a top-11 leave filler slots (-1) in every row."""
    from merlin.io import Dataset
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds

    workflow, model, raw = factories.fit_session_workflow(
        tmp_path, np.random.default_rng(9), n=60, items=12)
    model = model.cuda()

    def ops(**kwargs):  # built in an Ensemble, which reserves the ids Categorify reserves
        predict = PredictT4RPyTorch(model, top_k=11, exclude_seen=True, **kwargs)
        decode = DecodeItemIds(workflow)
        Ensemble(workflow.input_schema.column_names >> TransformWorkflow(workflow) >> predict
                 >> decode, workflow.input_schema)
        return predict, decode

    captured, vocabulary = ops(cuda_graph_buckets=(1, 4, 16))
    eager, decode = ops(cuda_graph_buckets=None)
    captured._capture_graphs()
    assert captured.decode_with(vocabulary.vocabulary)
    assert captured._graphs.covered == (1, 4, 16), captured._graphs.summary()
    for rows in (1, 3, 16):
        df = raw.sample(rows, random_state=rows).reset_index(drop=True)
        if longer:
            df[ITEMS] = [np.resize(ids, SEEN_IN_GRAPH + 5) for ids in df[ITEMS]]
            for column in ("category-list", "price-list"):
                df[column] = [np.resize(v, SEEN_IN_GRAPH + 5) for v in df[column]]
        table = TensorTable.from_df(
            workflow.transform(Dataset(df, npartitions=1)).to_ddf().compute())
        got, want = captured.predict(table), eager.predict(table)
        want["item_ids"] = decode.vocabulary.decode(want["item_ids"])
        assert got["item_ids"].dtype == np.int64
        np.testing.assert_array_equal(got["item_ids"], want["item_ids"])
        np.testing.assert_allclose(got["item_id_scores"], want["item_id_scores"],
                                   rtol=RTOL, atol=ATOL)
        assert (got["item_ids"] == -1).any()


@pytest.mark.gpu
@needs_cuda
def test_larger_batches_run_eagerly_and_the_log_says_so(caplog):
    model = factories.next_item_model("gpt2", seed=8).cuda()
    op = PredictT4RPyTorch(model, top_k=4, cuda_graph_buckets=(1, 2, 4))
    with caplog.at_level(logging.INFO, logger="merlin_t4r_ops"):
        op._capture_graphs()
    assert "buckets [1, 2, 4] captured" in caplog.text
    assert "batches above 4 rows run eagerly" in caplog.text
    assert "bucket 4: captured, buffers" in caplog.text  # memory per bucket
    table = _requests(9, seed=9)["ragged"]
    assert op._graphs.bucket_for(9) is None
    want = PredictT4RPyTorch(model, top_k=4, cuda_graph_buckets=None).predict(table)
    assert_same_top_k(op.predict(table), want)


@pytest.mark.gpu
@needs_cuda
def test_a_capture_that_fails_falls_back_to_eager(caplog):
    """A host synchronisation inside the function cannot be captured: that bucket runs eagerly."""
    def syncs(inputs):
        x = inputs["x"] * 2
        if x.sum().item() > -1:  # .item() waits for the GPU
            return {"y": x}
        return {"y": -x}

    graphs = CudaGraphBuckets(syncs, {"x": torch.ones(1, 3)}, (1, 2), torch.device("cuda"))
    assert graphs.covered == () and set(graphs.failed) == {1, 2}
    assert "every batch runs eagerly; capture failed for buckets [1, 2]" in graphs.summary()
    # the device still works after the failed captures
    assert torch.ones(2, device="cuda").sum().item() == 2


@pytest.mark.gpu
@needs_cuda
def test_the_triton_load_path_captures(tmp_path, caplog):
    """load_artifacts (what Triton's executor calls) loads the model and captures at once."""
    model = factories.next_item_model("xlnet-causal", seed=9)
    op = PredictT4RPyTorch(model, top_k=5, device="cuda", cuda_graph_buckets=(1, 8))
    op.save_artifacts(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="merlin_t4r_ops"):
        op.load_artifacts(str(tmp_path))
    assert op._graphs is not None and op._graphs.covered == (1, 8)
    assert "CUDA graphs on cuda:0: buckets [1, 8] captured" in caplog.text
    table = _requests(6, seed=6)["ragged"]
    eager = PredictT4RPyTorch(op.model, top_k=5, cuda_graph_buckets=None)
    assert_same_top_k(op.predict(table), eager.predict(table))


@pytest.mark.gpu
@needs_cuda
def test_two_operators_over_one_loaded_model_replay_their_own_graphs(tmp_path):
    """One model loaded once behind a top-20 and a top-5: each captures its own graphs, over
    the same parameters, and answers as eager, in any order."""
    from merlin.dag import postorder_iter_nodes

    model = factories.next_item_model("gpt2", seed=10)
    factories.two_top_ks_ensemble(model, device="cuda", cuda_graph_buckets=(1, 8)).export(
        str(tmp_path))
    loaded = factories.load_exported(tmp_path / "executor_model" / "1" / "ensemble")
    ops = [node.op for node in postorder_iter_nodes(loaded.graph.output_node)
           if isinstance(node.op, PredictT4RPyTorch)]
    assert ops[0].model is ops[1].model and ops[0]._graphs is not ops[1]._graphs
    assert all(op._graphs.covered == (1, 8) for op in ops)
    for seed in (1, 2, 3):
        table = _requests(6, seed=seed)["ragged"]
        for op in ops:
            eager = PredictT4RPyTorch(op.model, top_k=op.top_k, cuda_graph_buckets=None)
            got = {name[2:]: value for name, value in op.predict(table).items()}
            assert_same_top_k(got, eager.predict(table))


def test_the_load_report_reaches_the_triton_log(triton):
    """The stub drops Python's INFO logging; the report goes through Triton's own logger."""
    import re

    assert re.search(
        r"PredictT4RPyTorch: (model on cpu, no CUDA graphs; every batch runs eagerly"
        r"|CUDA graphs on cuda:\d+: buckets \[1, 2, 4, 8, 16, 32, 64, 128, 256\] captured)",
        triton.logs())
