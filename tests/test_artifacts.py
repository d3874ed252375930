"""Exported weights and modules are checked against their manifest before anything loads."""

import hashlib
import json
import os
import pickle
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from merlin.systems.dag import Ensemble
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import ArtifactError, PredictT4RPyTorch, ServerStartError
from merlin_t4r_ops.ops.artifacts import load_model, read_checked, save_model, write_checked
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


# -- each file is read once, and only the files the saver writes ------------------------------

class _OpenWatch:
    """Records, through Python's audit events (PEP 578), every file opened under a directory.

    ``on_reopen(path)`` runs when a file is opened a second time: the moment an attacker
    would swap it between the check and the load.
    """

    current = None

    def __init__(self, root, on_reopen=None):
        self.root = os.path.abspath(root)
        self.opened = []
        self.on_reopen = on_reopen
        self._busy = False

    def __enter__(self):
        _OpenWatch.current = self
        return self

    def __exit__(self, *exc):
        _OpenWatch.current = None

    def count(self, path):
        return self.opened.count(os.path.abspath(path))

    def saw(self, path):
        if self._busy or not path.startswith(self.root):
            return
        self._busy = True  # the swap below opens files too
        try:
            self.opened.append(path)
            if self.on_reopen is not None and self.opened.count(path) == 2:
                self.on_reopen(path)
        finally:
            self._busy = False


def _audit(event, args):
    watch = _OpenWatch.current
    if watch is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        watch.saw(os.path.abspath(os.fsdecode(args[0])))


@pytest.fixture(scope="module")
def audit_hook():
    sys.addaudithook(_audit)  # for the process; inert while no _OpenWatch is current


def test_the_loader_opens_each_file_once_so_a_swap_after_the_check_is_never_loaded(
        saved, tmp_path_factory, audit_hook):
    model, path = saved
    other = factories.next_item_model("gpt2", seed=99)
    swapped = tmp_path_factory.mktemp("attacker") / "weights.pt"
    torch.save({k: v.detach() for k, v in other.state_dict().items()}, swapped)

    def swap(opened):  # replace whatever is opened again by weights of another model
        if opened.endswith("weights.pt"):
            os.replace(swapped, opened)

    with _OpenWatch(path, on_reopen=swap) as watch:
        loaded = load_model(path, torch.device("cpu"))
    df = factories.random_sessions(5, np.random.default_rng(1))
    np.testing.assert_array_equal(factories.eager_scores(loaded, df),
                                  factories.eager_scores(model, df))
    opened = [watch.count(path / n) for n in ("manifest.json", "module.pt", "weights.pt")]
    assert opened == [1, 1, 1]


def _list_in_manifest(directory, name, target):
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = Path(target).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "etc_passwd"])
def test_a_manifest_naming_a_file_outside_is_refused_before_it_is_opened(
        saved, tmp_path_factory, audit_hook, kind):
    _, path = saved
    outside = tmp_path_factory.mktemp("outside") / "secret.bin"
    outside.write_bytes(b"not an artifact")
    name, target = {
        "dotdot": (os.path.relpath(outside, path), outside),
        "absolute": (str(outside), outside),
        "etc_passwd": ("/etc/passwd", "/etc/passwd"),
    }[kind]
    if not os.path.isfile(target):
        pytest.skip(f"{target} does not exist here")
    _list_in_manifest(path, name, target)  # with the right size and digest
    with _OpenWatch("/") as watch:
        with pytest.raises(ArtifactError, match=rf"manifest.json names {re.escape(repr(name))}, "
                                                r"which is not a plain file name"):
            load_model(path, torch.device("cpu"))
    assert watch.count(target) == 0


def test_a_manifest_listing_a_file_the_saver_does_not_write_is_refused(saved):
    _, path = saved
    (path / "extra.bin").write_bytes(b"x")
    _list_in_manifest(path, "extra.bin", path / "extra.bin")
    with pytest.raises(ArtifactError, match=r"manifest.json lists 'extra.bin', which is not "
                                            r"one of the files expected here "
                                            r"\(module.pt, weights.pt\)"):
        load_model(path, torch.device("cpu"))


def test_read_checked_returns_the_bytes_write_checked_wrote(tmp_path):
    files = {"categories.parquet": b"\x00PAR1" * 100, "notes.txt": b""}
    write_checked(tmp_path, files)
    assert read_checked(tmp_path, ["notes.txt", "categories.parquet"]) == files
    with pytest.raises(ArtifactError, match=r"manifest.json lists 'notes.txt', which is not one "
                                            r"of the files expected here \(categories.parquet\)"):
        read_checked(tmp_path, ["categories.parquet"])
    with pytest.raises(ArtifactError, match=r"manifest.json does not list vocab.json"):
        read_checked(tmp_path, ["categories.parquet", "notes.txt", "vocab.json"])


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "manifest.json", ".hidden", ""])
def test_write_checked_accepts_only_plain_file_names(tmp_path, name):
    with pytest.raises(ArtifactError, match=rf"write_checked names {re.escape(repr(name))}"):
        write_checked(tmp_path / "out", {name: b"x"})
    assert not (tmp_path / "out").exists()


def test_a_file_longer_than_the_manifest_says_is_refused(saved):
    _, path = saved
    with open(path / "module.pt", "ab") as stream:
        stream.write(b"tail")
    with pytest.raises(ArtifactError, match=r"module.pt is longer, the manifest expects \d+ bytes"):
        load_model(path, torch.device("cpu"))


def test_a_fifo_in_place_of_an_artifact_is_refused_without_hanging(saved):
    _, path = saved
    (path / "weights.pt").unlink()
    os.mkfifo(path / "weights.pt")
    with pytest.raises(ArtifactError, match=r"weights.pt is not a regular file"):
        load_model(path, torch.device("cpu"))


def test_written_artifacts_are_readable_by_a_server_running_as_another_user(tmp_path):
    # mkstemp's 0600 would leave a Triton that runs as another user unable to load them.
    write_checked(tmp_path, {"a.bin": b"x"})
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o044 == 0o044, f"{path.name} is {oct(path.stat().st_mode)}"
