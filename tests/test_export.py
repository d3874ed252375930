"""What an export writes: no user data from training, and no model left over from an earlier export.

Every test exports with Merlin's own ``Ensemble.export`` and loads the result the way Merlin's
executor model does; the last one serves the repository on a real tritonserver.
"""

import io

import cloudpickle
import numpy as np
import pytest
import torch
from merlin.dag import postorder_iter_nodes
from merlin.systems.dag import Ensemble
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch
from merlin_t4r_ops.serving import triton_server
from merlin_t4r_ops.serving.client import infer_dataframe
from merlin_t4r_ops.training import fit

pytestmark = pytest.mark.usefixtures("no_launcher_env")

# Item ids of the sessions trained on: distinctive as bytes, within the catalogue.
PATTERN = [97, 13, 89, 31, 73, 7, 61, 43]
# Four consecutive ids as the int64 and int32 a tensor would hold them: neither appears by
# chance in float32 weights or in a pickle.
NEEDLES = [np.array(PATTERN[2:6], dtype=dtype).tobytes() for dtype in ("<i8", "<i4")]
SCORE_COLUMN = {"binary": "click/binary_classification_task"}


def _model(kind, seed):
    if kind == "binary":
        return factories.binary_model(seed=seed)
    return factories.next_item_model(kind, seed=seed)


def _pattern_sessions(rows=16):
    rng = np.random.default_rng(0)
    df = factories.random_sessions(rows, rng, min_len=len(PATTERN), max_len=len(PATTERN))
    df["item_id-list"] = [np.array(PATTERN, dtype=np.int64)] * rows
    return df


def _pattern_batch(kind, rows=16):
    clicks = {"click": torch.tensor([i % 2 for i in range(rows)], dtype=torch.float32)}
    return factories.reference_inputs(_pattern_sessions(rows)), clicks if kind == "binary" else None


def _train_on_the_pattern(model, kind):
    """``fit`` for one epoch on the sessions, then T4R's own metrics on them, as its Trainer
    evaluates (they accumulate in the model's torchmetrics)."""
    batch = _pattern_batch(kind)
    fit(model, [batch] * 3, eval_data=[batch], epochs=1, strategy="single", progress=False)
    model.eval()
    with torch.no_grad():
        output = model(batch[0], targets=batch[1], testing=True)
        model.calculate_metrics(output["predictions"], output["labels"])
    return model


def _holds_the_pattern(data: bytes) -> bool:
    return any(needle in data for needle in NEEDLES)


def _files_holding_the_pattern(repo):
    return [str(p.relative_to(repo)) for p in sorted(repo.rglob("*"))
            if p.is_file() and _holds_the_pattern(p.read_bytes())]


def _export(model, path, **op_kwargs):
    op = PredictT4RPyTorch(model, **op_kwargs)
    Ensemble(model.input_schema.column_names >> op, model.input_schema).export(str(path))
    return op


def _ensemble_dir(repo):
    return repo / "executor_model" / "1" / "ensemble"


def _served_scores(ensemble, df, kind):
    column = SCORE_COLUMN.get(kind, "next-item")
    return np.asarray(ensemble.transform(TensorTable.from_df(df))[column].values)


def _eager(model, df, kind):
    scores = factories.eager_scores(model, df)
    return scores.reshape(-1) if kind == "binary" else scores


# -- defect 1: the last batch's sessions stay out of every exported file ----------------------

@pytest.mark.parametrize("kind", ["xlnet-causal", "bert", "binary"])
def test_no_exported_file_holds_the_sessions_the_model_was_trained_on(tmp_path, kind):
    model = _train_on_the_pattern(_model(kind, seed=51), kind)
    live = io.BytesIO()
    torch.save(model, live, pickle_module=cloudpickle)
    assert _holds_the_pattern(live.getvalue()), "the trained model itself carries the sessions"

    _export(model, tmp_path)
    exported = {p.name for p in tmp_path.rglob("*")}
    assert {"ensemble.pkl", "module.pt", "weights.pt", "config.pbtxt"} <= exported
    assert _files_holding_the_pattern(tmp_path) == []

    df = factories.random_sessions(9, np.random.default_rng(2))
    served = _served_scores(factories.load_exported(_ensemble_dir(tmp_path)), df, kind)
    np.testing.assert_allclose(served, _eager(model, df, kind), rtol=1e-6, atol=1e-7)


