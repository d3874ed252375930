"""Mixed precision on one GPU: the scheduler follows the steps taken; bf16 evaluates in bf16;
fit's step options (fp16, bf16, compile, fused Adam) each train.

On T4R's packaged ``tabular_sequence_testing_data``. Skipped with a reason without a GPU.
"""

import math
import os
import sys

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, Trainer, fit, load_checkpoint, unwrap_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

_N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_N_GPUS < 1, reason=f"needs a CUDA GPU, found {_N_GPUS}"),
    pytest.mark.usefixtures("no_launcher_env"),
]


def test_fit_amp_steps_the_scheduler_only_when_the_optimizer_stepped():
    """The first 2 backward passes give an infinite gradient: GradScaler skips 2 of 10 steps."""
    state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "one GPU")
    model = factories.testing_model("clm").to(state.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    backward_passes = []

    def overflow_twice(grad):
        backward_passes.append(None)
        return grad * math.inf if len(backward_passes) <= 2 else grad

    parameter = next(p for p in model.parameters() if p.requires_grad)
    parameter.register_hook(overflow_twice)
    fit(model, factories.testing_dataset(factories.testing_frame().iloc[:160]),
        optimizer=optimizer, lr_scheduler=scheduler, lr_scheduler_interval="step", amp=True,
        batch_size=16, strategy=state, progress=False)
    taken = max(int(s["step"]) for s in optimizer.state.values())
    assert len(backward_passes) == 10 and taken == 8
    assert scheduler.last_epoch == taken


def test_trainer_bf16_evaluation_runs_in_bfloat16(tmp_path):
    trainer = Trainer(
        model=factories.testing_model("clm"),
        args=make_args(str(tmp_path), no_cuda=False, bf16=True,
                       max_sequence_length=factories.TESTING_MAX_LEN),
        strategy="single",
        schema=factories.testing_schema(),
        eval_dataset_or_path=factories.testing_dataset(factories.testing_frame().iloc[:64]),
    )
    # The autocast dtype in force while the model's layers run in prediction_step: the
    # predictions' own dtype says nothing (T4R's output layer returns float32 under both).
    seen = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_autocast_dtype("cuda")
                                         if torch.is_autocast_enabled("cuda") else None))
    batch = next(iter(trainer.get_eval_dataloader()))
    try:
        trainer.prediction_step(trainer.model, batch, False)
    finally:
        hook.remove()
    assert seen == [torch.bfloat16]


CUDA_SINGLE = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "one GPU")
STEP_OPTIONS = {  # fit's step options, each on its own
    "fp16": dict(amp="fp16"),
    "bf16": dict(amp="bf16"),
    "compile": dict(compile=True),
    "bf16-compile": dict(amp="bf16", compile=True),
    "fused-adam": dict(),  # the default optimizer on CUDA
}


def _train(tmp_path, epochs=3, **options):
    """fit on T4R's 1,000 testing sessions, batches of 50 with drop_last (static shapes)."""
    model = factories.testing_model("clm", d_model=32)
    history = fit(model, factories.testing_dataset(factories.testing_frame()), epochs=epochs,
                  batch_size=50, drop_last=True, strategy=CUDA_SINGLE, seed=0, progress=False,
                  checkpoint_dir=str(tmp_path), **options)
    return model, history, load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("name", list(STEP_OPTIONS))
def test_each_step_option_trains_and_the_loss_falls(name, tmp_path):
    model, history, checkpoint = _train(tmp_path, **STEP_OPTIONS[name])
    losses = [h["train_loss"] for h in history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert unwrap_model(model) is model and next(model.parameters()).is_cuda
    assert not [key for key in checkpoint["model"] if "_orig_mod" in key]


def test_bf16_makes_no_grad_scaler_and_fp16_makes_one(tmp_path):
    *_, bf16 = _train(tmp_path / "bf16", epochs=1, amp="bf16")
    *_, fp16 = _train(tmp_path / "fp16", epochs=1, amp="fp16")
    assert bf16["scaler"] is None
    assert fp16["scaler"] is not None and fp16["scaler"]["scale"] > 0


def test_the_default_optimizer_on_cuda_is_fused_adam_with_fits_hyperparameters(tmp_path):
    *_, checkpoint = _train(tmp_path, epochs=1, lr=3e-3)
    group = checkpoint["optimizer"]["param_groups"][0]
    assert group["fused"] is True
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-3, (0.9, 0.999), 1e-8, 0)


def test_compiled_training_follows_the_eager_loss_curve(tmp_path):
    _, eager, _ = _train(tmp_path / "eager", epochs=2)
    _, compiled, _ = _train(tmp_path / "compiled", epochs=2, compile=True)
    for e, c in zip(eager, compiled):
        assert c["train_loss"] == pytest.approx(e["train_loss"], rel=1e-3)


def _trainer_loss(tmp_path, **args):
    """Our Trainer, 2 epochs of batches of 50 with drop_last; the trainer and its loss."""
    trainer = Trainer(
        model=factories.testing_model("clm", d_model=32),
        args=make_args(str(tmp_path), no_cuda=False, dataloader_drop_last=True,
                       per_device_train_batch_size=50, num_train_epochs=2,
                       max_sequence_length=factories.TESTING_MAX_LEN, **args),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(factories.testing_frame()),
    )
    return trainer, trainer.train().training_loss


def test_trainer_compiled_in_reduce_overhead_mode_follows_the_eager_loss(tmp_path, monkeypatch):
    # Hugging Face hands the compile mode to accelerate in the environment, and turns TF32
    # matmuls on for the process when it compiles: set here, so that monkeypatch puts both
    # back after the test.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32",
                        torch.backends.cuda.matmul.allow_tf32)
    _, eager = _trainer_loss(tmp_path / "eager")
    trainer, compiled = _trainer_loss(tmp_path / "compiled", torch_compile_mode="reduce-overhead")
    config = trainer.model_wrapped.get_compiler_config()
    assert config["triton.cudagraphs"] is True
    assert config["triton.cudagraph_skip_dynamic_graphs"] is True
    assert compiled == pytest.approx(eager, rel=1e-3)
