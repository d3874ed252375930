"""The export runtimes, in process: what they write, and how requests are merged and split."""

import filecmp
import importlib.resources

import numpy as np
import pytest
import tritonclient.grpc.model_config_pb2 as model_config
from google.protobuf import text_format
from merlin.schema import ColumnSchema, Schema
from merlin.systems.dag import Ensemble
from merlin.systems.triton.conversions import tensor_names
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import InvalidRequestError, PredictT4RPyTorch, T4ROpsError
from merlin_t4r_ops.runtime import BatchingTritonRuntime, TritonRuntime
from merlin_t4r_ops.runtime.batching import (
    answer_each,
    concat_requests,
    request_rows,
    row_groups,
    split_outputs,
)
from merlin_t4r_ops.runtime.replies import empty_outputs, is_request_error, wire_message

KIND = model_config.ModelInstanceGroup.Kind
SCHEMA = Schema([
    ColumnSchema("items", dtype=np.int64, is_list=True, is_ragged=True),
    ColumnSchema("user", dtype=np.int64),
])
NAMES = tensor_names(SCHEMA)


def _request(sessions, users, offsets_dtype=np.int32):
    """One request's arrays as the batching runtime receives them: leading dimension 1."""
    offsets = np.zeros(len(sessions) + 1, dtype=offsets_dtype)
    np.cumsum([len(s) for s in sessions], out=offsets[1:])
    values = np.concatenate([np.asarray(s, dtype=np.int64) for s in sessions] or [[]])
    return {"items__values": values.astype(np.int64)[None], "items__offsets": offsets[None],
            "user": np.asarray(users, dtype=np.int64)[None]}


@pytest.fixture(scope="module")
def ensemble():
    model = factories.next_item_model("gpt2", seed=11)
    return Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
                    model.input_schema)


def _config(directory, name):
    return text_format.Parse((directory / name / "config.pbtxt").read_text(),
                             model_config.ModelConfig())


def _merlin_executor_model():
    return importlib.resources.files("merlin.systems.triton.models") / "executor_model.py"


# -- merging requests and splitting the answers ---------------------------------------------

