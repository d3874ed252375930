"""fit's and the Trainer's loops wait for the GPU at logs and at the epoch's end, never per step.

``torch.cuda.set_sync_debug_mode("warn")`` warns at every operation that waits for the
device, from the Python line that called it. fit.py's own waits must not grow with the
number of steps: a ``float(loss)`` per step (what the loop did before issue 22) makes the
24-batch epoch wait 16 more times than the 8-batch one; Hugging Face's loop, under our
Trainer, must not either (its ``logging_nan_inf_filter`` read each step's loss on the host).
Skipped with a reason without a GPU.
"""

import os
import sys
import warnings

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


def syncs_from(files, run) -> int:
    """Waits for the device that lines of ``files`` make in ``run()``, after one warm run."""
    run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message) and w.filename.endswith(files))


def syncs_in_fit(rows: int, **options) -> int:
    """Waits for the device that fit.py's own lines make in one epoch over ``rows`` rows."""
    state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "one GPU")
    data = factories.testing_dataset(factories.testing_frame().iloc[:rows], 4)
    model = factories.testing_model("clm")
    return syncs_from((os.path.join("training", "fit.py"),), lambda: fit(
        model, data, epochs=1, batch_size=32, strategy=state, seed=0, progress=False, **options))


def test_the_training_loop_does_not_wait_for_the_gpu_every_step():
    assert syncs_in_fit(256) == syncs_in_fit(768)  # 8 and 24 steps


def test_logging_every_step_reads_the_losses_in_groups(tmp_path):
    """fit logs into its checkpoint_dir by default: each step's loss, read 50 steps at a time."""
    assert (syncs_in_fit(256, checkpoint_dir=str(tmp_path / "a"))
            == syncs_in_fit(768, checkpoint_dir=str(tmp_path / "b")))


def syncs_in_trainer_train(rows: int, out) -> int:
    """Waits for the device made by Hugging Face's loop and ours in one epoch over ``rows``."""
    trainer = Trainer(
        model=factories.testing_model("clm"),
        args=make_args(str(out), max_sequence_length=factories.TESTING_MAX_LEN,
                       per_device_train_batch_size=32, dataloader_drop_last=True),
        strategy="single",
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(factories.testing_frame().iloc[:rows], 4),
    )
    ours = (os.path.join("transformers", "trainer.py"), os.path.join("training", "trainer.py"))
    return syncs_from(ours, trainer.train)


def test_the_trainer_does_not_wait_for_the_gpu_every_step(tmp_path):
    assert syncs_in_trainer_train(256, tmp_path / "a") == syncs_in_trainer_train(768, tmp_path / "b")
