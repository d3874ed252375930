"""Categorify's lookup in the workflow fast path: bisecting against hashing, side by side.

A ``Categorify`` fitted on a catalogue of ``--items`` item ids, int or string, then the fast
path's lookup (``merlin_t4r_ops.workflow.arrays.CategorifyArrays``) of the items of a batch
of raw sessions (1 to 20 items, one in fifty unknown), p50 over ``--repeats`` calls:

* ``searchsorted``: the sorted vocabulary bisected, string ids first cast to fixed-width
  text (what every id went through before string vocabularies got a hash index);
* ``fast path``: the lookup as it runs now: the same for int ids and below 512 ids; from
  512 ``str`` ids a hash index (``pandas.Index.get_indexer``), its misses bisected.

Both give the same ids (checked). CPU only: the fast path runs on the host.

Usage::

    python benchmarks/workflow_lookup.py
    python benchmarks/workflow_lookup.py --items 500000 --batch-sizes 1,256,1024
"""

import argparse
import tempfile

import numpy as np

from timing import p50_ms


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--repeats", type=int, default=2000)
    return p.parse_args(argv)


def fitted_categorify(items, string_ids, directory):
    """A ``CategorifyArrays`` of a ``Categorify`` fitted on ``items`` ids."""
    import nvtabular as nvt
    import pandas as pd
    from merlin.io import Dataset

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet
    from merlin_t4r_ops.workflow.arrays import CategorifyArrays

    op = nvt.ops.Categorify(out_path=str(directory))
    workflow = nvt.Workflow(["item"] >> op)
    with cpu_datasets_quiet():
        workflow.fit(Dataset(pd.DataFrame({"item": raw_ids(np.arange(items), string_ids)}),
                             npartitions=1))
    return CategorifyArrays(op, ["item"], {"item": np.int64})


def raw_ids(codes, string_ids):
    ids = 10_000_000_000 + 7_919 * np.asarray(codes, dtype=np.int64)
    return np.array([f"sku-{i}" for i in ids], dtype=object) if string_ids else ids


def batch_ids(batch, items, string_ids, rng):
    """The item ids of ``batch`` sessions of 1 to 20 items, one in fifty unknown."""
    count = int(rng.integers(1, 21, size=batch).sum())
    codes = np.where(rng.random(count) < 0.02, items + 13, rng.integers(0, items, size=count))
    return raw_ids(codes, string_ids)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"Categorify of {args.items:,} item ids; sessions of 1 to 20 items; "
          f"p50 of {args.repeats} calls, microseconds")
    print("| ids | batch | ids looked up | searchsorted | fast path | searchsorted / fast path |")
    print("|---|---:|---:|---:|---:|---:|")
    for string_ids in (False, True):
        twin = fitted_categorify(args.items, string_ids, tempfile.mkdtemp())
        sorted_values, ids = twin.vocabularies["item"]
        index = twin.string_indexes["item"]
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            values = batch_ids(batch, args.items, string_ids, rng)
            before = twin._lookup(values, sorted_values, ids)
            after = twin._lookup(values, sorted_values, ids, index)
            assert np.array_equal(before, after)
            bisect = 1e3 * p50_ms(lambda: twin._lookup(values, sorted_values, ids), args.repeats)
            fast = 1e3 * p50_ms(lambda: twin._lookup(values, sorted_values, ids, index),
                               args.repeats)
            print(f"| {'string' if string_ids else 'int'} | {batch} | {len(values):,} | "
                  f"{bisect:.1f} | {fast:.1f} | {bisect / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
