"""Single-process ``fit``/``evaluate``: the three T4R tasks, inputs, options and errors."""

import math
import os

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.errors import StrategyError
from merlin_t4r_ops.training import (
    DistributedState,
    MetricAccumulator,
    evaluate,
    fit,
    make_loader,
    resolve_strategy,
)
from merlin_t4r_ops.training.unused import probe_unused_parameters

CPU_SINGLE = DistributedState("single", 0, 0, 1, torch.device("cpu"), "tests run on CPU")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit_data")
    return {
        "train": factories.write_sessions(str(root / "train"), 192, seed=0),
        "valid": factories.write_sessions(str(root / "valid"), 50, seed=1, n_files=3),
    }


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "task, metric",
    [
        ("binary", "click/binary_classification_task/binary_accuracy"),
        ("regression", "rating/regression_task/mean_squared_error"),
        ("next-item", "next-item/ndcg_at_10"),
    ],
)
def test_fit_trains_in_place_and_returns_history(task, metric, data, capsys):
    model = factories.build_model(task)
    before = snapshot(model)
    history = fit(model, data["train"], eval_data=data["valid"], epochs=2, batch_size=32,
                  strategy=CPU_SINGLE, seed=0, lr=5e-3)
    assert [h["epoch"] for h in history] == [1, 2]
    assert all(h["train_samples"] == 192 for h in history)
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert f"eval_{metric}" in history[-1] and "eval_loss" in history[-1]
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "weights of the passed model did not change"
    assert type(model).__name__ == "Model"
    out = capsys.readouterr().out
    assert "epoch 2/2  train_loss=" in out and f"eval_{metric}=" in out


@pytest.mark.parametrize("task", ["binary", "regression", "next-item"])
def test_metrics_equal_t4r_evaluate(task, data):
    model = factories.build_model(task)
    fit(model, data["train"], epochs=1, strategy=CPU_SINGLE, seed=0, progress=False)
    ours = evaluate(model, data["valid"], strategy=CPU_SINGLE, batch_size=16)
    loader = make_loader(data["valid"], model, CPU_SINGLE, batch_size=16)
    theirs = {k: float(v) for k, v in model.evaluate(loader, verbose=False).items()}
    assert set(theirs) == set(ours) - {"loss"}
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_metrics_are_exact_regardless_of_batching(data):
    """Per-example sums, not means of batch means: batch size must not change the numbers."""
    model = factories.build_model("next-item")
    a = evaluate(model, data["valid"], strategy=CPU_SINGLE, batch_size=7)
    b = evaluate(model, data["valid"], strategy=CPU_SINGLE, batch_size=50)
    assert a == pytest.approx(b, rel=1e-5)


def test_an_evaluation_over_no_rows_is_nan_with_a_warning():
    """A mean over nothing is NaN (as T4R's Trainer's loss is), never a plausible 0.0."""
    acc = MetricAccumulator(factories.build_model("binary"), CPU_SINGLE)
    with pytest.warns(RuntimeWarning, match="evaluation saw no rows"):
        metrics = acc.compute()
    assert "loss" in metrics and "click/binary_classification_task/binary_accuracy" in metrics
    assert all(math.isnan(v) for v in metrics.values())


def test_fit_same_seed_is_reproducible_and_accepts_dataset_and_loader(data):
    a, b, c = (factories.build_model("binary", seed=0) for _ in range(3))
    fit(a, data["train"], epochs=1, strategy=CPU_SINGLE, seed=3, progress=False)
    fit(b, factories.dataset(data["train"]), epochs=1, strategy=CPU_SINGLE, seed=3, progress=False)
    # A ready dataloader: used as is (here the same batches, built by hand).
    ready = make_loader(data["train"], c, CPU_SINGLE, batch_size=32, shuffle=True, seed=3)
    fit(c, ready, epochs=1, strategy=CPU_SINGLE, seed=3, progress=False)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
        assert torch.equal(v, c.state_dict()[k]), k


