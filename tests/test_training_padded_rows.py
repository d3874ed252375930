"""Padded batches gathered from a partition's Arrow buffers equal the general path's.

The general path is ``batch_tensors`` over the batch's rows taken out of the table, then
``pad_lists_fn``: the one crop-and-pad rule. ``tests/test_training_columnar.py`` compares
whole loaders, this path included, with Merlin's; here the two paths meet on random tables
that the loaders' files do not hold: sliced tables (offsets that do not start at 0), empty
and long sessions, several dtypes, batches across two partitions, and what must go the
general path (null rows, columns that disagree on a session's length).
"""

import numpy as np
import pyarrow as pa
import pytest
import torch

from t4r_training_factories import cpu_and_cuda
from merlin_t4r_ops.errors import SessionLengthError, T4ROpsError
from merlin_t4r_ops.sequence import pad_lists_fn
from merlin_t4r_ops.training import padded_rows
from merlin_t4r_ops.training.columnar import (
    ColumnLayout,
    EpochDataset,
    PadSpec,
    batch_tensors,
    plan_batches,
    split_targets,
)
from merlin_t4r_ops.training.padded_rows import PartitionArrays, padded_batch

LAYOUT = ColumnLayout(
    kinds={"item_id-list": "ragged", "price-list": "ragged", "flag-list": "ragged",
           "click": "scalar", "rating": "scalar", "seen": "scalar", "price": "scalar"},
    targets=("click",),
)
IDS = ("item_id-list",)


def random_table(rng, rows: int, lengths=None) -> pa.Table:
    lengths = rng.integers(0, 30, rows) if lengths is None else np.asarray(lengths)
    def lists(values):
        return pa.ListArray.from_arrays(np.r_[0, np.cumsum(lengths)].astype(np.int32), values)
    total = int(lengths.sum())
    return pa.table({
        "item_id-list": lists(pa.array(rng.integers(1, 1000, total), pa.int64())),
        "price-list": lists(pa.array(rng.random(total), pa.float32())),
        "flag-list": lists(pa.array(rng.random(total) > 0.5)),
        "click": pa.array(rng.integers(0, 2, rows), pa.int64()),
        "rating": pa.array(rng.random(rows), pa.float64()),
        "seen": pa.array(rng.random(rows) > 0.5),  # bool: no zero-copy numpy view
        "price": pa.array(rng.random(rows), pa.float16()),
    })


def general(tables_and_rows, width):
    taken = pa.concat_tables([table.take(pa.array(rows)) for table, rows in tables_and_rows])
    return pad_lists_fn(width, (), IDS)(*batch_tensors(taken, LAYOUT))


def fast(tables_and_rows, width, layout=LAYOUT):
    parts = [(PartitionArrays.of(table, layout), rows) for table, rows in tables_and_rows]
    tensors = padded_batch(parts, layout, width, IDS)
    return None if tensors is None else split_targets(tensors, layout)


def assert_identical(got, expected):
    (x, y), (ex, ey) = got, expected
    assert list(x) == list(ex)
    for name in ex:
        assert x[name].dtype == ex[name].dtype and torch.equal(x[name], ex[name]), name
    assert y.dtype == ey.dtype and torch.equal(y, ey)


@pytest.mark.parametrize("width", [1, 10, 40])
def test_a_batch_from_the_partitions_buffers_is_the_general_paths(width):
    rng = np.random.default_rng(width)
    for _ in range(20):
        table = random_table(rng, 300)
        sliced = table.slice(37, 200)  # its lists' offsets start past 0
        first = rng.permutation(200)[:50]
        second = rng.permutation(300)[:14]
        assert_identical(fast([(sliced, first)], width), general([(sliced, first)], width))
        both = [(sliced, first), (table, second)]  # a batch across two partitions
        assert_identical(fast(both, width), general(both, width))


def test_several_targets_come_as_a_dict_as_on_the_general_path():
    layout = ColumnLayout(kinds=LAYOUT.kinds, targets=("click", "rating"))
    table, rows = random_table(np.random.default_rng(1), 40), np.arange(40)[::-1]
    x, y = fast([(table, rows)], 10, layout)
    ex, ey = pad_lists_fn(10, (), IDS)(*batch_tensors(table.take(pa.array(rows)), layout))
    assert list(x) == list(ex) and list(y) == list(ey) == ["click", "rating"]
    assert all(torch.equal(y[name], ey[name]) for name in ey)


