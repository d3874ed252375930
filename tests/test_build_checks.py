"""What the graph knows, checked when the ensemble is built: T4R's tutorial ETL and schema.

The model is built as T4R's tutorials build it, from ``schema.pbtxt`` read with
``merlin_standard_lib`` (fixture ``tutorial``). That schema reaches the model without
Categorify's properties and with ``int_domain`` instead of ``domain``; the workflow in front,
a ``DecodeItemIds`` behind and the model's own embedding tables say what is true.
"""

import numpy as np
import pandas as pd
import pytest
import torch

import tutorial_factories as etl
from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch
from merlin_t4r_ops.errors import InvalidRequestError, SchemaMismatchError

RESERVED = (0, 1, 2)  # NVTabular 23.08 Categorify: padding, null, out-of-vocabulary


def _catalogue(model) -> int:
    return int(model.output_schema.first.shape.dims[1].max)


def _encoded_sessions(tutorial) -> pd.DataFrame:
    from merlin.io import Dataset

    frame = tutorial["workflow"].transform(Dataset(tutorial["events"]))
    return frame.to_ddf().compute()[[etl.ITEM, etl.CATEGORY]].head(40)


def _all_ids(frame: pd.DataFrame, column: str = "item_ids") -> np.ndarray:
    return np.concatenate([np.asarray(row) for row in frame[column]])


