"""Exported weights and modules are checked against their manifest before anything loads."""

import os
import pickle

import numpy as np
import pytest
import torch
from merlin.systems.dag import Ensemble
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import ArtifactError, PredictT4RPyTorch, ServerStartError
from merlin_t4r_ops.ops.artifacts import load_model, save_model
from merlin_t4r_ops.serving import triton_server


@pytest.fixture()
def saved(tmp_path):
    model = factories.next_item_model("gpt2", seed=21)
    save_model(model, tmp_path)
    return model, tmp_path


def test_round_trip_gives_the_same_scores(saved):
    model, path = saved
    loaded = load_model(path, torch.device("cpu"))
    df = factories.random_sessions(9, np.random.default_rng(0))
    np.testing.assert_array_equal(factories.eager_scores(loaded, df),
                                  factories.eager_scores(model, df))


def test_module_file_holds_no_weights(saved):
    model, path = saved
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (path / "module.pt").stat().st_size < weights / 2


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["weights.pt", "module.pt"])
def test_changed_file_is_refused_by_name(saved, name):
    _, path = saved
    _flip_a_byte(path / name)
    with pytest.raises(ArtifactError, match=rf"{name} has SHA-256 .* changed after export"):
        load_model(path, torch.device("cpu"))


@pytest.mark.parametrize("name", ["weights.pt", "module.pt"])
def test_truncated_file_is_refused_by_name(saved, name):
    _, path = saved
    with open(path / name, "r+b") as stream:
        stream.truncate(100)
    with pytest.raises(ArtifactError, match=rf"{name} is 100 bytes, the manifest expects"):
        load_model(path, torch.device("cpu"))


def test_missing_manifest_is_refused(saved):
    _, path = saved
    (path / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"manifest.json is missing"):
        load_model(path, torch.device("cpu"))


class _Tripwire:
    """Unpickling this writes a file: the proof that a pickle was (or was not) loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_swapped_module_pickle_is_never_unpickled(saved, tmp_path_factory):
    _, path = saved
    marker = tmp_path_factory.mktemp("tripwire") / "unpickled"
    (path / "module.pt").write_bytes(pickle.dumps(_Tripwire(str(marker))))
    with pytest.raises(ArtifactError, match=r"module.pt"):
        load_model(path, torch.device("cpu"))
    assert not marker.exists()


def test_tampered_repository_fails_to_load_on_triton_naming_the_file(tmp_path):
    model = factories.binary_model(seed=22)
    repo = tmp_path / "repo"
    op = PredictT4RPyTorch(model)
    Ensemble(model.input_schema.column_names >> op, model.input_schema).export(str(repo))
    weights = next(repo.glob("executor_model/1/ensemble/t4r_model_*/weights.pt"))
    _flip_a_byte(weights)
    with pytest.raises(ServerStartError, match=r"weights.pt has SHA-256"):
        with triton_server(repo, timeout=120):
            pass


def test_in_process_transform_after_export_still_uses_the_model(tmp_path):
    model = factories.binary_model(seed=23)
    op = PredictT4RPyTorch(model)
    ensemble = Ensemble(model.input_schema.column_names >> op, model.input_schema)
    ensemble.export(str(tmp_path))
    df = factories.random_sessions(4, np.random.default_rng(3))
    out = ensemble.transform(TensorTable.from_df(df))
    np.testing.assert_allclose(out["click/binary_classification_task"].values,
                               factories.eager_scores(model, df).reshape(-1), rtol=1e-6)
    assert os.path.isdir(tmp_path / "executor_model")


def test_ensemble_pickle_never_holds_the_weights_even_after_inference(tmp_path):
    model = factories.next_item_model("xlnet-causal", seed=24)
    op = PredictT4RPyTorch(model)
    ensemble = Ensemble(model.input_schema.column_names >> op, model.input_schema)
    ensemble.transform(TensorTable.from_df(factories.random_sessions(3, np.random.default_rng(5))))
    ensemble.export(str(tmp_path))
    pickled = (tmp_path / "executor_model/1/ensemble/ensemble.pkl").stat().st_size
    weights = next(tmp_path.glob("executor_model/1/ensemble/t4r_model_*/weights.pt")).stat().st_size
    assert pickled < weights / 4