def test_fit_with_scheduler_clipping_and_custom_optimizer(data):
    model = factories.build_model("regression")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    history = fit(model, data["train"], optimizer=optimizer, lr_scheduler=scheduler,
                  max_grad_norm=0.5, epochs=3, strategy=CPU_SINGLE, progress=False)
    assert [h["lr"] for h in history] == pytest.approx([0.1, 0.05, 0.025])
    step = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0), lambda s: 1.0 / (s + 1))
    history = fit(model, data["train"], optimizer=step.optimizer, lr_scheduler=step,
                  lr_scheduler_interval="step", epochs=1, batch_size=64, strategy=CPU_SINGLE, progress=False)
    assert history[0]["lr"] == pytest.approx(1.0 / 4)  # 3 steps taken, 4th factor


def test_gradient_clipping_bounds_the_update(data):
    """With SGD lr=1 one clipped step moves the weights by at most max_grad_norm."""
    model = factories.build_model("binary")
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    loader = [next(iter(make_loader(data["train"], model, CPU_SINGLE, batch_size=64)))]
    fit(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        max_grad_norm=1e-3, epochs=1, strategy=CPU_SINGLE, progress=False)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert 0 < float((after - before).norm()) <= 1e-3 + 1e-7


def test_amp_on_cpu_raises(data):
    with pytest.raises(StrategyError, match=r"amp=True expects a CUDA device .* trains on cpu"):
        fit(factories.build_model("binary"), data["train"], amp=True, strategy=CPU_SINGLE)


def test_fit_refuses_wrapped_model_and_bad_arguments(data):
    model = factories.build_model("binary")
    with pytest.raises(StrategyError, match="fit expects an unwrapped model .* got DataParallel"):
        fit(torch.nn.DataParallel(model), data["train"], strategy=CPU_SINGLE)
    with pytest.raises(ValueError, match="resume=True expects checkpoint_dir="):
        fit(model, data["train"], resume=True, strategy=CPU_SINGLE)
    with pytest.raises(ValueError, match="batch_size must be a positive int .* got 0"):
        fit(model, data["train"], batch_size=0, strategy=CPU_SINGLE)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fit(model, os.path.join(data["train"], "nope.parquet"), strategy=CPU_SINGLE)
    with pytest.raises(TypeError, match="data must be parquet path"):
        fit(model, 3, strategy=CPU_SINGLE)


def test_fit_auto_strategy_on_this_machine_is_single(data, monkeypatch):
    if torch.cuda.device_count() > 1:
        pytest.skip("auto picks dp on a multi-GPU machine")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_strategy("auto").strategy == "single"
    history = fit(factories.build_model("binary"), data["train"], epochs=1, progress=False)
    assert history[0]["train_samples"] == 192


def test_probe_finds_xlnet_parameters_the_task_never_uses(data):
    """Why plain DDP fails on T4R XLNet: these get no gradient, so fit freezes them under DDP."""
    model = factories.build_model("binary")
    batch = next(iter(make_loader(data["train"], model, CPU_SINGLE, batch_size=8)))
    unused, disagree = probe_unused_parameters(model, batch, CPU_SINGLE)
    assert not disagree
    assert {n.rsplit("transformer.", 1)[-1] for n in unused} >= {"mask_emb", "word_embedding.weight"}
    assert all(p.grad is None for p in model.parameters())  # probe leaves no gradients behind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="single-GPU fit needs a CUDA GPU")
@pytest.mark.parametrize("amp", [False, True])
def test_fit_single_gpu(amp, data):
    model = factories.build_model("next-item")
    state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "gpu test")
    history = fit(model, data["train"], eval_data=data["valid"], epochs=2, strategy=state, amp=amp,
                  progress=False, max_grad_norm=1.0)
    assert next(model.parameters()).device.type == "cuda"
    assert history[-1]["train_loss"] < history[0]["train_loss"]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs two or more CUDA GPUs")
@pytest.mark.parametrize("task", ["binary", "next-item"])
def test_fit_dataparallel_gathers_dict_outputs(task, data):
    model = factories.build_model(task)
    state = resolve_strategy("dp")
    history = fit(model, data["train"], eval_data=data["valid"], epochs=2, strategy=state, progress=False)
    assert type(model).__name__ == "Model"
    # Metrics on gathered outputs equal a single-device eval of the same weights.
    single = evaluate(model, data["valid"], strategy=DistributedState(
        "single", 0, 0, 1, torch.device("cuda:0"), "ref"))
    for name, value in single.items():
        assert history[-1][f"eval_{name}"] == pytest.approx(value, rel=1e-4, abs=1e-5), name


