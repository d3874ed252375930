"""fit's loop waits for the GPU every 50 logged steps and at the epoch's end, never per step.

``torch.cuda.set_sync_debug_mode("warn")`` warns at every operation that waits for the
device, from the Python line that called it. fit.py's own waits must not grow with the
number of steps: a ``float(loss)`` per step (what the loop did before issue 22) makes the
24-batch epoch wait 16 more times than the 8-batch one. Skipped with a reason without a GPU.
"""

import os
import warnings

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, fit

_N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_N_GPUS < 1, reason=f"needs a CUDA GPU, found {_N_GPUS}"),
    pytest.mark.usefixtures("no_launcher_env"),
]


def syncs_in_fit(rows: int, **options) -> int:
    """Waits for the device that fit.py's own lines make in one epoch over ``rows`` rows."""
    state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "one GPU")
    data = factories.testing_dataset(factories.testing_frame().iloc[:rows], 4)
    model = factories.testing_model("clm")
    fit(model, data, epochs=1, batch_size=32, strategy=state, seed=0, progress=False,
        **options)  # warm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fit(model, data, epochs=1, batch_size=32, strategy=state, seed=0, progress=False,
                **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    fit_py = os.path.join("training", "fit.py")
    return sum(1 for w in caught if "synchroniz" in str(w.message) and w.filename.endswith(fit_py))


def test_the_training_loop_does_not_wait_for_the_gpu_every_step():
    assert syncs_in_fit(256) == syncs_in_fit(768)  # 8 and 24 steps


def test_logging_every_step_reads_the_losses_in_groups(tmp_path):
    """fit logs into its checkpoint_dir by default: each step's loss, read 50 steps at a time."""
    assert (syncs_in_fit(256, checkpoint_dir=str(tmp_path / "a"))
            == syncs_in_fit(768, checkpoint_dir=str(tmp_path / "b")))