def test_requests_are_concatenated_row_wise_and_split_back_in_order():
    requests = [request_rows(_request(s, u), SCHEMA, NAMES) for s, u in (
        ([[1, 2], [3]], [10, 11]), ([[4, 5, 6]], [12]), ([[], [7], [8, 9]], [13, 14, 15]))]
    assert [r.rows for r in requests] == [2, 1, 3]
    merged = concat_requests(requests, SCHEMA)
    np.testing.assert_array_equal(merged["items"].values, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(merged["items"].offsets, [0, 2, 3, 6, 6, 7, 9])
    np.testing.assert_array_equal(merged["user"].values, [10, 11, 12, 13, 14, 15])

    # Outputs of a row-wise graph: a fixed-width column and a ragged one.
    outputs = TensorTable({"scores": np.arange(12, dtype=np.float32).reshape(6, 2),
                           "seen__values": merged["items"].values,
                           "seen__offsets": merged["items"].offsets})
    pieces = split_outputs(outputs, [r.rows for r in requests])
    np.testing.assert_array_equal(pieces[1]["scores"], [[4, 5]])
    np.testing.assert_array_equal(pieces[2]["scores"], [[6, 7], [8, 9], [10, 11]])
    np.testing.assert_array_equal(pieces[0]["seen__values"], [1, 2, 3])
    np.testing.assert_array_equal(pieces[0]["seen__offsets"], [0, 2, 3])
    np.testing.assert_array_equal(pieces[2]["seen__values"], [7, 8, 9])
    np.testing.assert_array_equal(pieces[2]["seen__offsets"], [0, 0, 1, 3])


def test_outputs_without_one_row_per_input_row_cannot_be_split():
    outputs = TensorTable({"scores": np.zeros(4, dtype=np.float32)})
    with pytest.raises(ValueError, match="output 'scores' has 4 rows for 3 input rows"):
        split_outputs(outputs, [1, 2])
    # One request alone is answered with whatever its graph returned.
    [alone] = split_outputs(outputs, [3])
    np.testing.assert_array_equal(alone["scores"], np.zeros(4))


# -- offsets are checked before merlin-core sees them, naming the input ---------------------

def _with(arrays, name, values):
    return {**arrays, name: np.asarray(values, dtype=arrays[name].dtype)[None]}


@pytest.mark.parametrize("offsets, message", [
    ([0, 3, 1, 5], r"input 'items__offsets': offsets must not decrease, but offsets\[2\]=1 "
                   r"< offsets\[1\]=3"),
    ([0, 2, 3, 9], r"input 'items__offsets': the last offset must equal the number of "
                   r"values \(5\), got 9"),
    ([1, 2, 3, 5], r"input 'items__offsets': offsets must start at 0, got 1"),
])
def test_bad_offsets_name_the_input(offsets, message):
    arrays = _with(_request([[1, 2], [3], [4, 5]], [1, 2, 3]), "items__offsets", offsets)
    with pytest.raises(InvalidRequestError, match=message):
        request_rows(arrays, SCHEMA, NAMES)


def test_float_offsets_name_the_input():
    arrays = _request([[1, 2]], [1])
    arrays["items__offsets"] = arrays["items__offsets"].astype(np.float32)
    with pytest.raises(InvalidRequestError,
                       match="input 'items__offsets': offsets must be integers, got dtype float32"):
        request_rows(arrays, SCHEMA, NAMES)


def test_a_batch_of_two_in_one_request_is_refused():
    arrays = _request([[1, 2]], [1])
    arrays["user"] = np.array([[1], [2]])
    with pytest.raises(InvalidRequestError,
                       match=r"input 'user': .* leading dimension must be 1, got shape \[2, 1\]"):
        request_rows(arrays, SCHEMA, NAMES)


def test_inputs_that_disagree_on_rows_are_refused_before_merging():
    arrays = _with(_request([[1, 2], [3]], [1, 2]), "user", [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="inputs disagree on the number of rows: "
                                                  r"\{'items__offsets': 2, 'user': 3\}"):
        request_rows(arrays, SCHEMA, NAMES)


def test_a_missing_input_is_named():
    arrays = _request([[1, 2], [3]], [1, 2])
    del arrays["items__offsets"]
    with pytest.raises(InvalidRequestError, match=r"^input 'items__offsets' is missing: the "
                                                  r"request sent 2 of the 3 inputs$"):
        request_rows(arrays, SCHEMA, NAMES)


# -- what the runtimes write ----------------------------------------------------------------

def test_batching_runtime_writes_dynamic_batching_and_its_executor(ensemble, tmp_path):
    runtime = BatchingTritonRuntime(max_batch_size=32, max_queue_delay_us=750,
                                    preferred_batch_sizes=[8, 16], instances=3,
                                    instance_kind="gpu", gpus=[0, 1])
    ensemble.export(str(tmp_path), name="batched", runtime=runtime)
    config = _config(tmp_path, "batched")
    assert config.max_batch_size == 32
    assert config.dynamic_batching.max_queue_delay_microseconds == 750
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16]
    assert [i.name for i in config.input] == [
        "item_id-list__values", "item_id-list__offsets", "category-list__values",
        "category-list__offsets", "price-list__values", "price-list__offsets"]
    assert all(i.allow_ragged_batch for i in config.input)
    # Optional, so that a missing input reaches the executor, which names it in one line.
    assert all(i.optional for i in config.input)
    [group] = config.instance_group
    assert (group.kind, group.count, list(group.gpus)) == (KIND.KIND_GPU, 3, [0, 1])
    model_py = (tmp_path / "batched" / "1" / "model.py").read_text()
    assert "merlin_t4r_ops.runtime.batching" in model_py
    assert (tmp_path / "batched" / "1" / "ensemble" / "ensemble.pkl").is_file()


@pytest.mark.parametrize("kwargs, kind, count", [
    ({}, KIND.KIND_AUTO, 1),
    ({"instances": 4, "instance_kind": "gpu"}, KIND.KIND_GPU, 4),
    ({"instances": 2, "instance_kind": "cpu"}, KIND.KIND_CPU, 2),
])
def test_triton_runtime_writes_the_instance_group_and_its_own_executor(
        ensemble, tmp_path, kwargs, kind, count):
    ensemble.export(str(tmp_path), name="plain", runtime=TritonRuntime(**kwargs))
    config = _config(tmp_path, "plain")
    [group] = config.instance_group
    assert (group.kind, group.count, list(group.gpus)) == (kind, count, [])
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    model_py = (tmp_path / "plain" / "1" / "model.py").read_text()
    assert "merlin_t4r_ops.runtime.replies" in model_py  # named errors, INVALID_ARG


def test_stock_export_is_unchanged_by_the_runtimes(ensemble, tmp_path):
    """``ensemble.export(path)`` writes what Merlin writes, before and after our runtimes ran."""
    ensemble.export(str(tmp_path / "before"))
    ensemble.export(str(tmp_path / "batched"), runtime=BatchingTritonRuntime(instances=2))
    ensemble.export(str(tmp_path / "after"))
    for folder in ("before", "after"):
        config = _config(tmp_path / folder, "executor_model")
        assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
        assert not any(i.allow_ragged_batch or i.optional for i in config.input)
        assert [(g.kind, g.count) for g in config.instance_group] == [(KIND.KIND_AUTO, 0)]
        with importlib.resources.as_file(_merlin_executor_model()) as merlin_model:
            assert filecmp.cmp(tmp_path / folder / "executor_model" / "1" / "model.py",
                               merlin_model, shallow=False)
    assert (_config(tmp_path / "before", "executor_model")
            == _config(tmp_path / "after", "executor_model"))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, "max_batch_size must be an int >= 1, got 0"),
    ({"max_queue_delay_us": -1}, "max_queue_delay_us must be an int >= 0, got -1"),
    ({"preferred_batch_sizes": [128]},
     "preferred_batch_sizes must be an int between 1 and 64, got 128"),
    ({"instances": 0}, "instances must be a positive int, got 0"),
    ({"instance_kind": "tpu"}, "instance_kind must be one of .*got 'tpu'"),
    ({"gpus": [0]}, r"gpus=\[0\] needs instance_kind='gpu', got 'auto'"),
    ({"instance_kind": "gpu", "gpus": []}, "gpus must be a non-empty list"),
])
def test_runtime_arguments_are_checked(kwargs, message):
    with pytest.raises(T4ROpsError, match=message):
        BatchingTritonRuntime(**kwargs)


