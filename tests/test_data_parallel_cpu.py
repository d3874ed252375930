"""DataParallel's loss on CPU: ``fit``/``evaluate`` and the ``Trainer`` with the batch split
exactly as DataParallel's scatter splits it over 2, 3 and 4 GPUs (``tests/dp_simulation.py``),
with real T4R models.

The mean of per-replica mean losses is inexact when a batch does not split evenly, and NaN
when one replica gets no target; the loss must equal a single device's over the whole batch.
"""

import importlib
import math
import os
import sys

import numpy as np
import pytest
import torch

import t4r_training_factories as factories
from dp_simulation import simulate
from merlin_t4r_ops.training import DistributedState, Trainer, evaluate, fit, make_loader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import ITEM_COL, MAX_LEN, make_args, make_model, make_schema  # noqa: E402
from trainer_common import write_sessions as write_item_sessions  # noqa: E402

# The module, not the function that merlin_t4r_ops.training exports under the same name.
fit_module = importlib.import_module("merlin_t4r_ops.training.fit")
CPU = torch.device("cpu")
SINGLE = DistributedState("single", 0, 0, 1, CPU, "reference: one device")
# What resolve_strategy returns on a multi-GPU host, with the CPU as device 0.
DP = DistributedState("dp", 0, 0, 1, CPU, "DataParallel simulated on CPU")
pytestmark = pytest.mark.usefixtures("no_launcher_env")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_data")
    return {
        "train": factories.write_sessions(str(root / "train"), 64, seed=0),
        # The 50-row eval set of test_training_fit: batches of 32 and 18 rows.
        "valid": factories.write_sessions(str(root / "valid"), 50, seed=1, n_files=3),
    }


@pytest.fixture
def simulated_gpus(monkeypatch):
    """Make ``fit``/``evaluate`` run the DataParallel they build as on ``n`` GPUs."""

    def use(n_devices):
        real = fit_module.prepare_model

        def prepare(model, state, **kwargs):
            wrapped = real(model, state, **kwargs)
            return simulate(wrapped, n_devices) if state.strategy == "dp" else wrapped

        monkeypatch.setattr(fit_module, "prepare_model", prepare)

    return use


def _sessions_batch(lengths, n_items=factories.N_ITEMS, seed=0):
    """Padded ``(inputs, None)`` for factories' next-item models: one session per length."""
    rng = np.random.default_rng(seed)
    x = {c: torch.zeros(len(lengths), factories.MAX_LEN, dtype=torch.long)
         for c in ("item_id-list", "category-list")}
    for row, length in enumerate(lengths):
        items = torch.as_tensor(rng.integers(1, n_items, size=length))
        x["item_id-list"][row, :length] = items
        x["category-list"][row, :length] = items % (factories.N_CATEGORIES - 1) + 1
    return x, None


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize("task", ["binary", "regression", "next-item"])
def test_fit_dp_eval_loss_equals_one_device(task, n_devices, data, simulated_gpus):
    simulated_gpus(n_devices)
    model = factories.build_model(task)
    history = fit(model, data["train"], eval_data=data["valid"], epochs=1, strategy=DP,
                  progress=False, seed=0)
    single = evaluate(model, data["valid"], strategy=SINGLE)
    for name, value in single.items():
        assert history[-1][f"eval_{name}"] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    alone = evaluate(model, data["valid"], strategy=DP)
    assert alone == pytest.approx(single, rel=1e-6, abs=1e-7)


