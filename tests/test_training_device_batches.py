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
from merlin_t4r_ops.training.padded_rows import PartitionArrays

CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")


def state(strategy="single", device=CPU):
    return DistributedState(strategy, 0, 0, 1, device, "one process")


def loader(path, state, **options):
    return ShardedLoader(as_dataset(path), state, 16, ["item_id-list", "category-list"],
                         ["click"], max_sequence_length=10, shuffle=True, **options)


@pytest.mark.parametrize("strategy, device, workers, pin, expected", [
    ("single", CUDA, 0, None, True), ("ddp", CUDA, 0, True, True), ("dp", CUDA, 0, None, False),
    ("single", CUDA, 2, None, False), ("single", CPU, 0, None, False),
    ("single", CUDA, 0, False, False),  # its uploads would pin
])
def test_batches_are_made_on_a_cuda_device_by_default_without_workers_dp_or_pin_memory_off(
        tmp_path, strategy, device, workers, pin, expected):
    path = factories.write_sessions(str(tmp_path / "train"), 32, n_files=2)
    made = loader(path, state(strategy, device), num_workers=workers, pin_memory=pin)
    assert made.device_batches is expected


def test_the_loaders_batches_are_gathered_on_the_device_it_is_given(tmp_path, monkeypatch):
    """On ``meta`` (shapes, no values): the CPU's CI sees the loader hand the device's batches,
    gathered there from partitions moved there (not gathered on the host and copied)."""
    path = factories.write_sessions(str(tmp_path / "train"), 40, n_files=2)
    meta = torch.device("meta")
    moved = []
    to = PartitionArrays.to
    monkeypatch.setattr(PartitionArrays, "to", lambda self, device: moved.append(device) or to(
        self, device))
    made = list(loader(path, state(device=meta), device_batches=True))
    assert moved == [meta, meta]  # each of the two partitions, once
    host = list(loader(path, state(), device_batches=False))
    assert len(made) == len(host) == 3
    for (x, y), (ex, ey) in zip(made, host):
        assert list(x) == list(ex)
        assert all(t.device == meta and t.shape == e.shape and t.dtype == e.dtype
                   for t, e in [*zip(x.values(), ex.values()), (y, ey)])


def test_device_batches_with_workers_is_refused_naming_both(tmp_path):
    path = factories.write_sessions(str(tmp_path / "train"), 32, n_files=2)
    with pytest.raises(ValueError, match=r"device_batches=True .* num_workers=0, got num_workers=2"):
        loader(path, state(), num_workers=2, device_batches=True)


@pytest.mark.parametrize("device", factories.cpu_and_cuda())
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
