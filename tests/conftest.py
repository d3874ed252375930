"""Shared fixtures: one real tritonserver over a repository of small exported ensembles.

Starting tritonserver with a stub per model costs tens of seconds on two cores, so the
serving tests share one server for the whole session.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import t4r_factories as factories  # noqa: E402
import workflow_factories  # noqa: E402

# What torchrun exports; with any of them set, strategy "auto" would pick DDP.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launcher_env(monkeypatch):
    """For tests that decide the strategy themselves: no stray torchrun environment."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


SERVED = {
    "next_item_full": lambda: factories.next_item_model("xlnet-causal", seed=1),
    "next_item_topk": lambda: factories.next_item_model("gpt2", seed=2),
    "next_item_masked": lambda: factories.next_item_model("bert", seed=3),
    "binary": lambda: factories.binary_model(seed=4),
    # Session-level scalar features (a device, an age) beside the lists.
    "session_scalar": lambda: factories.next_item_model(
        "gpt2", schema=workflow_factories.scalar_schema(), seed=8),
}
TOP_K = 10
MASKED_TOP_K = 100  # wide enough that an untrained model ranks reserved ids inside it
# Exported with BatchingTritonRuntime: the model of next_item_full, and the workflow ensemble.
BATCHED_MODEL, BATCHED_WORKFLOW = "next_item_batched", "session_topk_batched"
# Long enough that concurrent test clients land in one execute call on a loaded CI machine.
BATCH_DELAY_US = 5000
# ``session_decoded`` exported with TritonRuntime: the workflow through its fast path.
FAST_DECODED = "session_decoded_fast"


@pytest.fixture(scope="session")
def served_models():
    return {name: build() for name, build in SERVED.items()}


@pytest.fixture(scope="session")
def session_workflow(tmp_path_factory):
    """A fitted NVTabular workflow that Categorifies raw item and category ids."""
    return factories.fit_session_workflow(
        tmp_path_factory.mktemp("workflow"), np.random.default_rng(7)
    )


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory, served_models, session_workflow):
    """Each model exported as its own ensemble, plus three with a workflow in front, and
    ``two_top_ks``: two top-k's of the ``next_item_topk`` model, side by side.

    ``next_item_full`` is exported with :class:`TritonRuntime`, the others as Merlin exports.

    The model of ``next_item_full`` and the top-k workflow ensemble are exported a second
    time with :class:`BatchingTritonRuntime` (``BATCHED_MODEL``, ``BATCHED_WORKFLOW``).
    """
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import PredictT4RPyTorch
    from merlin_t4r_ops.runtime import BatchingTritonRuntime, TritonRuntime

    path = tmp_path_factory.mktemp("model_repository")
    for name, model in served_models.items():
        op = PredictT4RPyTorch(model, top_k=TOP_K if name == "next_item_topk" else None)
        answer, inputs = model.input_schema.column_names >> op, model.input_schema
        if name == "session_scalar":  # and a request id that travels beside the answer
            answer, inputs = workflow_factories.with_request_id(answer, inputs)
        # next_item_full through this package's executor (named errors); the rest as Merlin's.
        runtime = TritonRuntime() if name == "next_item_full" else None
        Ensemble(answer, inputs).export(str(path), name=name, runtime=runtime)
    top1 = served_models["next_item_topk"]  # answers [rows, 1] lists
    Ensemble(top1.input_schema.column_names >> PredictT4RPyTorch(top1, top_k=1),
             top1.input_schema).export(str(path), name="next_item_top1")
    workflow, workflow_model, _ = session_workflow
    factories.workflow_ensemble(workflow, workflow_model, top_k=TOP_K).export(
        str(path), name="session_topk"
    )
    factories.seen_and_plain_ensemble(workflow, workflow_model, MASKED_TOP_K).export(
        str(path), name="session_unseen"
    )
    factories.seen_and_plain_ensemble(workflow, workflow_model, MASKED_TOP_K,
                                      decode=True).export(str(path), name="session_decoded")
    # Two operators over one model object: a top-20 (a_) and a top-5 (b_).
    factories.two_top_ks_ensemble(top1).export(str(path), name="two_top_ks")
    batching = BatchingTritonRuntime(max_queue_delay_us=BATCH_DELAY_US)
    model = served_models["next_item_full"]
    Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
             model.input_schema).export(str(path), name=BATCHED_MODEL, runtime=batching)
    factories.workflow_ensemble(workflow, workflow_model, top_k=TOP_K).export(
        str(path), name=BATCHED_WORKFLOW, runtime=batching
    )
    # session_decoded through the workflow fast path, inside the executor (no workflow model).
    factories.seen_and_plain_ensemble(workflow, workflow_model, MASKED_TOP_K, decode=True).export(
        str(path), name=FAST_DECODED, runtime=TritonRuntime())
    return path


@pytest.fixture(scope="session")
def string_session_workflow(tmp_path_factory):
    """Like ``session_workflow``, with the shop's item ids as strings."""
    return factories.fit_session_workflow(
        tmp_path_factory.mktemp("string_workflow"), np.random.default_rng(8), string_ids=True
    )


@pytest.fixture(scope="session")
def string_client(tmp_path_factory, string_session_workflow):
    """A server of its own for the string-id workflow (Merlin names every exported workflow
    model ``0_transformworkflowtriton``, so one repository holds one workflow), with
    ``session_decoded_str`` like ``session_decoded`` and ``decode_only_str``: encoded ids in."""
    from merlin_t4r_ops.serving import triton_server

    path = tmp_path_factory.mktemp("string_model_repository")
    workflow, model, _ = string_session_workflow
    factories.seen_and_plain_ensemble(workflow, model, MASKED_TOP_K, decode=True).export(
        str(path), name="session_decoded_str")
    factories.decode_ensemble(workflow, TOP_K).export(str(path), name="decode_only_str")
    with triton_server(path) as server:
        yield server.client()


@pytest.fixture(scope="session")
def triton(model_repository):
    from merlin_t4r_ops.serving import triton_server

    # Eight models load at once; a CI machine shared with other jobs needs more than 180 s.
    with triton_server(model_repository, timeout=600) as server:
        yield server


@pytest.fixture(scope="session")
def client(triton):
    return triton.client()


@pytest.fixture(scope="session")
def tutorial(tmp_path_factory):
    """T4R's tutorial ETL fitted on random events, its schema read with
    ``merlin_standard_lib``, and an (untrained) XLNet built from that schema.

    Returns a dict: ``workflow``, ``events``, ``schema`` (standard_lib), ``model``,
    ``directory`` (Categorify's tables, schema.pbtxt).
    """
    import tutorial_factories as tutorial
    from merlin.io import Dataset

    directory = tmp_path_factory.mktemp("tutorial")
    rng = np.random.default_rng(17)
    events = tutorial.events(rng, 150, tutorial.item_catalogue(60))
    workflow = tutorial.tutorial_workflow(directory)
    workflow.fit(Dataset(events))
    schema = tutorial.standard_lib_schema(tutorial.write_schema_pbtxt(workflow, directory))
    return dict(workflow=workflow, events=events, schema=schema,
                model=tutorial.xlnet_model(schema).eval(), directory=directory)
