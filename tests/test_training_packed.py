"""A loader worker sends each batch as one buffer, and the training process gets it back whole.

Before, ``DataLoader`` sent each of a batch's tensors through a shared-memory segment of its
own (15 for T4R's testing data), which the training process received one by one. The
batches themselves are pinned against Merlin's loader in ``test_training_columnar.py`` (0
and 2 workers); here the form they travel in, and the round trip for every kind of batch.
"""

import pytest
import torch

import t4r_training_factories as factories
from merlin_reference import identical
from merlin_t4r_ops.training import DistributedState
from merlin_t4r_ops.training.data import ShardedLoader, as_dataset
from merlin_t4r_ops.training.packed import PackedBatch

CPU = torch.device("cpu")


def some_tensors():
    return {
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "odd": torch.arange(5, dtype=torch.int8),  # 5 bytes: the next tensor must realign
        "scores": torch.linspace(0, 1, 6, dtype=torch.float32).reshape(3, 2).t(),  # a view
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 7, dtype=torch.float64),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
    }


@pytest.mark.parametrize("y", [None, torch.tensor([1.0, 0.0, 1.0]),
                               {"click": torch.tensor([1, 0, 1]), "rating": torch.ones(3, 2)}],
                         ids=["no targets", "one target", "two targets"])
def test_a_packed_batch_unpacks_to_the_same_tensors_in_the_same_order(y):
    x = some_tensors()
    got_x, got_y = PackedBatch.pack(x, y).unpack()
    assert identical(got_x, x) and identical(got_y, y)


def test_every_tensor_lies_in_the_one_buffer_aligned_for_any_dtype():
    packed = PackedBatch.pack(some_tensors(), None)
    x, _ = packed.unpack()
    base = packed.buffer.data_ptr()
    for name, tensor in x.items():
        assert tensor.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr(), name
        assert (tensor.data_ptr() - base) % 64 == 0, name


@pytest.mark.parametrize("targets, width", [(["click", "rating"], None), (["click"], 10)],
                         ids=["ragged, two targets", "padded, one target"])
def test_batches_from_workers_arrive_as_one_shared_buffer(tmp_path, targets, width):
    path = factories.write_sessions(str(tmp_path / "train"), 64, n_files=2)
    state = DistributedState("single", 0, 0, 1, CPU, "one process")
    loader = ShardedLoader(as_dataset(path), state, 16, ["item_id-list", "category-list"],
                           targets, max_sequence_length=width, num_workers=2)
    batches = list(loader)
    assert len(batches) == 4
    for x, y in batches:
        tensors = list(x.values()) + (list(y.values()) if isinstance(y, dict) else [y])
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(storages) == 1, f"{len(storages)} shared-memory segments for one batch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA GPU, found none")
def test_pinned_batches_from_workers_equal_the_in_process_ones(tmp_path):
    """The pin-memory thread pins the one buffer: every tensor of the batch is pinned."""
    path = factories.write_sessions(str(tmp_path / "train"), 64, n_files=2)
    state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "one GPU")

    def batches(workers):
        return list(ShardedLoader(as_dataset(path), state, 16, ["item_id-list", "category-list"],
                                  ["click"], max_sequence_length=10, num_workers=workers,
                                  pin_memory=bool(workers), device_batches=False))

    expected, got = batches(0), batches(2)
    assert len(got) == len(expected) == 4
    for (x, y), (ex, ey) in zip(got, expected):
        assert identical(x, ex) and identical(y, ey)
        assert all(t.is_pinned() for t in [*x.values(), y])
