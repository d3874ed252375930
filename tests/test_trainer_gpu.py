"""GPU tests of merlin_t4r_ops.training.Trainer: one GPU, and DataParallel over all visible GPUs."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args, make_model, make_schema, write_sessions  # noqa: E402

from merlin_t4r_ops.training import Trainer  # noqa: E402

_N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(_N_GPUS < 1, reason=f"needs a CUDA GPU, found {_N_GPUS}")
needs_gpus = pytest.mark.skipif(_N_GPUS < 2, reason=f"needs two or more CUDA GPUs, found {_N_GPUS}")


pytestmark = pytest.mark.usefixtures("no_launcher_env")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions_gpu")
    train, _ = write_sessions(str(root / "train"), 256, 4, seed=0)
    evals, _ = write_sessions(str(root / "eval"), 101, 3, seed=1)
    return {"train": train, "eval": evals, "schema": make_schema()}


def _trainer(data, out, model, strategy):
    return Trainer(
        model=model,
        args=make_args(str(out), no_cuda=False),
        strategy=strategy,
        schema=data["schema"],
        train_dataset_or_path=data["train"],
        eval_dataset_or_path=data["eval"],
        compute_metrics=True,
    )


def _record_devices(model):
    """Devices the model's forward runs on (hooks are shared by DataParallel replicas)."""
    seen = set()

    def hook(module, args, kwargs):
        for value in list(args) + list(kwargs.values()):
            values = value.values() if isinstance(value, dict) else [value]
            for v in values:
                if isinstance(v, torch.Tensor):
                    seen.add(v.device)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle


@pytest.mark.gpu
@needs_gpu
def test_single_gpu_trainer_trains_and_evaluates(data, tmp_path):
    model = make_model(data["schema"])
    trainer = _trainer(data, tmp_path, model, strategy="single")
    assert trainer.dist_state.strategy == "single" and trainer.args.n_gpu == 1
    trainer.train()
    metrics = trainer.evaluate()
    assert trainer.model is model
    assert next(model.parameters()).device.type == "cuda"
    assert 0.0 <= metrics["eval_/next-item/recall_at_10"] <= 1.0


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_gpus
def test_dp_trainer_evaluates_on_all_gpus_with_exact_metrics(data, tmp_path):
    model = make_model(data["schema"])
    trainer = _trainer(data, tmp_path / "dp", model, strategy="auto")
    assert trainer.dist_state.strategy == "dp" and trainer.args.n_gpu == _N_GPUS
    trainer.train()
    assert trainer.model is model and type(model).__name__ == "Model"

    seen, handle = _record_devices(model)
    try:
        dp_metrics = trainer.evaluate()
    finally:
        handle.remove()
    assert {d.index for d in seen if d.type == "cuda"} == set(range(_N_GPUS)), seen

    # Same weights, one GPU: the DataParallel evaluation must give the same metrics.
    single = _trainer(data, tmp_path / "single", model, strategy="single").evaluate()
    for key in ("eval_/next-item/ndcg_at_10", "eval_/next-item/recall_at_10"):
        assert dp_metrics[key] == pytest.approx(single[key], abs=1e-5), key