def test_the_workflow_in_front_reserves_categorifys_ids(tutorial):
    """A top-k as wide as every non-reserved id: with only id 0 masked (the standard_lib
    schema's say), Categorify's null and OOV ids 1 and 2 would fill the last slots."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    workflow, model = tutorial["workflow"], tutorial["model"]
    top_k = _catalogue(model) - len(RESERVED)
    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow)
                >> PredictT4RPyTorch(model, top_k=top_k))
    answer = Ensemble(pipeline, workflow.input_schema).transform(tutorial["events"].head(200))
    ids = _all_ids(answer)
    assert len(answer) and not np.isin(ids, RESERVED).any()
    assert set(ids) == set(range(len(RESERVED), _catalogue(model)))


def test_decode_item_ids_behind_reserves_categorifys_ids(tutorial):
    """Encoded sessions in, raw ids out: DecodeItemIds' vocabulary says which ids have no
    item, and every row is answered."""
    from merlin.systems.dag import Ensemble

    workflow, model = tutorial["workflow"], tutorial["model"]
    top_k = _catalogue(model) - len(RESERVED)
    sessions = _encoded_sessions(tutorial)
    decoder = DecodeItemIds(workflow)
    pipeline = model.input_schema.column_names >> PredictT4RPyTorch(model, top_k=top_k) >> decoder
    answer = Ensemble(pipeline, model.input_schema).transform(sessions)
    assert len(answer) == len(sessions)
    assert set(_all_ids(answer)) == set(decoder.vocabulary.raw_ids)


def test_an_id_beyond_the_embedding_table_is_refused_by_name(tutorial):
    """The standard_lib schema's ``int_domain`` is lost on the way to merlin.schema; the
    embedding table's rows bound the ids instead (on CUDA an id beyond it is a device-side
    assert)."""
    model = tutorial["model"]
    sessions = _encoded_sessions(tutorial).head(3).copy()
    rows = _catalogue(model)
    sessions[etl.ITEM] = [np.array([5, rows], dtype=np.int64)] * len(sessions)
    sessions[etl.CATEGORY] = [np.array([3, 3], dtype=np.int64)] * len(sessions)
    op = PredictT4RPyTorch(model, top_k=5)
    with pytest.raises(InvalidRequestError,
                       match=rf"input '{etl.ITEM}': ids must be < {rows} .*got {rows}"):
        op.transform(None, sessions)


@pytest.fixture(scope="module")
def smaller_workflow(tmp_path_factory):
    """The tutorial ETL fitted on other events, with fewer items: another vocabulary size."""
    from merlin.io import Dataset

    rng = np.random.default_rng(3)
    workflow = etl.tutorial_workflow(tmp_path_factory.mktemp("smaller"))
    workflow.fit(Dataset(etl.events(rng, 60, etl.item_catalogue(20))))
    return workflow


def test_a_workflow_whose_vocabulary_misses_the_embedding_table_fails_the_build(
        tutorial, smaller_workflow):
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    model = tutorial["model"]
    pipeline = (smaller_workflow.input_schema.column_names
                >> TransformWorkflow(smaller_workflow) >> PredictT4RPyTorch(model, top_k=5))
    with pytest.raises(SchemaMismatchError, match=(
            rf"column '{etl.ITEM}': the graph .* holds ids 0 to \d+ \(\d+ ids\), the "
            rf"model's embedding table for it has {_catalogue(model)} rows")):
        Ensemble(pipeline, smaller_workflow.input_schema)


def test_a_decoder_whose_vocabulary_misses_the_embedding_table_fails_the_build(
        tutorial, smaller_workflow):
    from merlin.systems.dag import Ensemble

    model = tutorial["model"]
    pipeline = (model.input_schema.column_names >> PredictT4RPyTorch(model, top_k=5)
                >> DecodeItemIds(smaller_workflow))
    with pytest.raises(SchemaMismatchError, match=(
            rf"vocabulary of '{etl.ITEM}', which encodes ids 0 to \d+ .* item embedding "
            rf"table has {_catalogue(model)} rows")):
        Ensemble(pipeline, model.input_schema)


def _as_scalar(schema, name):
    from merlin.schema import Schema

    return Schema([column.with_shape((None,)) if column.name == name else column
                   for column in schema])


def test_a_scalar_column_for_a_list_input_fails_the_build(tutorial):
    """The graph hands over one value per row where the input block takes a session."""
    from merlin.systems.dag import Ensemble

    model = tutorial["model"]
    scalar = _as_scalar(model.input_schema, etl.CATEGORY)
    with pytest.raises(SchemaMismatchError, match=(
            rf"column '{etl.CATEGORY}': the graph .* declares a scalar .*, the model's "
            r"input block takes a list \(input_size \[-1, 20\]\)")):
        Ensemble(scalar.column_names >> PredictT4RPyTorch(model, top_k=5), scalar)


def test_an_input_schema_that_calls_a_list_input_scalar_is_refused(tutorial):
    model = tutorial["model"]
    with pytest.raises(SchemaMismatchError, match=(
            rf"column '{etl.ITEM}': the operator's input schema declares a scalar")):
        PredictT4RPyTorch(model, _as_scalar(model.input_schema, etl.ITEM), top_k=5)


def test_a_list_for_a_scalar_input_is_refused(served_models):
    """The reverse: a session-level feature (one device per session) sent as a list."""
    from merlin.schema import Schema

    model = served_models["session_scalar"]
    listed = Schema([column.with_shape((None, None)) if column.name == "device" else column
                     for column in model.input_schema])
    with pytest.raises(SchemaMismatchError, match=(
            r"column 'device': the operator's input schema declares a list, the model's input "
            r"block takes a scalar")):
        PredictT4RPyTorch(model, listed)


def test_a_model_reading_columns_the_workflow_does_not_write_fails_the_build(
        tutorial, served_models):
    """A model of other column names (``item_id-list``) behind the tutorial's workflow
    (``item_id-list_seq``): named with what the workflow writes."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    workflow = tutorial["workflow"]
    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow)
                >> PredictT4RPyTorch(served_models["next_item_full"]))
    with pytest.raises(SchemaMismatchError, match=(
            r"needs column 'item_id-list', which the graph does not produce; the parent "
            rf"produces \['{etl.SESSION}', '{etl.ITEM}', '{etl.CATEGORY}'\]")):
        Ensemble(pipeline, workflow.input_schema)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU, torch sees none")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_an_id_beyond_the_table_is_refused_and_the_device_keeps_working(tutorial):
    """Before the fix the id reached the embedding lookup: a device-side assert, after which
    every CUDA call of the process fails."""
    import copy

    model = copy.deepcopy(tutorial["model"]).cuda()
    sessions = _encoded_sessions(tutorial).head(4)
    op = PredictT4RPyTorch(model, top_k=5)
    bad = sessions.copy()
    bad[etl.ITEM] = [np.array([5, _catalogue(model) + 7], dtype=np.int64)] * len(bad)
    with pytest.raises(InvalidRequestError, match="embedding table"):
        op.transform(None, bad)
    assert len(op.transform(None, sessions)) == len(sessions)


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_graphs_captured_before_the_build_mask_the_ids_the_graph_reserves(tutorial):
    """The operator answers in process first (its CUDA graphs captured with only id 0
    reserved), then joins an ensemble whose workflow reserves 1 and 2 too."""
    import copy

    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    workflow, model = tutorial["workflow"], copy.deepcopy(tutorial["model"]).cuda()
    top_k = _catalogue(model) - len(RESERVED)
    op = PredictT4RPyTorch(model, top_k=top_k, cuda_graph_buckets=(1, 64))
    op.transform(None, _encoded_sessions(tutorial).head(1))  # captures the graphs
    pipeline = workflow.input_schema.column_names >> TransformWorkflow(workflow) >> op
    answer = Ensemble(pipeline, workflow.input_schema).transform(tutorial["events"].head(100))
    assert len(answer) and not np.isin(_all_ids(answer), RESERVED).any()