def test_in_process_inference_before_export_leaves_no_request_in_the_export(tmp_path):
    model = factories.next_item_model("xlnet-causal", seed=53)
    op = PredictT4RPyTorch(model, top_k=5)
    ensemble = Ensemble(model.input_schema.column_names >> op, model.input_schema)
    ensemble.transform(TensorTable.from_df(_pattern_sessions()))  # a request, in process
    ensemble.export(str(tmp_path))
    assert _files_holding_the_pattern(tmp_path) == []


def test_the_exported_structure_keeps_no_tensor_outside_parameters_and_buffers(tmp_path):
    """Nor the metric states that evaluation fed: torchmetrics keeps them as attributes."""
    model = _train_on_the_pattern(_model("xlnet-causal", seed=52), "xlnet-causal")
    _export(model, tmp_path)
    module_file = next(tmp_path.rglob("module.pt"))
    structure = torch.load(module_file, map_location="cpu", weights_only=False)
    leftovers = sorted(
        f"{name}.{attr}"
        for name, module in structure.named_modules()
        for attr, value in vars(module).items()
        # a metric's defaults (zeros, empty lists) are what it was built with
        if attr not in ("_parameters", "_buffers", "_modules", "_defaults")
        and any(torch.count_nonzero(t) > 0 for t in _tensors(value))
    )
    assert leftovers == []
    # The user's own model is left as it was.
    assert model.heads[0].body[0].to_merge["categorical_module"].item_seq is not None


def _tensors(value):
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return [torch.as_tensor(value)]
    if isinstance(value, (list, tuple, set)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


# -- defect 15: an export replaces what this package wrote before, and nothing else -----------

def _folders(repo):
    return sorted(p.name for p in _ensemble_dir(repo).glob("t4r_model_*"))


def test_re_exporting_into_a_directory_replaces_the_earlier_model(tmp_path):
    _export(factories.binary_model(seed=61), tmp_path)
    newer = factories.binary_model(seed=62)
    op = _export(newer, tmp_path)
    assert _folders(tmp_path) == [op._artifact_dir]
    df = factories.random_sessions(7, np.random.default_rng(3))
    served = _served_scores(factories.load_exported(_ensemble_dir(tmp_path)), df, "binary")
    np.testing.assert_allclose(served, _eager(newer, df, "binary"), rtol=1e-6)


def _two_model_ensemble():
    binary = factories.binary_model(seed=63)
    next_item = factories.next_item_model("gpt2", seed=64)
    ops = PredictT4RPyTorch(binary), PredictT4RPyTorch(next_item)
    columns = binary.input_schema.column_names
    ensemble = Ensemble((columns >> ops[0]) + (columns >> ops[1]), binary.input_schema)
    return ensemble, (binary, next_item), ops


def test_two_operators_of_one_ensemble_keep_each_others_folders(tmp_path):
    ensemble, (binary, next_item), ops = _two_model_ensemble()
    ensemble.export(str(tmp_path))
    assert _folders(tmp_path) == sorted(op._artifact_dir for op in ops)
    loaded = factories.load_exported(_ensemble_dir(tmp_path))
    df = factories.random_sessions(6, np.random.default_rng(4))
    out = loaded.transform(TensorTable.from_df(df))
    np.testing.assert_allclose(np.asarray(out[SCORE_COLUMN["binary"]].values),
                               _eager(binary, df, "binary"), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["next-item"].values),
                               _eager(next_item, df, "gpt2"), rtol=1e-6)

    again, _, new_ops = _two_model_ensemble()
    again.export(str(tmp_path))
    assert _folders(tmp_path) == sorted(op._artifact_dir for op in new_ops)


def test_the_same_ensemble_exported_twice_keeps_its_folder(tmp_path):
    model = factories.binary_model(seed=65)
    op = PredictT4RPyTorch(model)
    ensemble = Ensemble(model.input_schema.column_names >> op, model.input_schema)
    ensemble.export(str(tmp_path))
    ensemble.export(str(tmp_path))
    assert _folders(tmp_path) == [op._artifact_dir]
    factories.load_exported(_ensemble_dir(tmp_path))


def test_a_re_export_after_two_identical_exports_replaces_their_folder(tmp_path):
    """Exporting one ensemble twice writes the same ensemble.pkl; the next export of another
    graph still removes the folder the earlier graph wrote (a digest of the pickle could not
    tell the two earlier exports apart)."""
    model = factories.binary_model(seed=68)
    ensemble = Ensemble(model.input_schema.column_names >> PredictT4RPyTorch(model),
                        model.input_schema)
    ensemble.export(str(tmp_path))
    ensemble.export(str(tmp_path))
    new = _export(factories.binary_model(seed=69), tmp_path)
    assert _folders(tmp_path) == [new._artifact_dir]