class RecordedSessions(torch.utils.data.Dataset):
    """T4R's packaged sessions, cropped and padded; remembers the order rows are read in."""

    def __init__(self, frame):
        self.columns = factories.testing_batch(frame)
        self.read = []

    def __len__(self):
        return len(self.columns["item_id/list"])

    def __getitem__(self, index):
        self.read.append(int(index))
        return {name: column[index] for name, column in self.columns.items()}, {}


def test_fit_sets_the_epoch_of_a_users_distributed_sampler():
    from torch.utils.data import DataLoader, DistributedSampler

    sessions = RecordedSessions(factories.testing_frame().iloc[:96])
    sampler = DistributedSampler(sessions, num_replicas=2, rank=1, shuffle=True, seed=3)
    orders = []
    fit(factories.testing_model(), DataLoader(sessions, batch_size=16, sampler=sampler), epochs=3,
        strategy=CPU_SINGLE, progress=False,
        callbacks=[lambda entry: orders.append(sessions.read[-48:])])

    assert len(sessions.read) == 3 * 48
    for epoch, order in enumerate(orders):
        expected = DistributedSampler(sessions, num_replicas=2, rank=1, shuffle=True, seed=3)
        expected.set_epoch(epoch)
        assert order == list(expected)
    assert len({tuple(order) for order in orders}) == 3


def test_fit_refuses_a_scheduler_of_another_optimizer(data):
    model = factories.build_model("binary")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    before = snapshot(model)
    with pytest.raises(ValueError, match="got a StepLR bound to another optimizer than "
                                         "optimizer=SGD"):
        fit(model, data["train"], optimizer=optimizer, lr_scheduler=other, strategy=CPU_SINGLE,
            progress=False)
    with pytest.raises(ValueError, match=r"optimizer=None \(fit would make its own Adam\)"):
        fit(model, data["train"], lr_scheduler=other, strategy=CPU_SINGLE, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in snapshot(model).items())  # nothing trained


@pytest.mark.parametrize("task", ["binary", "regression"])
def test_gradient_accumulation_equals_the_larger_batch(task, data):
    """2 batches of 8 per step take the step of one batch of 16 (losses are means over rows)."""
    models = {}
    for batch_size, accumulate in ((16, 1), (8, 2)):
        model = factories.build_model(task, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        history = fit(model, data["train"], optimizer=optimizer, epochs=1, batch_size=batch_size,
                      gradient_accumulation_steps=accumulate, strategy=CPU_SINGLE, shuffle=False,
                      progress=False)
        models[accumulate] = (snapshot(model), history)
    (one, history_one), (two, history_two) = models[1], models[2]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
    assert history_two[0]["train_samples"] == history_one[0]["train_samples"] == 192
    assert math.isfinite(history_one[0]["train_loss"])
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive int, "
                                         "got 0"):
        fit(factories.build_model(task), data["train"], gradient_accumulation_steps=0,
            strategy=CPU_SINGLE)


def test_fit_logs_step_loss_learning_rate_and_eval_metrics_to_csv(data, tmp_path):
    """As the Trainer logs: train/loss and train/learning_rate per step, eval/<metric> per epoch."""
    import csv

    model = factories.build_model("binary")
    history = fit(model, data["train"], eval_data=data["valid"], epochs=2, batch_size=64,
                  strategy=CPU_SINGLE, seed=0, progress=False, log_dir=str(tmp_path))
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [r for r in rows if r["name"] == "train/loss"]
    assert [int(r["step"]) for r in losses] == [1, 2, 3, 4, 5, 6]  # 192 rows / 64, two epochs
    assert {r["name"] for r in rows} >= {"train/learning_rate", "eval/loss",
                                         "eval/click/binary_classification_task/binary_accuracy"}
    epoch_1 = [float(r["value"]) for r in losses[:3]]
    assert sum(epoch_1) / 3 == pytest.approx(history[0]["train_loss"])
    evals = [r for r in rows if r["name"] == "eval/loss"]
    assert [(int(r["step"]), float(r["value"])) for r in evals] == [
        (3, pytest.approx(history[0]["eval_loss"])), (6, pytest.approx(history[1]["eval_loss"]))]
