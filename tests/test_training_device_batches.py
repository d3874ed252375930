"""A loader makes its batches on the training device: the same batches, made there.

``ShardedLoader(device_batches=...)`` gathers a padded batch on ``state.device`` from its
partition's values (:mod:`merlin_t4r_ops.training.padded_rows`); by default on a CUDA device
with no workers and not under ``dp``. The gathers themselves meet the host's in
``test_training_padded_rows.py``; here the loader's choice and its batches.
"""

import pytest
import torch

import t4r_training_factories as factories
from merlin_reference import identical
from merlin_t4r_ops.training import DistributedState
from merlin_t4r_ops.training.data import ShardedLoader, as_dataset

CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")


def state(strategy="single", device=CPU):
    return DistributedState(strategy, 0, 0, 1, device, "one process")


def loader(path, state, **options):
    return ShardedLoader(as_dataset(path), state, 16, ["item_id-list", "category-list"],
                         ["click"], max_sequence_length=10, shuffle=True, **options)


@pytest.mark.parametrize("strategy, device, workers, expected", [
    ("single", CUDA, 0, True), ("ddp", CUDA, 0, True), ("dp", CUDA, 0, False),
    ("single", CUDA, 2, False), ("single", CPU, 0, False),
])
def test_batches_are_made_on_a_cuda_device_by_default_without_workers_or_dp(
        tmp_path, strategy, device, workers, expected):
    path = factories.write_sessions(str(tmp_path / "train"), 32, n_files=2)
    made = loader(path, state(strategy, device), num_workers=workers)
    assert made.device_batches is expected


def test_device_batches_with_workers_is_refused_naming_both(tmp_path):
    path = factories.write_sessions(str(tmp_path / "train"), 32, n_files=2)
    with pytest.raises(ValueError, match=r"device_batches=True .* num_workers=0, got num_workers=2"):
        loader(path, state(), num_workers=2, device_batches=True)


def device_params():
    return [pytest.param(CPU, id="cpu"), pytest.param(CUDA, id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, found none")])]


@pytest.mark.parametrize("device", device_params())
def test_two_epochs_made_on_the_device_equal_the_hosts(tmp_path, device):
    path = factories.write_sessions(str(tmp_path / "train"), 90, n_files=3)
    on_device = loader(path, state(device=device), device_batches=True)
    on_host = loader(path, state(device=device), device_batches=False)
    for _ in range(2):
        got, expected = list(on_device), list(on_host)
        assert len(got) == len(expected) == 6
        for (x, y), (ex, ey) in zip(got, expected):
            assert all(t.device == device for t in [*x.values(), y])
            assert all(t.device == CPU for t in [*ex.values(), ey])
            assert identical({k: t.cpu() for k, t in x.items()}, ex) and identical(y.cpu(), ey)