def test_fit_dp_batch_with_fewer_rows_than_gpus(data, simulated_gpus):
    # 50 rows in batches of 15: the last 5 rows are cut 2+2+1 on 4 GPUs, three chunks.
    simulated_gpus(4)
    model = factories.build_model("next-item")
    history = fit(model, data["train"], eval_data=data["valid"], eval_batch_size=15, epochs=1,
                  strategy=DP, progress=False, seed=0)
    single = evaluate(model, data["valid"], strategy=SINGLE, batch_size=15)
    for name, value in single.items():
        assert history[-1][f"eval_{name}"] == pytest.approx(value, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize("n_devices", [3, 4])
def test_fit_dp_training_loss_with_several_tasks_equals_one_device(n_devices, data,
                                                                  simulated_gpus):
    # Next-item, click and rating on one head: under CLM each replica's next-item loss is a
    # mean over its own masked positions, the other two over its rows; 50 rows do not split
    # evenly on 3 or 4 GPUs. lr 0 keeps the weights, so train_loss is this batch's loss.
    model = factories.build_model("multi")
    batch = next(iter(make_loader(data["valid"], model, SINGLE, batch_size=50)))
    losses = {}
    for n, state in ((1, SINGLE), (n_devices, DP)):
        simulated_gpus(n)
        history = fit(model, [batch], epochs=1, strategy=state, progress=False, seed=0,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        losses[n] = history[0]["train_loss"]
    assert losses[n_devices] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.parametrize("masking", ["clm", "mlm"])
def test_fit_dp_step_with_an_empty_replica_is_finite_and_exact(masking, simulated_gpus):
    # Six sessions on 3 GPUs: the last replica gets the two one-item sessions, which have
    # no target under either masking in training.
    batch = _sessions_batch([5, 7, 4, 6, 1, 1])
    simulated_gpus(3)
    model = factories.build_model("next-item", masking=masking)
    # SGD, not Adam: Adam's first step is lr * sign(grad), which turns rounding noise in a
    # near-zero gradient into a full step, so weights could not be compared.
    history = fit(model, [batch], epochs=1, strategy=DP, progress=False, seed=0,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert math.isfinite(history[0]["train_loss"]), history
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a weight became NaN"
    if masking == "clm":  # deterministic targets: the same step as one device's
        reference = factories.build_model("next-item", masking=masking)
        single = fit(reference, [batch], epochs=1, strategy=SINGLE, progress=False, seed=0,
                     optimizer=torch.optim.SGD(reference.parameters(), lr=0.1))
        assert history[0]["train_loss"] == pytest.approx(single[0]["train_loss"], rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# ---- the Trainer ------------------------------------------------------------------------------


class SimulatedDataParallelTrainer(Trainer):
    """The project's Trainer on a host that Hugging Face sees with ``args.n_gpu`` GPUs."""

    def _wrap_model(self, model, training=True, dataloader=None):
        return simulate(super()._wrap_model(model, training, dataloader), self.args.n_gpu)


def _dp_trainer(model, out, n_devices, evals=None, **kwargs):
    trainer = SimulatedDataParallelTrainer(
        model=model, args=make_args(str(out)), strategy="single", schema=make_schema(),
        eval_dataset_or_path=evals, **kwargs,
    )
    # What strategy="dp" gives on n GPUs: Hugging Face wraps in DataParallel when n_gpu > 1.
    trainer.args._n_gpu = n_devices
    trainer.dist_state = DP
    return trainer


@pytest.fixture(scope="module")
def item_sessions(tmp_path_factory):
    files, _ = write_item_sessions(str(tmp_path_factory.mktemp("items")), 100, 3, seed=1)
    return files


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize("compute_metrics", [True, None])
def test_trainer_dp_eval_loss_equals_one_device(n_devices, compute_metrics, item_sessions,
                                                tmp_path):
    model = make_model(make_schema(), seed=5)
    single = Trainer(model=model, args=make_args(str(tmp_path)), strategy="single",
                     schema=make_schema(), eval_dataset_or_path=item_sessions,
                     compute_metrics=True).evaluate()
    trainer = _dp_trainer(model, tmp_path, n_devices, item_sessions,
                          compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    # The eval batch is 16 per GPU, so batches of 32/48/64 rows and a short last one.
    assert trainer.args.eval_batch_size == 16 * n_devices
    expected = {k: v for k, v in single.items() if k.startswith("eval_/")}
    if not compute_metrics:
        expected = {"eval_/loss": expected["eval_/loss"]}
    ours = {k: v for k, v in metrics.items() if k.startswith("eval_/")}
    assert ours == pytest.approx(expected, rel=1e-6, abs=1e-7)


def _item_batch(lengths):
    x = torch.zeros(len(lengths), MAX_LEN, dtype=torch.long)
    for row, length in enumerate(lengths):
        x[row, :length] = torch.arange(1, length + 1) + row
    return {ITEM_COL: x}, None


def test_trainer_dp_training_step_with_an_empty_replica(tmp_path):
    # MLM (XLNet): on 3 GPUs the last replica holds two one-item sessions, no masked position.
    features, targets = _item_batch([5, 7, 4, 6, 1, 1])
    model = make_model(make_schema(), arch="xlnet", seed=2)
    trainer = _dp_trainer(model, tmp_path, 3)
    wrapped = trainer._wrap_model(trainer.model)

    torch.manual_seed(7)
    loss = trainer.training_step(wrapped, (features, targets))
    assert wrapped.chunk_rows == [[2, 2, 2]]
    assert math.isfinite(float(loss)), float(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())

    # The same replicas (same random masks) run one by one: the mean over all their targets.
    torch.manual_seed(7)
    sums, counts = 0.0, 0
    for chunk in features[ITEM_COL].chunk(3):
        out = model({ITEM_COL: chunk}, training=True)
        if out["labels"].numel():
            sums += float(out["loss"]) * out["labels"].numel()
            counts += out["labels"].numel()
    assert float(loss) == pytest.approx(sums / counts, rel=1e-6)