def test_sessions_whose_lists_disagree_are_left_to_the_general_path_which_refuses_them():
    table = random_table(np.random.default_rng(2), 10, lengths=[3] * 10)
    prices = pa.ListArray.from_arrays(pa.array([0, 3, 6, 8] + [8 + 3 * i for i in range(1, 8)],
                                               pa.int32()), pa.array(np.ones(29, np.float32)))
    table = table.set_column(1, "price-list", prices)  # row 2 holds 2 prices for 3 items
    rows = np.arange(10)
    assert fast([(table, rows)], 5) is None
    with pytest.raises(SessionLengthError, match=r"row 2: .*'item_id-list': 3, 'price-list': 2"):
        general([(table, rows)], 5)


def test_a_partition_with_a_null_row_goes_the_general_path_which_names_the_column():
    table = random_table(np.random.default_rng(3), 5, lengths=[2] * 5)
    items = pa.array([[1, 2], None, [3, 4], [5, 6], [7, 8]], pa.list_(pa.int64()))
    table = table.set_column(0, "item_id-list", items)
    assert PartitionArrays.of(table, LAYOUT) is None
    with pytest.raises(T4ROpsError, match="list column 'item_id-list' holds 1 null rows"):
        general([(table, np.arange(5))], 5)


def test_fixed_lists_and_text_go_the_general_path():
    table = random_table(np.random.default_rng(4), 5)
    fixed = ColumnLayout(kinds={**LAYOUT.kinds, "price-list": "fixed"}, targets=("click",))
    assert PartitionArrays.of(table, fixed) is None
    names = table.set_column(3, "click", pa.array(list("abcde")))
    assert PartitionArrays.of(names, LAYOUT) is None
    list_target = ColumnLayout(kinds=LAYOUT.kinds, targets=("price-list",))
    assert not PartitionArrays.fits(list_target) and not PartitionArrays.fits(fixed)


class TableReader:
    """Partitions from tables in memory, through the interface ``EpochDataset`` reads by."""

    def __init__(self, tables):
        self.tables, self.reads = tables, []

    def read(self, partition: int) -> pa.Table:
        self.reads.append(partition)
        return self.tables[partition]


def test_a_batch_over_more_partitions_than_the_cache_holds_reads_each_once():
    # Partitions of 5 rows, batches of 16: a batch spans four, the cache keeps two. A null
    # rating in partition 0 sends the first batch the general path after the buffers' try.
    rng = np.random.default_rng(5)
    tables = [random_table(rng, 5) for _ in range(6)]
    ratings = pa.array([None, 1.0, 2.0, 3.0, 4.0], pa.float64())
    tables[0] = tables[0].set_column(tables[0].schema.get_field_index("rating"), "rating",
                                     ratings)
    reader = TableReader(tables)
    plan = plan_batches([(p, 0, 5) for p in range(6)], 16, drop_last=False)
    epoch = EpochDataset(reader, LAYOUT, plan, [5] * 6, seed=0, epoch=0, shuffle=False,
                         pad=PadSpec(10, tuple(LAYOUT.kinds)[:3], IDS))
    assert sum(len(y) for _, y in epoch) == 30
    assert reader.reads == list(range(6))


DEVICES = cpu_and_cuda()


def on_host(batch):
    x, y = batch
    return {name: t.cpu() for name, t in x.items()}, y.cpu()


def on(device, batch):
    x, y = batch
    return all(t.device == device for t in [*x.values(), y])


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_gathered_on_the_device_is_the_host_gather(device):
    rng = np.random.default_rng(6)
    for width in (1, 10, 40):
        table = random_table(rng, 300)
        sliced, rows = table.slice(11, 250), rng.permutation(250)[:60]
        for pieces in ([(sliced, rows)], [(sliced, rows), (table, rng.permutation(300)[:9])]):
            parts = [(PartitionArrays.of(t, LAYOUT).to(device), r) for t, r in pieces]
            got = split_targets(padded_batch(parts, LAYOUT, width, IDS), LAYOUT)
            assert on(device, got)
            assert_identical(on_host(got), general(pieces, width))


def test_columns_whose_dtypes_torch_may_not_index_on_the_device_stay_on_the_host():
    table = random_table(np.random.default_rng(7), 20)
    table = table.set_column(3, "click", pa.array(np.arange(20, dtype=np.uint32)))
    moved = PartitionArrays.of(table, LAYOUT).to(torch.device("meta"))
    assert isinstance(moved.scalars["click"], np.ndarray)
    assert all(isinstance(moved.scalars[name], torch.Tensor) for name in ("rating", "seen"))