def test_a_graph_that_groups_rows_is_not_batched(tmp_path):
    """Groupby builds sessions from event rows: batched, two requests' rows would mix."""
    import nvtabular as nvt
    import pandas as pd
    from merlin.io import Dataset
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    events = pd.DataFrame({"session_id": [1, 1, 2], "item_id": [5, 6, 7],
                           "timestamp": [1, 2, 3]})
    sessions = ["session_id", "item_id", "timestamp"] >> nvt.ops.Groupby(
        groupby_cols=["session_id"], sort_cols=["timestamp"], aggs={"item_id": ["list"]})
    workflow = nvt.Workflow(sessions)
    workflow.fit(Dataset(events))
    ensemble = Ensemble(workflow.input_schema.column_names >> TransformWorkflow(workflow),
                        workflow.input_schema)
    with pytest.raises(T4ROpsError, match=r"this ensemble's \['Groupby'\] combine or drop rows"):
        ensemble.export(str(tmp_path), runtime=BatchingTritonRuntime())
    assert not (tmp_path / "executor_model").exists()
    ensemble.export(str(tmp_path), runtime=TritonRuntime())  # one request per execute: fine


# -- a batch that fails is run again in halves -----------------------------------------------

def test_a_bad_request_among_sixteen_fails_alone_in_a_few_runs():
    """One request with ids beyond the table among 16, through the real operator.

    Retried request by request, as before, the batch cost 17 runs; in halves it costs 9
    (the failed batch, then two halves at each of four levels, one of them split again).
    """
    from merlin_t4r_ops.runtime.batching import answer_each, with_batch_dim
    from merlin_t4r_ops.serving.client import dataframe_arrays

    model = factories.next_item_model(seed=5)
    op = PredictT4RPyTorch(model, top_k=3)
    dtypes = {"item_id-list__values": np.int64, "item_id-list__offsets": np.int32,
              "category-list__values": np.int64, "category-list__offsets": np.int32,
              "price-list__values": np.float32, "price-list__offsets": np.int32}
    bad_at = 11

    def request(seed):
        df = factories.random_sessions(2, np.random.default_rng(seed))
        if seed == bad_at:
            df.at[0, "item_id-list"] = df.at[0, "item_id-list"] + factories.ITEMS
        return request_rows(with_batch_dim(dataframe_arrays(df, dtypes)), model.input_schema,
                            tensor_names(model.input_schema))

    def run(batch):
        runs.append(len(batch))
        outputs = op.transform(None, concat_requests(batch, model.input_schema))
        return split_outputs(outputs, [r.rows for r in batch])

    requests, runs = [request(seed) for seed in range(16)], []
    answers = answer_each(run, requests, failed=lambda error: error)
    assert isinstance(answers[bad_at], InvalidRequestError)
    assert "ids must be <" in str(answers[bad_at])
    for index, (answer, alone) in enumerate(zip(answers, requests)):
        if index != bad_at:
            want = op.transform(None, concat_requests([alone], model.input_schema))
            np.testing.assert_array_equal(answer["item_ids"], want["item_ids"].values)
    # 16 fail; 0-7 pass; 8-15 fail; 8-11 fail; 8-9 pass; 10-11 fail; 10, 11; 12-15 pass.
    assert runs == [16, 8, 8, 4, 2, 2, 1, 1, 4]


