"""The columnar reader yields exactly the batches that Merlin's ``Loader`` yielded before it.

The reference is yesterday's path (``merlin_reference.py``): the same shard handed to Merlin
23.08's torch ``Loader`` and padded by ``pad_lists_fn``. Compared tensor for tensor (keys in
order, dtypes, shapes, values) for both ranks of 2, with and without shuffling and equal
shards, over several epochs and seeds, a mid-epoch start, and 0 and 2 worker processes.
"""

import pytest
import torch

import t4r_training_factories as factories
from merlin_reference import identical, merlin_batches
from merlin_t4r_ops.training import DistributedState
from merlin_t4r_ops.training.data import ShardedLoader, as_dataset

CPU = torch.device("cpu")


def rank_of_two(rank):
    return DistributedState("ddp", rank, rank, 2, CPU, "order test", local_world_size=2)


def assert_same_batches(loader, epoch, skip=0):
    expected = merlin_batches(loader, epoch, skip)
    loader.set_epoch(epoch, skip_batches=skip)
    got = list(loader)
    assert len(got) == len(expected) == max(len(loader) - skip, 0), (len(got), len(expected))
    for index, ((x, y), (ex, ey)) in enumerate(zip(got, expected)):
        assert identical(x, ex) and identical(y, ey), f"batch {index} of epoch {epoch}"


@pytest.fixture(scope="module")
def uneven_files(tmp_path_factory):
    # Partitions of 90, 13 and 100 rows (two row groups each): batches straddle partitions.
    path = tmp_path_factory.mktemp("columnar") / "train"
    return factories.write_sessions(str(path), 203, sizes=[90, 13, 100])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle, equal_shards", [(False, False), (True, True), (True, False)])
def test_parquet_batches_equal_merlin_loaders_for_every_rank(
        uneven_files, num_workers, shuffle, equal_shards):
    dataset = as_dataset(uneven_files)
    for rank in range(2):
        for seed in (0, 7):
            # Ragged values/offsets with two targets (a dict); padded with one (a tensor).
            for targets, width in ((["click", "rating"], None), (["click"], 10)):
                loader = ShardedLoader(
                    dataset, rank_of_two(rank), 16, ["item_id-list", "category-list"], targets,
                    max_sequence_length=width, shuffle=shuffle, seed=seed,
                    equal_shards=equal_shards, drop_last=equal_shards, num_workers=num_workers)
                for epoch in (0, 1):
                    assert_same_batches(loader, epoch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_pass_is_the_rest_of_the_uninterrupted_one(uneven_files, num_workers):
    dataset = as_dataset(uneven_files)
    for rank in range(2):
        loader = ShardedLoader(dataset, rank_of_two(rank), 16, ["item_id-list"], ["click"],
                               max_sequence_length=10, shuffle=True, seed=5,
                               equal_shards=True, num_workers=num_workers)
        loader.set_epoch(2)
        uninterrupted = list(loader)
        for skip in (1, 3, len(loader)):
            assert_same_batches(loader, 2, skip)
            loader.set_epoch(2, skip_batches=skip)
            resumed = list(loader)
            assert len(resumed) == len(uninterrupted) - skip
            assert all(identical(a[0], b[0]) and identical(a[1], b[1])
                       for a, b in zip(resumed, uninterrupted[skip:]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_over_a_dataframe_equals_merlins(num_workers):
    # T4R's packaged data in 4 dask partitions of a pandas frame: no parquet files to read.
    dataset = factories.testing_dataset(factories.testing_frame().iloc[:300])
    names = factories.testing_schema().column_names
    for rank in range(2):
        loader = ShardedLoader(dataset, rank_of_two(rank), 32, names, (),
                               max_sequence_length=factories.TESTING_MAX_LEN, shuffle=True,
                               seed=1, num_workers=num_workers)
        for epoch in (0, 1):
            assert_same_batches(loader, epoch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_leaves_torchs_global_random_stream_alone(uneven_files, num_workers):
    # A DataLoader's iterator draws its base seed from torch's global RNG unless given a
    # generator: one draw a pass would move an MLM model's masks (and a resumed run's).
    loader = ShardedLoader(as_dataset(uneven_files), rank_of_two(0), 16, ["item_id-list"],
                           ["click"], shuffle=True, num_workers=num_workers)
    before = torch.get_rng_state()
    assert len(list(loader)) == len(loader)
    assert torch.equal(torch.get_rng_state(), before)