def test_a_partition_whose_columns_all_stay_on_the_host_uploads_no_positions(monkeypatch):
    rng = np.random.default_rng(9)
    lengths = rng.integers(0, 30, 20)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    table = pa.table({"item_id-list": pa.ListArray.from_arrays(
                          offsets, pa.array(rng.integers(1, 1000, lengths.sum()), pa.uint32())),
                      "click": pa.array(np.arange(20, dtype=np.uint32))})
    layout = ColumnLayout(kinds={"item_id-list": "ragged", "click": "scalar"}, targets=("click",))
    uploads = []
    monkeypatch.setattr(padded_rows, "_upload", lambda *a: uploads.append(a))
    moved = PartitionArrays.of(table, layout).to(torch.device("meta"))
    got = moved.padded(np.arange(20), 10, IDS)
    assert moved.device is None and not uploads
    assert all(isinstance(column, np.ndarray) for column in got.values())


def seven_row_partitions(rng, null_rating: bool):
    """Four partitions of 7 rows; a null rating sends partition 0 the general path."""
    tables = [random_table(rng, 7) for _ in range(4)]
    if null_rating:
        tables[0] = tables[0].set_column(tables[0].schema.get_field_index("rating"), "rating",
                                         pa.array([None] + [1.0] * 6, pa.float64()))
    return tables


def epoch_of(tables, device):
    """A shuffled epoch's batches of 5 over ``tables``, made on ``device`` (None: the host)."""
    plan = plan_batches([(p, 0, 7) for p in range(len(tables))], 5, drop_last=False)
    return list(EpochDataset(TableReader(tables), LAYOUT, plan, [7] * len(tables), seed=3,
                             epoch=1, shuffle=True, pad=PadSpec(10, tuple(LAYOUT.kinds)[:3], IDS),
                             device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_an_epoch_on_a_device_gives_the_host_epochs_batches_there_the_general_paths_too(device):
    # A null rating sends partition 0's batches the general path; they come on the device too.
    tables = seven_row_partitions(np.random.default_rng(8), null_rating=True)
    expected, got = epoch_of(tables, None), epoch_of(tables, device)
    assert len(got) == len(expected) == 6
    for batch, host in zip(got, expected):
        assert on(device, batch)
        # the null rating is NaN on both
        torch.testing.assert_close(on_host(batch), host, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("odd_partitions", ["a null rating", "uint32 clicks"])
def test_an_epoch_on_a_device_without_a_gpu_meta_holds_every_tensor_there_in_the_hosts_layout(
        odd_partitions):
    """On torch's ``meta`` device (shapes, no values) the CPU's CI sees what a GPU run gets:
    each batch's tensors on the device, in the host batch's keys, dtypes and shapes: batches
    from the general path (a null in partition 0), and uint32 columns, which ``to`` leaves on
    the host, included."""
    null_rating = odd_partitions == "a null rating"
    tables = seven_row_partitions(np.random.default_rng(9), null_rating)
    if not null_rating:
        tables = [t.set_column(3, "click", pa.array(np.arange(7, dtype=np.uint32)))
                  for t in tables]
    meta = torch.device("meta")
    expected, got = epoch_of(tables, None), epoch_of(tables, meta)
    assert len(got) == len(expected) == 6
    for (x, y), (ex, ey) in zip(got, expected):
        assert list(x) == list(ex)
        for tensor, host in [*zip(x.values(), ex.values()), (y, ey)]:
            assert tensor.device == meta and tensor.dtype == host.dtype
            assert tensor.shape == host.shape


def test_partition_arrays_moved_to_a_device_gather_there():
    arrays = PartitionArrays.of(random_table(np.random.default_rng(10), 30), LAYOUT)
    moved = arrays.to(torch.device("meta"))
    assert moved.device == torch.device("meta") and arrays.device is None
    out = moved.padded(np.arange(30)[::-1].copy(), 10, IDS)
    assert {t.device.type for t in out.values()} == {"meta"}
    assert out["item_id-list"].shape == (30, 10)


def test_a_batch_over_partitions_that_store_a_column_in_other_dtypes_is_promoted_as_on_the_host():
    rng = np.random.default_rng(11)
    first, second = random_table(rng, 9), random_table(rng, 9)
    second = second.set_column(3, "click", pa.array(np.arange(9, dtype=np.uint32)))
    pieces = [(first, rng.permutation(9)[:6]), (second, rng.permutation(9)[:4])]
    host = fast(pieces, 10)
    parts = [(PartitionArrays.of(t, LAYOUT).to(torch.device("cpu")), r) for t, r in pieces]
    on_device = split_targets(padded_batch(parts, LAYOUT, 10, IDS), LAYOUT)
    assert host[1].dtype == torch.int64
    assert_identical(on_device, host)