def test_an_export_removes_nothing_it_did_not_write(tmp_path):
    old = _export(factories.binary_model(seed=66), tmp_path)
    ensemble_dir = _ensemble_dir(tmp_path)
    (ensemble_dir / "NOTES.txt").write_text("the user's")
    lookalike = ensemble_dir / "t4r_model_0123456789ab"  # our name, not our manifest
    lookalike.mkdir()
    (lookalike / "weights.pt").write_text("the user's")
    (ensemble_dir / old._artifact_dir / "README").write_text("the user's, inside our folder")

    new = _export(factories.binary_model(seed=67), tmp_path)
    assert (ensemble_dir / "NOTES.txt").read_text() == "the user's"
    assert (lookalike / "weights.pt").read_text() == "the user's"
    kept = sorted(p.name for p in (ensemble_dir / old._artifact_dir).iterdir())
    assert kept == ["README"]  # our files went, the stranger's stayed
    assert new._artifact_dir in _folders(tmp_path)


# -- one model object behind two operators: written once, loaded once -------------------------

def _weights_files(repo):
    return list(_ensemble_dir(repo).rglob("weights.pt"))


def test_one_model_behind_two_operators_is_written_once(tmp_path):
    model = factories.next_item_model("gpt2", seed=81)
    factories.two_top_ks_ensemble(model).export(str(tmp_path / "one"))
    assert len(_weights_files(tmp_path / "one")) == 1

    other = factories.next_item_model("gpt2", seed=82)
    columns = model.input_schema.column_names
    two_models = ((columns >> PredictT4RPyTorch(model, top_k=20, output_prefix="a_"))
                  + (columns >> PredictT4RPyTorch(other, top_k=5, output_prefix="b_")))
    Ensemble(two_models, model.input_schema).export(str(tmp_path / "two"))
    assert len(_weights_files(tmp_path / "two")) == 2

    # A re-export into the first directory still replaces the earlier export's folder.
    factories.two_top_ks_ensemble(other).export(str(tmp_path / "one"))
    assert len(_weights_files(tmp_path / "one")) == 1
    assert len(_folders(tmp_path / "one")) == 1


def test_one_model_behind_two_operators_is_loaded_once_and_answers_as_eager(tmp_path):
    model = factories.next_item_model("gpt2", seed=83)
    factories.two_top_ks_ensemble(model).export(str(tmp_path))
    loaded = factories.load_exported(_ensemble_dir(tmp_path))  # as Triton's executor does

    ops = [node.op for node in postorder_iter_nodes(loaded.graph.output_node)
           if isinstance(node.op, PredictT4RPyTorch)]
    assert len(ops) == 2 and ops[0].model is ops[1].model

    df = factories.random_sessions(9, np.random.default_rng(6))
    out = loaded.transform(TensorTable.from_df(df))
    for prefix, k in (("a_", 20), ("b_", 5)):
        ids, scores = factories.reference_top_k(factories.eager_scores(model, df), k)
        np.testing.assert_array_equal(np.asarray(out[f"{prefix}item_ids"].values), ids)
        np.testing.assert_allclose(np.asarray(out[f"{prefix}item_id_scores"].values), scores,
                                   rtol=1e-6, atol=1e-7)


# -- on a real tritonserver ---------------------------------------------------------------------

def test_a_re_exported_repository_of_a_trained_model_serves_it_without_its_sessions(tmp_path):
    _export(_train_on_the_pattern(_model("xlnet-causal", seed=71), "xlnet-causal"), tmp_path)
    model = _train_on_the_pattern(_model("xlnet-causal", seed=72), "xlnet-causal")
    op = _export(model, tmp_path)
    assert _folders(tmp_path) == [op._artifact_dir]
    assert _files_holding_the_pattern(tmp_path) == []

    df = factories.random_sessions(11, np.random.default_rng(5))
    with triton_server(tmp_path, timeout=120) as server:
        served = infer_dataframe(server.client(), df)
        # The args Triton really passes were read (KIND_AUTO is a GPU instance where there is one).
        where = "KIND_GPU, device 0) runs on cuda:0" if torch.cuda.is_available() else \
            "KIND_CPU, device 0) runs on cpu"
        assert f"PredictT4RPyTorch in executor_model_0_0 ({where}" in server.logs()
    np.testing.assert_allclose(np.stack(served["next-item"].to_list()),
                               factories.eager_scores(model, df), rtol=1e-5, atol=1e-6)
