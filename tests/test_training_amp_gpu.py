"""Mixed precision on one GPU: the scheduler follows the steps taken; bf16 evaluates in bf16.

On T4R's packaged ``tabular_sequence_testing_data``. Skipped with a reason without a GPU.
"""

import math
import os
import sys

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, Trainer, fit

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
