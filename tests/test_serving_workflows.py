"""What a shop sends: scalar session features, list columns, raw event rows; gRPC and HTTP.

``infer_dataframe`` sends every column in the shape the model's metadata declares (Merlin
declares a scalar column ``[-1]``) through either flavour of ``tritonclient``, and the answers
equal the eager model's.
"""

import numpy as np
import pytest
import torch

import t4r_factories as factories
import workflow_factories as workflows
from conftest import TOP_K
from merlin_t4r_ops.serving import triton_server
from merlin_t4r_ops.errors import InvalidRequestError
from merlin_t4r_ops.serving.client import dataframe_arrays, infer_dataframe

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(params=["grpc", "http"])
def protocol(request):
    return request.param


def _client(server, protocol):
    """A client built the way a user builds one, straight from ``tritonclient``."""
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(server.grpc_url)
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.http_url)


def test_the_server_hands_out_either_client(triton):
    import tritonclient.http as httpclient

    client = triton.client("http")
    assert isinstance(client, httpclient.InferenceServerClient)
    assert client.is_server_ready()
    with pytest.raises(ValueError, match=r"protocol must be one of \('grpc', 'http'\), got 'rest'"):
        triton.client("rest")


def test_session_level_scalar_features_are_sent_as_declared(triton, served_models, protocol):
    df = workflows.scalar_sessions(9, np.random.default_rng(11))
    served = infer_dataframe(_client(triton, protocol), df, model_name="session_scalar")
    got = np.stack(served["next-item"])
    np.testing.assert_allclose(got, workflows.eager_scores(served_models["session_scalar"], df),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(served[workflows.REQUEST_ID], df[workflows.REQUEST_ID])
    # The scalars reach the model: other devices and ages give other scores.
    changed = df.assign(device=(df["device"] + 1) % workflows.DEVICES, user_age=df["user_age"] / 2)
    assert not np.allclose(np.stack(infer_dataframe(_client(triton, protocol), changed,
                                                    model_name="session_scalar")["next-item"]),
                           got, rtol=RTOL, atol=ATOL)


def test_list_workflow_answers_through_either_client(triton, session_workflow, protocol):
    workflow, model, raw = session_workflow
    df = raw.head(12).reset_index(drop=True)
    served = infer_dataframe(_client(triton, protocol), df, model_name="session_topk")
    local = factories.workflow_ensemble(workflow, model, top_k=TOP_K).transform(df)
    np.testing.assert_array_equal(np.stack(served["item_ids"]), np.stack(local["item_ids"]))
    np.testing.assert_allclose(np.stack(served["item_id_scores"]),
                               np.stack(local["item_id_scores"]), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def event_serving(tmp_path_factory):
    """A workflow whose Groupby takes raw events, label removed, served on its own server.

    Merlin names a workflow's Triton model after its position in the graph
    (``0_transformworkflowtriton``), so two workflow ensembles cannot share the session
    repository.
    """
    workflow, model, events = workflows.fit_event_workflow(
        tmp_path_factory.mktemp("event_workflow"), np.random.default_rng(21))
    workflow.remove_inputs([workflows.LABEL])
    repository = tmp_path_factory.mktemp("event_repository")
    workflows.event_ensemble(workflow, model, top_k=TOP_K).export(str(repository))
    with triton_server(repository) as server:
        yield server, workflow, model, events.drop(columns=[workflows.LABEL])


def _expected_top_k(workflow, model, events):
    """Each session's top-k by the eager model on the workflow's in-process output."""
    from merlin.io import Dataset

    sessions = workflow.transform(Dataset(events, npartitions=1)).to_ddf().compute()
    scores = workflows.eager_scores(model, sessions.reset_index(drop=True))
    top = torch.topk(torch.from_numpy(scores), TOP_K)
    return {int(session): (ids, values) for session, ids, values in
            zip(sessions[workflows.SESSION_ID], top.indices.numpy(), top.values.numpy())}


def test_event_rows_are_grouped_into_sessions_and_answered_with_their_ids(event_serving,
                                                                           protocol):
    server, workflow, model, events = event_serving
    assert workflows.LABEL not in workflow.input_schema.column_names  # dropped for serving
    chosen = np.random.default_rng(5).choice(events[workflows.SESSION_ID].unique(), 15,
                                             replace=False)
    request = events[events[workflows.SESSION_ID].isin(chosen)].reset_index(drop=True)
    served = infer_dataframe(_client(server, protocol), request)
    assert sorted(served[workflows.SESSION_ID]) == sorted(chosen)
    expected = _expected_top_k(workflow, model, request)
    for session, ids, scores in zip(served[workflows.SESSION_ID], served["item_ids"],
                                    served["item_id_scores"]):
        np.testing.assert_array_equal(ids, expected[session][0])
        np.testing.assert_allclose(scores, expected[session][1], rtol=RTOL, atol=ATOL)


def test_each_column_takes_the_shape_the_model_declares():
    df = workflows.scalar_sessions(4, np.random.default_rng(1)).assign(
        fixed=[np.arange(3) + i for i in range(4)])
    dtypes = {"device": np.int64, "user_age": np.float32, "fixed": np.int64,
              "item_id-list__values": np.int64, "item_id-list__offsets": np.int32}
    arrays = dataframe_arrays(df, dtypes, {"device": [-1], "user_age": [-1, 1],
                                           "fixed": [-1, 3]})
    assert arrays["device"].shape == (4,)  # Merlin's declaration of a scalar column
    assert arrays["user_age"].shape == (4, 1)
    assert arrays["fixed"].shape == (4, 3)
    assert arrays["item_id-list__offsets"].tolist() == np.cumsum(
        [0, *df["item_id-list"].map(len)]).tolist()
    assert dataframe_arrays(df, {"device": np.int64})["device"].shape == (4,)


def test_a_column_of_the_wrong_shape_is_named():
    df = workflows.scalar_sessions(3, np.random.default_rng(2))
    with pytest.raises(InvalidRequestError,
                       match=r"column 'item_id-list': the model takes lists of one length "
                             r"\[-1, 4\], the rows have lengths \[\d+, \d+"):
        dataframe_arrays(df, {"item_id-list": np.int64}, {"item_id-list": [-1, 4]})
    with pytest.raises(InvalidRequestError,
                       match=r"column 'device': the model takes shape \[-1, 2\], the column "
                             r"gives \[3\]"):
        dataframe_arrays(df, {"device": np.int64}, {"device": [-1, 2]})
