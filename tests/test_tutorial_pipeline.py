"""T4R's tutorial pipeline end to end, as a T4R user runs it, answered by a real tritonserver.

Event rows (with items the workflow never saw) -> the tutorial ETL (Categorify on the events,
Groupby, ListSlice, Rename, tags, ValueCount) -> ``schema.pbtxt`` read with
``merlin_standard_lib`` -> ``TabularSequenceFeatures.from_schema`` and XLNet -> a few steps of
the project's ``Trainer`` through ``T4RecTrainingArguments`` and ``train_dataset_or_path`` ->
``TransformWorkflow >> PredictT4RPyTorch(top_k, exclude_seen=True) >> DecodeItemIds``,
exported with Merlin's ``Ensemble.export`` and served from a repository of its own (Merlin
names every workflow model ``0_transformworkflowtriton``). The same graph is exported beside
it with ``TritonRuntime``, whose workflow fast path runs the whole ETL, Groupby included,
inside the executor model; both must answer as the eager model does.

The tutorial's ``Filter`` on the session length is left out of the served workflow: a
request whose session is shorter would get no row back. No input is tagged TARGET, as in the
tutorials. The reference is built by hand: Categorify's ``unique.<column>.parquet`` tables
read with pandas encode each session, the eager model scores it, every id without a row in
the item table and every id of the session is set to minus infinity, ``torch.topk``.
"""

import glob
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import t4r_factories as factories
import tutorial_factories as etl
from merlin_t4r_ops.serving.client import infer_dataframe

TOP_K = 10
KNOWN, UNKNOWN = 60, 20  # items in the training events; items only requests hold
# The same graph exported with TritonRuntime: the ETL, Groupby included, on the workflow fast
# path inside the executor model (Merlin's own export is ``executor_model``).
FAST = "tutorial_fast"


@pytest.fixture(scope="module")
def tutorial_serving(tmp_path_factory):
    """Train as the tutorial does, export, serve.

    Yields (client, workflow, trained model, raw item ids of the whole catalogue).
    """
    from merlin.io import Dataset
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow
    from transformers4rec.config.trainer import T4RecTrainingArguments

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch
    from merlin_t4r_ops.errors import WorkflowFallbackWarning
    from merlin_t4r_ops.runtime import TritonRuntime
    from merlin_t4r_ops.serving import triton_server
    from merlin_t4r_ops.training import Trainer

    directory = tmp_path_factory.mktemp("tutorial_pipeline")
    rng = np.random.default_rng(23)
    catalogue = etl.item_catalogue(KNOWN + UNKNOWN)
    events = etl.events(rng, 200, catalogue[:KNOWN])
    workflow = etl.tutorial_workflow(directory)
    workflow.fit(Dataset(events))
    workflow.transform(Dataset(events)).to_parquet(str(directory / "train"))
    schema = etl.standard_lib_schema(etl.write_schema_pbtxt(workflow, directory))
    model = etl.xlnet_model(schema, seed=1)

    args = T4RecTrainingArguments(
        output_dir=str(directory / "checkpoints"), max_sequence_length=etl.MAX_LEN,
        data_loader_engine="merlin", per_device_train_batch_size=32, max_steps=3,
        learning_rate=5e-3, save_strategy="no", report_to=[], logging_steps=1000, seed=0)
    trained = Trainer(model=model, args=args, schema=schema,
                      train_dataset_or_path=sorted(glob.glob(str(directory / "train/*.parquet"))))
    result = trained.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    model.eval()

    def ensemble():
        served = workflow.input_schema.column_names >> TransformWorkflow(workflow)
        answer = (served >> PredictT4RPyTorch(model, top_k=TOP_K, exclude_seen=True)
                  >> DecodeItemIds(workflow)) + served[etl.SESSION]
        return Ensemble(answer, workflow.input_schema)

    repository = directory / "model_repository"
    ensemble().export(str(repository))  # Merlin's export: NVTabular in a model of its own
    with warnings.catch_warnings():  # the whole ETL compiles: no fallback to NVTabular
        warnings.simplefilter("error", WorkflowFallbackWarning)
        ensemble().export(str(repository), name=FAST, runtime=TritonRuntime())
    with triton_server(repository) as server:
        yield server.client(), workflow, model, catalogue


def _unique_table(workflow, column: str) -> pd.Series:
    """Categorify's table of the event-level ``column``: index = encoded id, value = raw id.

    The served column names the file (``cat_path``); the category table lies beside it.
    """
    items = Path(workflow.output_schema[etl.ITEM].properties["cat_path"])
    return pd.read_parquet(items.with_name(f"unique.{column}.parquet"))[column]


def _reference(workflow, model, request: pd.DataFrame):
    """{session: (raw ids, scores)} of each session's top-k, built by hand."""
    items, categories = _unique_table(workflow, "item_id"), _unique_table(workflow, "category")
    oov = 2  # Categorify's out-of-vocabulary id: 0 padding, 1 null, 2 OOV
    item_code = {raw: code for code, raw in items.items()}
    category_code = {raw: code for code, raw in categories.items()}
    sessions = {session: rows.sort_values("timestamp")
                for session, rows in request.groupby(etl.SESSION)}
    names = sorted(sessions)
    encoded = pd.DataFrame({
        etl.ITEM: [[item_code.get(i, oov) for i in sessions[s]["item_id"]][-etl.MAX_LEN:]
                   for s in names],
        etl.CATEGORY: [[category_code.get(c, oov) for c in sessions[s]["category"]]
                       [-etl.MAX_LEN:] for s in names],
    })
    scores = factories.eager_scores(model, encoded, etl.MAX_LEN)
    reserved = np.setdiff1d(np.arange(scores.shape[1]), items.index.to_numpy())
    ids, top_scores = factories.reference_top_k(scores, TOP_K, reserved, encoded[etl.ITEM])
    return {session: (items.loc[row].to_numpy(), values)
            for session, row, values in zip(names, ids, top_scores)}


def _requests(catalogue, n_requests: int = 8, sessions_each: int = 5):
    """Requests of event rows; sessions no longer than the workflow's ListSlice keeps (the
    operator sees a session as the workflow hands it over), half their items unknown."""
    rng = np.random.default_rng(29)
    return [etl.events(rng, sessions_each, catalogue, first_session=10_000 + 100 * n,
                       max_len=etl.MAX_LEN) for n in range(n_requests)]


@pytest.mark.parametrize("model_name", ["executor_model", FAST], ids=["nvtabular", "fast-path"])
def test_the_tutorial_pipeline_is_served_as_the_eager_model_answers(tutorial_serving,
                                                                     model_name):
    client, workflow, model, catalogue = tutorial_serving
    unknown = set(catalogue[KNOWN:])
    vocabulary = set(_unique_table(workflow, "item_id"))
    answered = 0
    for request in _requests(catalogue):
        assert set(request["item_id"]) & unknown  # the requests do hold unknown items
        got = infer_dataframe(client, request, model_name=model_name)
        assert sorted(got[etl.SESSION]) == sorted(request[etl.SESSION].unique())
        expected = _reference(workflow, model, request)
        for session, ids, scores in zip(got[etl.SESSION], got["item_ids"],
                                        got["item_id_scores"]):
            seen = set(request.loc[request[etl.SESSION] == session, "item_id"])
            assert set(ids) <= vocabulary and not set(ids) & (unknown | seen)
            np.testing.assert_array_equal(ids, expected[session][0])
            np.testing.assert_allclose(scores, expected[session][1], rtol=1e-5, atol=1e-6)
            answered += 1
    assert answered == 8 * 5
