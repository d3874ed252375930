"""The one timer of the in-process benchmarks: the median of repeated calls."""

import time

import numpy as np


def p50_ms(fn, repeats):
    """p50 milliseconds of ``fn()`` over ``repeats`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))
