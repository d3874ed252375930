"""ShardedLoader on real Merlin Datasets: shards balanced by rows, reshuffled every epoch.

Shards are built for each rank in one process (sharding needs no process group:
every rank computes the same plan from the seed, which is what these tests check).
"""

import collections
import glob
import os

import pandas as pd
import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, evaluate, fit, make_loader

CPU = torch.device("cpu")
N_ITEMS = 1000  # random sessions over 999 items are unique, so a row names its file


def ddp(rank, world=2, local_rank=None):
    local = rank if local_rank is None else local_rank
    return DistributedState("ddp", rank, local, world, CPU, "sharding test")


def model():
    return factories.build_model("binary", schema=factories.session_schema(N_ITEMS))


def write(path, n_rows, **kwargs):
    return factories.write_sessions(str(path), n_rows, n_items=N_ITEMS, **kwargs)


def stored_rows(path):
    """Every session under ``path`` in file order, with the index of its file."""
    rows = []
    for index, name in enumerate(sorted(glob.glob(os.path.join(path, "*.parquet")))):
        rows += [(tuple(seq), index) for seq in pd.read_parquet(name)["item_id-list"].map(list)]
    assert len({seq for seq, _ in rows}) == len(rows), "test data needs unique sessions"
    return rows


def sessions(loader):
    """Sessions in the order the loader yields them (padding stripped)."""
    return [
        tuple(int(i) for i in row if i != 0)
        for x, _ in loader
        for row in x["item_id-list"].tolist()
    ]


def batch_count(loader):
    return sum(1 for _ in loader)


@pytest.fixture(scope="module")
def eight_files(tmp_path_factory):
    return write(tmp_path_factory.mktemp("eight") / "train", 192, n_files=8)


def test_shuffle_reorders_partitions_and_moves_shards_every_epoch(eight_files):
    where = dict(stored_rows(eight_files))
    everything = collections.Counter(where.keys())
    loaders = [make_loader(eight_files, model(), ddp(r), batch_size=16, shuffle=True, seed=0)
               for r in range(2)]
    file_orders, rank1_shards, file0_orders = [], [], []
    for epoch in range(3):
        shards = []
        for loader in loaders:
            loader.set_epoch(epoch)
            shards.append(sessions(loader))
        # Every rank drew the same plan: together the shards hold every row exactly once.
        assert collections.Counter(shards[0]) + collections.Counter(shards[1]) == everything, epoch
        stream = shards[0] + shards[1]
        file_orders.append([f for i, f in enumerate(map(where.get, stream))
                            if i == 0 or where[stream[i - 1]] != f])
        rank1_shards.append(frozenset(shards[1]))
        file0_orders.append([s for s in stream if where[s] == 0])
    assert all(sorted(order) == list(range(8)) for order in file_orders), file_orders
    assert len({tuple(order) for order in file_orders}) == 3, f"partition orders: {file_orders}"
    rank1_files = [sorted({where[s] for s in shard}) for shard in rank1_shards]
    assert len(set(rank1_shards)) == 3, f"rank 1 read the same files every epoch: {rank1_files}"
    assert len({tuple(order) for order in file0_orders}) == 3, "rows within a file kept their order"


def test_same_epoch_gives_the_same_batches(eight_files):
    a = make_loader(eight_files, model(), ddp(1), batch_size=16, shuffle=True, seed=4)
    b = make_loader(eight_files, model(), ddp(1), batch_size=16, shuffle=True, seed=4)
    first = sessions(a)  # a pass without set_epoch reads the next epoch
    assert sessions(a) != first
    b.set_epoch(0)
    assert sessions(b) == first


def test_a_probe_of_the_first_batch_leaves_the_loaders_data_order(eight_files):
    """The Trainer's unused-parameter probe reads a user's loader before training on it."""
    from merlin_t4r_ops.training.data import first_batch

    probed = make_loader(eight_files, model(), ddp(1), batch_size=16, shuffle=True, seed=4)
    fresh = make_loader(eight_files, model(), ddp(1), batch_size=16, shuffle=True, seed=4)
    probed.set_epoch(2, skip_batches=1)
    fresh.set_epoch(2, skip_batches=1)
    first = first_batch(probed)
    assert sessions([first]) == sessions(fresh)[:16]
    fresh.set_epoch(2, skip_batches=1)
    assert sessions(probed) == sessions(fresh)


