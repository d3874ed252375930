"""The project's Trainer returns what ``transformers4rec.torch.Trainer`` 23.12 returns.

The contract is T4R's own ``tests/unit/torch/test_trainer.py`` (v23.12.00):
``test_trainer_eval_loop`` / ``test_evaluate_results`` (``eval_/loss`` is reported),
``test_trainer_predict_topk`` / ``test_trainer_predict_top_k_x_top_k`` (``(ids, scores)``
of width ``predict_top_k or model.top_k``, full scores without either, the ``ValueError``)
and ``test_trainer_with_multiple_tasks`` (a dict by task; ``[rows]`` for the non-next-item
tasks). Each case runs both trainers on the same model and data, single process.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import EarlyStoppingCallback, TrainerCallback
from transformers4rec.torch import Trainer as T4RTrainer

import t4r_training_factories as factories

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import (  # noqa: E402
    ITEM_COL,
    MAX_LEN,
    N_ITEMS,
    make_args,
    make_model,
    make_schema,
    write_sessions,
)

from merlin_t4r_ops.training import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")
TOO_LARGE = "The args.predict_top_k should not be larger than model.top_k"


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    train, _ = write_sessions(str(root / "train"), 128, 2, seed=0)
    evals, eval_sessions = write_sessions(str(root / "eval"), 100, 3, seed=1)
    return {"train": train, "eval": evals, "eval_sessions": eval_sessions}


def _both(model, out, schema, **args):
    """(ours, T4R's) on one model; T4R's with its own defaults for everything else."""
    ours = Trainer(model=model, args=make_args(str(out / "ours"), **args), strategy="single",
                   schema=schema)
    theirs = T4RTrainer(model=model, args=make_args(str(out / "theirs"), **args), schema=schema)
    return ours, theirs


def _assert_same_predictions(ours, theirs):
    assert type(ours) is type(theirs)
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            _assert_same_predictions(ours[key], theirs[key])
    elif isinstance(theirs, tuple):
        assert len(ours) == len(theirs) == 2
        (our_ids, our_scores), (their_ids, their_scores) = ours, theirs
        assert our_ids.dtype == their_ids.dtype and our_ids.shape == their_ids.shape
        np.testing.assert_array_equal(our_ids, their_ids)
        np.testing.assert_allclose(our_scores, their_scores, rtol=1e-5, atol=1e-6)
    else:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


# ---- evaluate(): the loss ---------------------------------------------------------------------


def test_evaluate_without_compute_metrics_reports_the_exact_loss(sessions, tmp_path):
    model = make_model(make_schema(), seed=3)
    ours = Trainer(model=model, args=make_args(str(tmp_path)), strategy="single",
                   schema=make_schema(), eval_dataset_or_path=sessions["eval"])
    metrics = ours.evaluate()
    assert [k for k in metrics if k.startswith("eval_/")] == ["eval_/loss"]

    # One batch of all 100 sessions: the mean over every target of the eval set.
    padded = torch.zeros(100, MAX_LEN, dtype=torch.long)
    for row, items in enumerate(sessions["eval_sessions"]):
        padded[row, : len(items)] = torch.tensor(items)
    model.eval()
    with torch.no_grad():
        exact = float(model({ITEM_COL: padded}, testing=True)["loss"])
    assert metrics["eval_/loss"] == pytest.approx(exact, rel=1e-6)

    ours.compute_metrics = True
    assert ours.evaluate()["eval_/loss"] == pytest.approx(exact, rel=1e-6)


def test_best_model_and_early_stopping_read_the_eval_loss(sessions, tmp_path):
    # metric_for_best_model and EarlyStoppingCallback need eval_/loss without compute_metrics.
    args = make_args(str(tmp_path), num_train_epochs=3, evaluation_strategy="epoch",
                     save_strategy="epoch", load_best_model_at_end=True,
                     metric_for_best_model="/loss", greater_is_better=False)
    trainer = Trainer(model=make_model(make_schema()), args=args, strategy="single",
                      schema=make_schema(), train_dataset_or_path=sessions["train"],
                      eval_dataset_or_path=sessions["eval"],
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    trainer.train()
    losses = [h["eval_/loss"] for h in trainer.state.log_history if "eval_/loss" in h]
    assert len(losses) >= 2
    assert trainer.state.best_metric == min(losses)
    assert trainer.state.best_model_checkpoint is not None


def test_evaluate_with_several_tasks_equals_fit_evaluate(tmp_path_factory):
    """Before: "ValueError: not enough values to unpack (expected 4, got 2)", since the
    per-task loss sums were summed again over the tasks, which shifted every metric."""
    from merlin_t4r_ops.training import evaluate

    path = factories.write_sessions(str(tmp_path_factory.mktemp("multi")), 50, seed=3)
    model = factories.build_model("multi")
    ours = Trainer(model=model, args=make_args(str(tmp_path_factory.mktemp("out")),
                                               max_sequence_length=factories.MAX_LEN),
                   strategy="single", schema=factories.session_schema(),
                   eval_dataset_or_path=path)
    ours.compute_metrics = True
    got = ours.evaluate()
    want = evaluate(model, path, strategy="single", batch_size=50)
    assert len(want) == 11
    for name, value in want.items():
        assert got[f"eval_/{name}"] == pytest.approx(value, rel=1e-6), name


# ---- predict(): T4R's return values -----------------------------------------------------------


@pytest.mark.parametrize("top_k", [10, None])
@pytest.mark.parametrize("predict_top_k", [5, 10, 15, None])
def test_predict_matches_transformers4rec(predict_top_k, top_k, sessions, tmp_path):
    # T4R's test_trainer_predict_top_k_x_top_k, against T4R's Trainer itself. Causal (GPT-2):
    # an untrained MLM model scores its mask embedding, the same items for every session.
    model = make_model(make_schema(), arch="gpt2", seed=6)
    model.top_k = top_k
    ours, theirs = _both(model, tmp_path, make_schema(), predict_top_k=predict_top_k)
    if predict_top_k and top_k and predict_top_k > top_k:
        for trainer in (ours, theirs):
            with pytest.raises(ValueError, match=TOO_LARGE):
                trainer.predict(sessions["eval"])
        with pytest.raises(ValueError, match=r"predict_top_k=15, model.top_k=10"):
            ours.predict(sessions["eval"])
        return
    our_out, their_out = ours.predict(sessions["eval"]), theirs.predict(sessions["eval"])
    _assert_same_predictions(our_out.predictions, their_out.predictions)
    assert our_out.label_ids is None and their_out.label_ids is None
    expected_k = predict_top_k or top_k
    if expected_k:
        ids, scores = our_out.predictions
        assert ids.shape == scores.shape == (100, expected_k)
        # (ids, scores): ids are items, scores sorted best first.
        assert np.issubdtype(ids.dtype, np.integer) and (np.diff(scores, axis=1) <= 0).all()
    else:
        assert our_out.predictions.shape == (100, N_ITEMS + 1)


@pytest.mark.parametrize("top_k", [None, 10])
def test_predict_with_several_tasks_matches_transformers4rec(top_k, tmp_path_factory):
    # T4R's test_trainer_with_multiple_tasks: next-item (ids, scores), the others [rows].
    path = factories.write_sessions(str(tmp_path_factory.mktemp("multi")), 50, seed=3)
    model = factories.build_model("multi")
    model.top_k = top_k
    ours, theirs = _both(model, tmp_path_factory.mktemp("out"), factories.session_schema(),
                         predict_top_k=5, max_sequence_length=factories.MAX_LEN)
    our_preds = ours.predict(path).predictions
    _assert_same_predictions(our_preds, theirs.predict(path).predictions)
    assert our_preds["next-item"][0].shape == our_preds["next-item"][1].shape == (50, 5)
    assert our_preds["click/binary_classification_task"].shape == (50,)
    assert our_preds["rating/regression_task"].shape == (50,)


# ---- evaluate(): log_predictions -------------------------------------------------------------


def test_evaluate_logs_predictions_like_transformers4rec(sessions, tmp_path):
    # T4R's evaluation loop hands each batch's top-k ids and scores, labels and batch metrics
    # to log_predictions_callback when args.log_predictions is set.
    model = make_model(make_schema(), arch="gpt2", seed=6)
    ours, theirs = _both(model, tmp_path, make_schema(), predict_top_k=5, log_predictions=True)
    logged = {}
    for name, trainer in (("ours", ours), ("theirs", theirs)):
        calls = logged[name] = []
        trainer.log_predictions_callback = lambda **kwargs: calls.append(kwargs)  # noqa: B023
        trainer.compute_metrics, trainer.eval_dataset_or_path = True, sessions["eval"]
        trainer.evaluate()
    assert len(logged["ours"]) == len(logged["theirs"]) == 7, {k: len(v) for k, v in logged.items()}
    for our_call, their_call in zip(logged["ours"], logged["theirs"]):
        assert set(our_call) == set(their_call)
        assert our_call["dataset_type"] == their_call["dataset_type"] == "eval"
        np.testing.assert_array_equal(our_call["labels"], their_call["labels"])
        np.testing.assert_array_equal(our_call["pred_item_ids"], their_call["pred_item_ids"])
        np.testing.assert_allclose(our_call["pred_item_scores"], their_call["pred_item_scores"],
                                   rtol=1e-5, atol=1e-6)
        assert our_call["pred_item_scores"].dtype == np.float32
        assert set(our_call["metrics"]) == set(their_call["metrics"])


# ---- train(): the arguments the loop leaves and the trackers record ---------------------------


class RecordsArguments(TrainerCallback):
    """What a tracker records of the run's arguments (W&B and MLflow call ``args.to_dict()``)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.recorded = args.to_dict()


def _trained_arguments(trainer_class, sessions, out):
    tracker = RecordsArguments()
    args = make_args(str(out), logging_steps=0.5, save_steps=0.25)
    trainer = trainer_class(model=make_model(make_schema(), seed=0), args=args,
                            schema=make_schema(), train_dataset_or_path=sessions["train"],
                            callbacks=[tracker], **extra_for(trainer_class))
    trainer.train()
    paths = ("output_dir", "logging_dir", "run_name")  # run_name defaults to output_dir
    recorded = {k: v for k, v in tracker.recorded.items() if k not in paths}
    return trainer.args, recorded


def extra_for(trainer_class):
    return {"strategy": "single"} if trainer_class is Trainer else {}


def test_train_leaves_and_records_the_arguments_as_t4rs_trainer_does(sessions, tmp_path):
    """Fractional logging and save steps become step counts in the user's arguments, and
    trackers record the user's ``logging_nan_inf_filter`` (the loop's own flags stay inside)."""
    ours, our_record = _trained_arguments(Trainer, sessions, tmp_path / "ours")
    theirs, their_record = _trained_arguments(T4RTrainer, sessions, tmp_path / "theirs")
    assert (ours.logging_steps, ours.save_steps) == (theirs.logging_steps, theirs.save_steps)
    assert isinstance(ours.logging_steps, int) and ours.logging_steps >= 1
    assert our_record == their_record
    assert our_record["logging_nan_inf_filter"] is True
