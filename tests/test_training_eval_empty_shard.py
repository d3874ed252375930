"""Evaluation on 2 gloo ranks where one rank holds no eval batch at all.

torchmetrics stands in for an empty list state with a 1-D float tensor, which lines up
neither with the ranking metrics' 2-D per-example state nor with an integer target
state (AUROC): before, the gather of the states aborted. Every rank must report what
one process reports over all rows.
"""

import os
import sys

import pytest

import t4r_training_factories as factories
from torchrun_launch import torchrun
from merlin_t4r_ops.training import evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "training_scripts", "ddp_eval_empty.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from ddp_eval_empty import BATCH, MODEL_SEED, TASKS  # noqa: E402


def single_process(task, path):
    model = factories.build_model(task, seed=MODEL_SEED)
    return evaluate(model, path, strategy="single", batch_size=BATCH)


def test_a_rank_without_eval_rows_gets_the_single_process_metrics(tmp_path):
    valid = factories.write_sessions(str(tmp_path / "valid"), 37, seed=1, n_files=2)
    one_row = factories.write_sessions(str(tmp_path / "one-row"), 1, seed=2, n_files=1)
    ranks, _ = torchrun(tmp_path / "out", SCRIPT, "--eval", valid, "--one-row", one_row,
                        timeout=300)
    (got0, _), (got1, _) = ranks
    assert got0 == got1

    for task in TASKS:
        expected = {"rank0-empty": single_process(task, valid),
                    "rank1-empty": single_process(task, valid),
                    "one-row": single_process(task, one_row)}
        for case, metrics in expected.items():
            result = got0[f"{task}/{case}"]
            assert result.keys() == metrics.keys() and len(metrics) >= 3, (task, case)
            for name, value in metrics.items():
                assert result[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, case, name)