def test_uneven_files_are_balanced_by_rows_not_repeated(tmp_path):
    # Files of 1,000 and 100 rows on 2 ranks: by partitions, rank 1 would hold 100 rows and
    # repeat them about 10 times an epoch to keep step with rank 0.
    path = write(tmp_path / "uneven", 1100, sizes=[1000, 100])
    everything = collections.Counter(seq for seq, _ in stored_rows(path))
    for equal_shards in (False, True):
        loaders = [make_loader(path, model(), ddp(r), batch_size=50, equal_shards=equal_shards)
                   for r in range(2)]
        shards = [sessions(loader) for loader in loaders]
        assert [len(s) for s in shards] == [550, 550], equal_shards
        assert collections.Counter(shards[0]) + collections.Counter(shards[1]) == everything
        assert [len(loader) for loader in loaders] == [batch_count(loader) for loader in loaders]
        assert [len(loader) for loader in loaders] == [11, 11]


def test_equal_shards_repeat_at_most_world_size_minus_one_rows(tmp_path):
    path = write(tmp_path / "odd", 101, sizes=[60, 41])
    stream = [seq for seq, _ in stored_rows(path)]
    plain = [sessions(make_loader(path, model(), ddp(r, 4), batch_size=8)) for r in range(4)]
    assert [len(s) for s in plain] == [25, 25, 25, 26]
    assert sum(plain, []) == stream  # without shuffling, rank order is file order
    equal = [sessions(make_loader(path, model(), ddp(r, 4), batch_size=8, equal_shards=True))
             for r in range(4)]
    assert [len(s) for s in equal] == [26, 26, 26, 26]
    assert sum(equal, []) == stream + stream[:3]  # like DistributedSampler: wrap to the start


def test_a_rank_without_rows_yields_no_batch(tmp_path):
    path = write(tmp_path / "one", 1, n_files=1)
    empty, full = (make_loader(path, model(), ddp(r), batch_size=4) for r in range(2))
    assert (len(empty), batch_count(empty)) == (0, 0)
    assert (len(full), batch_count(full)) == (1, 1)


def test_shards_follow_the_global_rank_not_the_local_rank(eight_files):
    # Rank 3 of 4 on a second node has LOCAL_RANK 1: it must read the last quarter.
    stream = [seq for seq, _ in stored_rows(eight_files)]
    loader = make_loader(eight_files, model(), ddp(3, 4, local_rank=1), batch_size=16)
    assert sessions(loader) == stream[144:]


def test_batch_size_is_per_device_under_dataparallel(eight_files):
    """fit and evaluate under DataParallel load batch_size rows per GPU, as Hugging Face does.

    DataParallel needs CUDA; on CPU torch's DataParallel calls the module itself, so the
    model sees the whole batch the loader gives, which DataParallel would split over 2 GPUs.
    """
    dp = DistributedState("dp", 0, 0, 1, CPU, "2 GPUs, stood in for by the CPU", n_devices=2)
    net = model()
    seen = []
    net.register_forward_pre_hook(lambda module, args: seen.append(len(args[0]["item_id-list"])))
    fit(net, eight_files, epochs=1, batch_size=8, strategy=dp, progress=False)
    assert seen == [16] * 12, seen
    seen.clear()
    evaluate(net, eight_files, strategy=dp, batch_size=8)
    assert seen == [16] * 12, seen


def test_set_epoch_with_skipped_batches_starts_the_next_pass_there():
    frame = factories.testing_frame().iloc[:150]
    loader = make_loader(factories.testing_dataset(frame), factories.testing_model(),
                         ddp(1), batch_size=8, shuffle=True, seed=4)
    loader.set_epoch(3)
    full = [x["item_id/list"] for x, _ in loader]
    loader.set_epoch(3, skip_batches=4)
    resumed = [x["item_id/list"] for x, _ in loader]
    assert len(full) == len(loader) == 10 and len(resumed) == 6
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[4:]))
    following = [x["item_id/list"] for x, _ in loader]  # epoch 4, from its first batch
    assert len(following) == 10 and not torch.equal(following[0], full[0])
    with pytest.raises(ValueError, match="skip_batches must be a non-negative int, got -1"):
        loader.set_epoch(0, skip_batches=-1)
