"""One policy for ``fit`` and the ``Trainer`` (``merlin_t4r_ops.training.policy``), one process.

Seeds as Hugging Face's Trainer (``seed=42`` by default, ``data_seed`` for the data
order), ``fit``'s log in its checkpoint folder by default, and a resumed run's log that
holds every step once. The DDP halves (the same seed on every rank, the Trainer's
unused-parameter probe) are in tests/test_training_ddp.py and tests/test_trainer.py.
"""

import csv
import os
import sys

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, Trainer, fit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")

CPU_SINGLE = DistributedState("single", 0, 0, 1, torch.device("cpu"), "tests run on CPU")


class Preempted(Exception):
    """Stands for the job being stopped after some optimizer steps."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_data")
    return {
        "train": factories.write_sessions(str(root / "train"), 192, seed=0),
        "valid": factories.write_sessions(str(root / "valid"), 40, seed=1, n_files=1),
    }


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b):
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_fit_seeds_every_run_with_42_by_default_as_hugging_face(data):
    """MLM draws its masks from torch's RNG: whatever the RNG held before, the runs agree.

    Before, ``fit`` seeded nothing unless told (``seed=None``), and the two runs differed.
    """
    runs = []
    for outside in (1, 2):
        model = factories.build_model("next-item", masking="mlm", seed=0)
        torch.manual_seed(outside)
        fit(model, data["train"], epochs=1, strategy=CPU_SINGLE, progress=False)
        runs.append(weights(model))
    explicit = factories.build_model("next-item", masking="mlm", seed=0)
    fit(explicit, data["train"], epochs=1, strategy=CPU_SINGLE, seed=42, progress=False)
    assert same(runs[0], runs[1])
    assert same(runs[0], weights(explicit))


def fit_binary(data, **seeds):
    """CLM and dropout 0 draw nothing at random: only the data order tells runs apart."""
    model = factories.build_model("binary", seed=0)
    fit(model, data["train"], epochs=1, strategy=CPU_SINGLE, progress=False, **seeds)
    return weights(model)


def test_fit_data_seed_orders_the_data_as_the_trainers_args_data_seed(data):
    by_data_seed = fit_binary(data, seed=1, data_seed=7)
    assert same(by_data_seed, fit_binary(data, seed=7))
    assert not same(by_data_seed, fit_binary(data, seed=1))


def train_trainer(out, **seeds):
    frame = factories.testing_frame().iloc[:96]
    trainer = Trainer(
        model=factories.testing_model("clm", seed=0),
        args=make_args(str(out), max_sequence_length=factories.TESTING_MAX_LEN, **seeds),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(frame),
    )
    trainer.train()
    return weights(trainer.model)


def test_trainer_data_seed_orders_the_data_as_hugging_face(tmp_path):
    """``args.data_seed`` orders the Trainer's loader; before, it read ``args.seed`` only."""
    by_data_seed = train_trainer(tmp_path / "a", seed=1, data_seed=7)
    assert same(by_data_seed, train_trainer(tmp_path / "b", seed=7))
    assert not same(by_data_seed, train_trainer(tmp_path / "c", seed=1))


def test_fit_logs_into_its_checkpoint_dir_unless_told_not_to(data, tmp_path):
    """As the Trainer logs under its output_dir; before, nothing was logged without log_dir."""
    for folder, log_dir in (("logged", None), ("quiet", False)):
        fit(factories.build_model("binary"), data["train"], epochs=1, strategy=CPU_SINGLE,
            progress=False, checkpoint_dir=str(tmp_path / folder), log_dir=log_dir)
    with open(tmp_path / "logged" / "log.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["name"] == "train/loss"] == [
            1, 2, 3, 4, 5, 6]
    assert os.listdir(tmp_path / "quiet") == ["last.pt"]


def run_to_log(data, ckpt, stop_after=None, resume=False):
    """12 steps of 32 rows over 2 epochs, last.pt every 2 steps; ``stop_after`` steps, stop.

    The scheduler stands in for the job being stopped: it raises during the step after
    ``stop_after``, before that step is logged.
    """
    model = factories.build_model("binary", seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = []

    def constant(_):
        calls.append(None)
        if stop_after is not None and len(calls) > stop_after + 1:  # 1st call: at init
            raise Preempted
        return 1.0

    fit(model, data["train"], eval_data=data["valid"], optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, constant),
        lr_scheduler_interval="step", epochs=2, strategy=CPU_SINGLE, progress=False,
        save_steps=2, checkpoint_dir=str(ckpt), log_dir=str(ckpt), resume=resume)


def log_rows(folder):
    with open(folder / "log.csv") as f:
        return [(int(r["step"]), r["name"], float(r["value"])) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def resumed_log(data, tmp_path_factory):
    """An uninterrupted run's folder, and one stopped after 9 steps (last.pt at step 8), resumed."""
    full = tmp_path_factory.mktemp("full")
    run_to_log(data, full)
    stopped = tmp_path_factory.mktemp("stopped")
    with pytest.raises(Preempted):
        run_to_log(data, stopped, stop_after=9)
    assert max(step for step, _, _ in log_rows(stopped)) == 9
    run_to_log(data, stopped, resume=True)
    return full, stopped


def test_a_resumed_fit_logs_every_step_once(resumed_log):
    """Before, step 9 (after the checkpoint of step 8) was in log.csv twice."""
    full, resumed = resumed_log
    got, expected = log_rows(resumed), log_rows(full)
    assert [(step, name) for step, name, _ in got] == [(step, name) for step, name, _ in expected]
    assert [value for *_, value in got] == pytest.approx([value for *_, value in expected],
                                                         rel=1e-5, abs=1e-6)


def test_a_resumed_fit_purges_tensorboard_past_its_checkpoint(resumed_log):
    """TensorBoard reads every train/loss step once: the resumed writer's purge_step."""
    pytest.importorskip("tensorboard", reason="TensorBoard is optional: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full, resumed = resumed_log
    losses = {}
    for name, folder in (("full", full), ("resumed", resumed)):
        events = EventAccumulator(str(folder / "runs")).Reload()
        losses[name] = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in losses["resumed"]] == list(range(1, 13))
    assert losses["resumed"] == [(s, pytest.approx(v, rel=1e-5)) for s, v in losses["full"]]


def test_resume_without_a_checkpoint_fit_starts_afresh_the_trainer_raises(data, tmp_path):
    """The one difference kept: ``fit(resume=True)`` may be the first run of a job that
    restarts itself; ``train(resume_from_checkpoint=True)`` raises what Hugging Face (and
    T4R's Trainer) raise."""
    history = fit(factories.build_model("binary"), data["train"], epochs=1, strategy=CPU_SINGLE,
                  progress=False, checkpoint_dir=str(tmp_path / "fit"), resume=True)
    assert [h["epoch"] for h in history] == [1]
    trainer = Trainer(
        model=factories.testing_model("clm"),
        args=make_args(str(tmp_path / "trainer"), max_sequence_length=factories.TESTING_MAX_LEN),
        strategy="single", schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(factories.testing_frame().iloc[:32]),
    )
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