def test_a_server_fault_is_answered_to_every_request_and_never_retried():
    """A fault that is not the request's would fail every half too: 64 requests, one run."""
    runs = []

    def run(batch):
        runs.append(len(batch))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    answers = answer_each(run, list(range(64)), failed=lambda error: error)
    assert runs == [64]
    assert len(answers) == 64 and all(isinstance(a, RuntimeError) for a in answers)


def test_merged_batches_stop_at_max_rows_and_a_large_request_runs_alone():
    assert row_groups([100, 100, 56, 1, 300, 2], max_rows=256) == [[0, 1, 2], [3], [4], [5]]
    assert row_groups([3, 4], max_rows=None) == [[0, 1]]
    assert row_groups([], max_rows=256) == []


def test_the_batching_runtime_writes_its_row_cap(ensemble, tmp_path):
    ensemble.export(str(tmp_path), name="batched",
                    runtime=BatchingTritonRuntime(max_batch_rows=128))
    config = _config(tmp_path, "batched")
    assert config.parameters["max_batch_rows"].string_value == "128"
    ensemble.export(str(tmp_path), name="default", runtime=BatchingTritonRuntime())
    assert _config(tmp_path, "default").parameters["max_batch_rows"].string_value == "256"


@pytest.mark.parametrize("error, status, line", [
    (InvalidRequestError("input 'item_id-list': ids must be < 50, got 57 in row 2"), True,
     "InvalidRequestError: input 'item_id-list': ids must be < 50, got 57 in row 2"),
    (RuntimeError("CUDA error\nmore"), False,
     "server error (traceback in the server log): RuntimeError: CUDA error"),
])
def test_the_wire_gets_one_line_and_the_kind_of_fault(error, status, line):
    assert is_request_error(error) is status
    assert wire_message(error) == line


def test_a_long_message_is_cut_to_two_hundred_characters():
    message = wire_message(InvalidRequestError("input 'x': " + "y" * 500))
    assert len(message) == 200 and message.startswith("InvalidRequestError: input 'x': ")


def test_zero_rows_answer_the_declared_columns(ensemble):
    arrays = empty_outputs(ensemble.output_schema)
    assert {name: a.shape for name, a in arrays.items()} == {"next-item": (0, factories.ITEMS)}
