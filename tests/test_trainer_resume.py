"""``Trainer.train(resume_from_checkpoint=...)`` ends on the uninterrupted run's weights.

T4R's packaged ``tabular_sequence_testing_data`` (the first 160 sessions, 4 partitions,
10 batches of 16 per epoch, shuffled), an MLM model (the masks draw from torch's RNG),
2 epochs with a checkpoint every 5 steps: checkpoint-5 is mid-epoch, checkpoint-10 an
epoch boundary. Before: "'ShardedLoader' object has no attribute 'sampler'" mid-epoch
(accelerate's ``skip_first_batches``) and "Weights only load failed" at the boundary
(Hugging Face's ``rng_state.pth`` read with ``torch.load``'s ``weights_only=True``).
"""

import os
import sys

import pytest
import torch

import t4r_training_factories as factories
from torchrun_launch import torchrun
from merlin_t4r_ops.training import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")


def run(frame, out, model_seed=0, resume=None):
    trainer = Trainer(
        model=factories.testing_model("mlm", seed=model_seed),
        args=make_args(str(out), max_sequence_length=factories.TESTING_MAX_LEN,
                       num_train_epochs=2, save_strategy="steps", save_steps=5),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(frame),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model.state_dict(), trainer.state.global_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    frame = factories.testing_frame().iloc[:160]
    out = tmp_path_factory.mktemp("uninterrupted")
    weights, steps = run(frame, out)
    assert steps == 20
    return frame, out, weights


@pytest.mark.parametrize("checkpoint", ["checkpoint-5", "checkpoint-10"],
                         ids=["mid-epoch", "epoch-boundary"])
def test_resumed_trainer_ends_on_the_uninterrupted_weights(uninterrupted, checkpoint, tmp_path):
    frame, out, expected = uninterrupted
    weights, steps = run(frame, tmp_path, model_seed=7, resume=str(out / checkpoint))
    assert steps == 20
    # Checkpoints save the user's arguments, not the resumed loop's (our own test's file).
    saved = torch.load(tmp_path / "checkpoint-15" / "training_args.bin", weights_only=False)
    assert saved.ignore_data_skip is False
    assert weights.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resumed_ddp_trainer_ends_on_the_uninterrupted_weights(tmp_path):
    """2 gloo ranks: uninterrupted, then resumed from checkpoint-5 and checkpoint-10."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts",
                          "ddp_resume.py")
    ranks, _ = torchrun(tmp_path, script, timeout=400)
    for info, runs in ranks:
        assert info["world_size"] == 2
        assert info["steps"] == {"uninterrupted": 20, "checkpoint-5": 20, "checkpoint-10": 20}
        expected = runs["uninterrupted"]
        for checkpoint in ("checkpoint-5", "checkpoint-10"):
            for name in expected:
                torch.testing.assert_close(runs[checkpoint][name], expected[name], rtol=1e-5,
                                           atol=1e-6, msg=f"{checkpoint}: {name}")
