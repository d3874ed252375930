"""Checkpoints: weights-only loadable, atomic, and resuming reproduces an uninterrupted run."""

import os
import signal
import subprocess
import sys

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.errors import ArtifactError, CheckpointError
from merlin_t4r_ops.training import DistributedState, fit, load_checkpoint
from merlin_t4r_ops.training.checkpoint import CHECKPOINT_NAME, rng_state, set_rng_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = DistributedState("single", 0, 0, 1, torch.device("cpu"), "tests run on CPU")
EPOCHS = 3


def train(data, epochs, ckpt=None, resume=False, model_seed=0):
    # MLM masking draws random positions every step, so equality after resume
    # needs the RNG streams restored, not just weights and optimizer.
    model = factories.build_model("next-item", masking="mlm", seed=model_seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    history = fit(model, data, optimizer=optimizer, lr_scheduler=scheduler, epochs=epochs,
                  strategy=STATE, seed=7, checkpoint_dir=ckpt, resume=resume, progress=False)
    return model, history


def assert_close_weights(a, b):
    for name, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[name], msg=name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return factories.write_sessions(str(tmp_path_factory.mktemp("ckpt") / "train"), 96, seed=0)


@pytest.fixture(scope="module")
def uninterrupted(data):
    return train(data, EPOCHS)


def test_resume_after_epoch_matches_uninterrupted_run(data, uninterrupted, tmp_path):
    full, full_history = uninterrupted
    train(data, 1, ckpt=tmp_path)
    # A different init proves the weights come from the checkpoint.
    resumed, history = train(data, EPOCHS, ckpt=tmp_path, resume=True, model_seed=123)
    assert_close_weights(resumed, full)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert [h["lr"] for h in history] == pytest.approx([h["lr"] for h in full_history])
    assert history[-1]["train_loss"] == pytest.approx(full_history[-1]["train_loss"])


def test_resume_without_rng_states_diverges(data, uninterrupted, tmp_path):
    """Control: the equality above depends on restoring RNG states, so the test can fail."""
    full, _ = uninterrupted
    train(data, 1, ckpt=tmp_path)
    path = tmp_path / CHECKPOINT_NAME
    payload = torch.load(path, weights_only=True)
    payload["rng"] = []
    torch.save(payload, path)
    resumed, _ = train(data, EPOCHS, ckpt=tmp_path, resume=True)
    assert any(
        not torch.allclose(v, full.state_dict()[k]) for k, v in resumed.state_dict().items()
    )


def test_killed_run_resumes_to_the_same_weights(data, uninterrupted, tmp_path):
    full, _ = uninterrupted
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "training_scripts", "fit_killed.py"),
         "--train", data, "--checkpoint-dir", str(tmp_path), "--epochs", str(EPOCHS),
         "--kill-after", "2"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert load_checkpoint(tmp_path)["epoch"] == 2
    resumed, history = train(data, EPOCHS, ckpt=tmp_path, resume=True, model_seed=5)
    assert_close_weights(resumed, full)
    assert len(history) == EPOCHS


def test_checkpoint_is_weights_only_loadable_and_complete(data, tmp_path):
    model, history = train(data, 1, ckpt=tmp_path)
    # The checkpoint and fit's log (TensorBoard's runs/ where installed), no temporary file.
    assert {CHECKPOINT_NAME, "log.csv"} <= set(os.listdir(tmp_path)) <= {
        CHECKPOINT_NAME, "log.csv", "runs"}
    payload = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    assert payload["epoch"] == 1 and payload["world_size"] == 1
    assert set(payload) >= {"model", "optimizer", "lr_scheduler", "rng", "history"}
    assert payload["history"] == history
    fresh = factories.build_model("next-item", masking="mlm", seed=9)
    fresh.load_state_dict(payload["model"])
    assert_close_weights(fresh, model)


def test_resume_with_empty_dir_starts_fresh_and_finished_run_is_a_no_op(data, uninterrupted, tmp_path):
    full, _ = uninterrupted
    model, history = train(data, EPOCHS, ckpt=tmp_path, resume=True)
    assert_close_weights(model, full)
    again, history2 = train(data, EPOCHS, ckpt=tmp_path, resume=True, model_seed=4)
    assert history2 == history
    assert_close_weights(again, full)


def test_rng_state_round_trip():
    saved = rng_state()
    a = (torch.rand(3), __import__("numpy").random.rand(3), __import__("random").random())
    set_rng_state(saved)
    b = (torch.rand(3), __import__("numpy").random.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2]


def test_unreadable_checkpoint_raises(tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(tmp_path)
    assert issubclass(CheckpointError, ArtifactError)
    torch.save({"format": 99}, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError, match="expected format 1, found 99"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "missing") is None


class Preempted(Exception):
    """Stands for the process being stopped after a given optimizer step."""


def fit_testing_data(frame, ckpt, stop_after=None, model_seed=0, resume=False, num_workers=0):
    """``fit`` an MLM model on T4R's packaged sessions, 2 epochs of 10 steps, last.pt every 3.

    The step-interval scheduler (constant lr) raises :class:`Preempted` after ``stop_after``
    optimizer steps, before that step's checkpoint is written.
    """
    model = factories.testing_model("mlm", seed=model_seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = []

    def constant(_):
        steps.append(None)
        if stop_after is not None and len(steps) > stop_after:  # the first call is at init
            raise Preempted
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, constant)
    history = fit(model, factories.testing_dataset(frame), optimizer=optimizer, epochs=2,
                  batch_size=16, strategy=STATE, seed=3, progress=False, checkpoint_dir=ckpt,
                  save_steps=3, resume=resume, lr_scheduler=scheduler,
                  lr_scheduler_interval="step", num_workers=num_workers)
    return model, history


@pytest.mark.parametrize("stop_after, saved_at, num_workers",
                         [(7, (0, 6), 0), (14, (1, 3), 0), (7, (0, 6), 2)],
                         ids=["epoch-1-step-6", "epoch-2-step-3", "epoch-1-step-6-2-workers"])
def test_fit_resumed_mid_epoch_ends_on_the_uninterrupted_weights(stop_after, saved_at,
                                                                 num_workers, tmp_path):
    frame = factories.testing_frame().iloc[:160]
    expected, full_history = fit_testing_data(frame, tmp_path / "full")
    with pytest.raises(Preempted):
        fit_testing_data(frame, tmp_path / "run", stop_after=stop_after, num_workers=num_workers)
    saved = load_checkpoint(tmp_path / "run")
    assert (saved["epoch"], saved["step"]) == saved_at  # (completed epochs, steps into the next)
    resumed, history = fit_testing_data(frame, tmp_path / "run", model_seed=9, resume=True,
                                        num_workers=num_workers)
    assert_close_weights(resumed, expected)
    assert [h["train_samples"] for h in history] == [h["train_samples"] for h in full_history]
    for ours, theirs in zip(history, full_history):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-6)
