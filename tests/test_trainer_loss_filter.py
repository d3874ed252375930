"""Hugging Face's ``logging_nan_inf_filter`` in our Trainer: the same sums, read on the device.

Hugging Face 4.30 asks ``torch.isnan(loss) or torch.isinf(loss)`` on the host after every
step's backward (issue 22: a wait for the GPU each step). The Trainer runs Hugging Face's
loop with that check off and adds, from :class:`LoggedLossFilter`, the value the check
would have added. The GPU side (no wait per step) is in ``test_training_sync_gpu.py``.
"""

import math
import os
import pickle
import sys

import pytest
import torch
from transformers import Trainer as HuggingFaceTrainer
from transformers import TrainerCallback

import t4r_training_factories as factories
from merlin_t4r_ops.training import Trainer
from merlin_t4r_ops.training.loss_filter import LoggedLossFilter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")


def hugging_face_sums(losses, log_after):
    """``tr_loss`` after each step, as Hugging Face 4.30's loop computes it with the filter on."""
    tr_loss, global_step, last_logged, sums = torch.tensor(0.0), 0, 0, []
    for tr_loss_step in losses:
        if torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step):
            tr_loss += tr_loss / (1 + global_step - last_logged)
        else:
            tr_loss += tr_loss_step
        global_step += 1
        sums.append(tr_loss.clone())
        if global_step in log_after:
            tr_loss -= tr_loss
            last_logged = global_step
    return sums


def filtered_sums(losses, log_after):
    """The same loop with the check off, adding what :class:`LoggedLossFilter` returns."""
    tr_loss, global_step, last_logged, sums = torch.tensor(0.0), 0, 0, []
    loss_filter = LoggedLossFilter()
    for tr_loss_step in losses:
        tr_loss += loss_filter(tr_loss_step, global_step - last_logged)
        global_step += 1
        sums.append(tr_loss.clone())
        if global_step in log_after:
            loss_filter.reset()
            tr_loss -= tr_loss
            last_logged = global_step
    return sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_filter_adds_what_hugging_faces_check_adds(dtype):
    generator = torch.Generator().manual_seed(0)
    losses = [x.to(dtype) for x in torch.rand(40, generator=generator) * 9]
    for i, bad in [(0, math.nan), (3, math.inf), (4, math.nan), (11, -math.inf), (20, math.nan),
                   (21, math.nan), (39, math.inf)]:
        losses[i] = torch.tensor(bad, dtype=dtype)
    log_after = {5, 12, 20, 30}  # a log right before a NaN step, and one between two
    expected, got = hugging_face_sums(losses, log_after), filtered_sums(losses, log_after)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e, g), f"step {step}: Hugging Face {e}, filter {g}"
        assert torch.isfinite(g), f"step {step}"


class LoopArgs(TrainerCallback):
    """The arguments Hugging Face's loop reads, as it passes them to callbacks."""

    def __init__(self):
        self.seen = set()

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.add((args.logging_nan_inf_filter, args.ignore_data_skip))


def train(frame, out, **arguments):
    loop = LoopArgs()
    trainer = Trainer(
        model=factories.testing_model("clm"),
        args=make_args(str(out), max_sequence_length=factories.TESTING_MAX_LEN,
                       num_train_epochs=1, logging_steps=3, **arguments),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(frame),
        callbacks=[loop],
    )
    return trainer, trainer.train(), loop.seen


def test_the_trainer_filters_on_the_device_and_keeps_the_users_arguments(tmp_path):
    frame = factories.testing_frame().iloc[:160]
    trainer, filtered, seen = train(frame, tmp_path / "filtered")
    assert seen == {(False, False)}  # Hugging Face's loop never reads a loss on the host
    assert trainer.args.logging_nan_inf_filter is True  # the user's, as given
    _, unfiltered, _ = train(frame, tmp_path / "unfiltered", logging_nan_inf_filter=False)
    # Finite losses: both add each step's loss, in the same order.
    assert filtered.training_loss == unfiltered.training_loss
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h]


class NonFiniteAtSomeSteps(Trainer):
    """Logs a NaN, Inf or -Inf loss at some micro-steps; its gradients stay the true ones."""

    BAD = {2: math.nan, 5: math.inf, 9: -math.inf}

    def compute_loss(self, model, inputs, return_outputs=False):
        loss = super().compute_loss(model, inputs, return_outputs)
        self.calls = getattr(self, "calls", 0) + 1
        bad = self.BAD.get(self.calls)
        return loss if bad is None else loss + torch.tensor(bad)  # a constant: same gradients


class OwnTrainingStep(NonFiniteAtSomeSteps):
    """A subclass that replaces the step (ours bypassed): Hugging Face's own check runs."""

    def training_step(self, model, inputs):
        return HuggingFaceTrainer.training_step(self, model, inputs)


def logged(trainer_class, out, frame):
    loop = LoopArgs()
    trainer = trainer_class(
        model=factories.testing_model("clm"),
        args=make_args(str(out), max_sequence_length=factories.TESTING_MAX_LEN,
                       num_train_epochs=1, gradient_accumulation_steps=2, logging_steps=2),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(frame),
        callbacks=[loop],
    )
    output = trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], output, loop.seen


def test_non_finite_losses_are_logged_as_hugging_faces_own_check_logs_them(tmp_path):
    """10 micro-steps, 2 a step, a log every 2 steps; NaN, Inf and -Inf in three of them."""
    frame = factories.testing_frame().iloc[:160]
    on_device, device_output, device_seen = logged(NonFiniteAtSomeSteps, tmp_path / "a", frame)
    on_host, host_output, host_seen = logged(OwnTrainingStep, tmp_path / "b", frame)
    assert device_seen == {(False, False)} and host_seen == {(True, False)}
    assert on_device == on_host and all(math.isfinite(x) for x in on_device), (on_device, on_host)
    assert device_output.training_loss == host_output.training_loss
    assert math.isfinite(device_output.training_loss)


class SavesArguments(TrainerCallback):
    """What W&B's ``WANDB_LOG_MODEL`` does at the end of a run (``Trainer(args=args, ...)
    .save_model()``, which pickles ``args``), and a callback's write to the arguments."""

    def on_train_end(self, args, state, control, **kwargs):
        self.saved = pickle.loads(pickle.dumps(args))
        args.ignore_data_skip = args.ignore_data_skip  # refused by a read-only view


def test_callbacks_can_pickle_and_write_the_loops_arguments(tmp_path):
    saving = SavesArguments()
    trainer = Trainer(
        model=factories.testing_model("clm"),
        args=make_args(str(tmp_path), max_sequence_length=factories.TESTING_MAX_LEN,
                       num_train_epochs=1),
        strategy="single", schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(factories.testing_frame().iloc[:64]),
        callbacks=[saving],
    )
    trainer.train()
    assert type(saving.saved) is type(trainer.args)  # the user's class, not the loop's view
    assert saving.saved.logging_nan_inf_filter is True  # and the user's flags
    assert saving.saved.to_dict() == trainer.args.to_dict()
