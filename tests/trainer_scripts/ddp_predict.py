"""Run by ``torch.distributed.run``: evaluate() and predict() of a large-catalogue model under DDP.

Each rank measures the peak memory of every phase, over the memory it held when
the phase began: Python allocations with ``tracemalloc`` (the pickles that
``torch.distributed``'s object collectives send and receive, numpy arrays) and
the process RSS sampled every millisecond. It writes ``rank{R}.json`` to
``--out`` with those figures and what ``predict()`` returned on that rank.
Used by tests/test_trainer.py and benchmarks/trainer_memory.py.
"""

import argparse
import json
import os
import sys
import threading
import time
import tracemalloc

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_common import make_args, make_model, make_schema  # noqa: E402

from merlin_t4r_ops.training import Trainer  # noqa: E402

PHASES = {
    # evaluate() with compute_metrics; no top-k, so all scores are what a loop could keep.
    "evaluate": lambda trainer, data: trainer.evaluate(),
    "predict_top_k": lambda trainer, data: trainer.predict(data),
    "predict_full": lambda trainer, data: trainer.predict(data),
}
TOP_K = {"evaluate": None, "predict_top_k": 100, "predict_full": None}


class PeakRSS:
    """The largest RSS seen while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def _describe(predictions):
    if predictions is None:
        return None
    if isinstance(predictions, tuple):
        return {"shapes": [list(p.shape) for p in predictions],
                "ids": predictions[0].tolist(), "scores": predictions[1].tolist()}
    return {"shapes": [list(predictions.shape)]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--items", type=int, required=True)
    parser.add_argument("--phases", default="evaluate,predict_top_k")
    opts = parser.parse_args()
    # Started once, before torch.distributed starts its threads, and never stopped: on
    # Python 3.11, tracemalloc.stop() while other threads allocate can crash the process
    # (CPython gh-128679, fixed in 3.12.9 and 3.13.2); it crashed a rank here once.
    tracemalloc.start()

    schema = make_schema(n_items=opts.items)
    model = make_model(schema)
    trainer = Trainer(
        model=model, args=make_args(os.path.join(opts.out, "hf")), strategy="auto",
        schema=schema, eval_dataset_or_path=opts.eval, compute_metrics=True,
    )
    report = {"rank": trainer.dist_state.rank, "phases": {}}
    for phase in opts.phases.split(","):
        trainer.args.predict_top_k = TOP_K[phase]
        trainer.dist_state.barrier()
        tracemalloc.reset_peak()
        held = tracemalloc.get_traced_memory()[0]
        with PeakRSS() as rss:
            result = PHASES[phase](trainer, opts.eval)
        traced = tracemalloc.get_traced_memory()[1] - held
        entry = {"traced_peak": traced, "rss_peak_over_start": rss.peak - rss.start}
        if phase.startswith("predict"):
            entry["predictions"] = _describe(result.predictions)
        else:
            entry["metrics"] = {k: v for k, v in result.items() if k.startswith("eval_/")}
        report["phases"][phase] = entry
        del result
    report["full_scores_bytes"] = 4 * (opts.items + 1)  # per row, float32
    with open(os.path.join(opts.out, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
