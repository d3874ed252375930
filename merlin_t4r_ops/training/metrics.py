"""Evaluation metrics: the tasks' own torchmetrics objects, plus an exact loss.

A T4R task carries its metrics as torchmetrics objects (``metrics=(AUROC,
Accuracy)`` on a binary task, ``(MAE, RMSE)`` on a regression task, ranking
metrics on a next-item task). :class:`MetricAccumulator` feeds them each batch
through the model's own ``calculate_metrics`` and reads them with its
``compute_metrics``, as T4R's Trainer does, so the keys and values are T4R's.
Under DDP torchmetrics itself reduces their *states* across ranks on
``compute()`` (sums for counts, concatenation for per-example values), so every
rank returns the numbers of a single-process evaluation over the whole eval
set, and no prediction is gathered by this module.

The loss is ours: each task's mean over all its targets of the eval set, from
per-task loss sums and target counts all-reduced once (T4R's Trainer reports
the mean of per-batch means, which depends on batching and on the sharding).
"""

import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from merlin_t4r_ops.training.data_parallel import loss_sum_and_count
from merlin_t4r_ops.training.metric_states import align_empty_states
from merlin_t4r_ops.training.state import DistributedState, unwrap_model

__all__ = ["MetricAccumulator", "prediction_tasks", "task_metric_names"]


def prediction_tasks(model) -> List[Tuple[str, object]]:
    """``(task_name, task)`` for every prediction task of a T4R model's heads."""
    model = unwrap_model(model)
    tasks = []
    for head in getattr(model, "heads", []):
        for name, task in head.prediction_task_dict.items():
            tasks.append((name, task))
    if not tasks:
        raise TypeError(
            f"model must be a transformers4rec.torch.Model with at least one prediction task, "
            f"got {type(model).__name__} without heads"
        )
    return tasks


def task_metric_names(model) -> List[str]:
    """The flat metric names that T4R's ``compute_metrics`` reports for ``model``.

    A next-item task reports each ranking metric per cut-off (``..._at_10``) and
    drops metrics without cut-offs, as
    ``NextItemPredictionTask.compute_metrics`` does.
    """
    from transformers4rec.torch import NextItemPredictionTask

    names = []
    for _, task in prediction_tasks(model):
        for metric in task.metrics:
            if not isinstance(task, NextItemPredictionTask):
                names.append(task.metric_name(metric))
            elif getattr(metric, "top_ks", None):
                names += [f"{task.metric_name(metric)}_{k}" for k in metric.top_ks]
    return names


def _flatten(metrics: dict) -> Dict[str, float]:
    # T4R's own flattening (transformers4rec.torch.trainer.process_metrics).
    from transformers4rec.torch.trainer import process_metrics

    return {k: float(v) for k, v in process_metrics(metrics).items()}


def _pick(outputs, name):
    return outputs[name] if isinstance(outputs, dict) else outputs


def _rows(scores: torch.Tensor) -> int:
    return scores.reshape(-1, scores.size(-1)).shape[0]


def _twice(outputs, names):
    """``outputs`` with the rows of the tasks ``names`` repeated (all of a bare tensor)."""
    if not isinstance(outputs, dict):
        return torch.cat([outputs, outputs])
    return {k: torch.cat([v, v]) if k in names else v for k, v in outputs.items()}


class MetricAccumulator:
    """Accumulate a T4R model's task metrics and loss; reduce them across ranks once.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Its tasks' torchmetrics objects accumulate the metrics; they are reset
        here and by :meth:`reset`.
    state : DistributedState
        Under DDP, :meth:`compute` is a collective: every rank must call it.

    Notes
    -----
    Names are T4R's: ``next-item/ndcg_at_10``,
    ``click/binary_classification_task/binary_accuracy``,
    ``rating/regression_task/mean_absolute_error``, ..., plus ``loss`` (each
    task's mean over all its targets of the eval set, weighted as the model's
    loss weighs its tasks: each batch, and under DataParallel each replica,
    weighted by its number of targets; see
    :func:`~merlin_t4r_ops.training.data_parallel.loss_sum_and_count`).
    """

    def __init__(self, model, state: DistributedState):
        self.state = state
        self.model = unwrap_model(model)
        from transformers4rec.torch import NextItemPredictionTask

        tasks = prediction_tasks(model)
        self.n_tasks = len(tasks)
        self._next_item = {n: t for n, t in tasks if isinstance(t, NextItemPredictionTask)}
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated so far, the tasks' metric states included."""
        self._loss_sum = torch.zeros(self.n_tasks, dtype=torch.float64)
        self._n_targets = torch.zeros(self.n_tasks, dtype=torch.float64)
        self.model.reset_metrics()

    def update(self, output: dict, with_metrics: bool = True):
        """Add one batch of ``model(x, targets=y, testing=True)`` output.

        Parameters
        ----------
        output : dict
            With ``loss`` and ``labels``, or the ``loss_sum`` and ``n_targets``
            of a :class:`~merlin_t4r_ops.training.data_parallel.ReplicaLoss`
            (DataParallel); and ``predictions`` and ``labels`` for the task
            metrics (dicts keyed by task name when the model has several
            tasks).
        with_metrics : bool
            Whether this batch updates the task metrics too (T4R's Trainer
            updates them every ``compute_metrics_each_n_steps`` batches).

        Returns
        -------
        dict or None
            The batch's metrics from ``model.calculate_metrics``, or ``None``
            when the task metrics were not updated.
        """
        loss_sum, n_targets = loss_sum_and_count(output, self.model)
        self._loss_sum += loss_sum.detach().to("cpu", torch.float64).reshape(-1)
        self._n_targets += n_targets.detach().to("cpu", torch.float64).reshape(-1)
        if not with_metrics or output.get("predictions") is None:
            return None
        return self._calculate_metrics(output["predictions"], output["labels"])

    def _calculate_metrics(self, predictions, labels):
        # T4R's RecallAt squeezes its row index to 0-dim and fails on a one-row
        # batch (the last batch of many eval sets): such a row goes in twice and
        # its ranking metrics' per-example state keeps one copy.
        one_row = [name for name in self._next_item
                   if _rows(_pick(predictions, name)) == 1]
        if not one_row:
            return self.model.calculate_metrics(predictions, labels)
        predictions, labels = _twice(predictions, one_row), _twice(labels, one_row)
        batch_metrics = self.model.calculate_metrics(predictions, labels)
        for name in one_row:
            for metric in self._next_item[name].metrics:
                if getattr(metric, "metric_mean", None):
                    metric.metric_mean[-1] = metric.metric_mean[-1][:1]
        return batch_metrics

    def compute(self, with_metrics: bool = True) -> Dict[str, float]:
        """Reduce across ranks (under DDP) and return ``loss`` and the task metrics.

        Every rank must call this, with the same ``with_metrics``, even one that
        saw no batch. An evaluation over no target at all (on any rank) returns
        NaN for every metric, with a warning, as a mean over nothing is.
        """
        totals = torch.stack([self._loss_sum, self._n_targets])
        if self.state.is_distributed and dist.is_initialized():
            totals = totals.to(self.state.device)
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        loss_sum, n_targets = totals.cpu()
        names = task_metric_names(self.model) if with_metrics else []
        if float(n_targets.sum()) == 0:
            warnings.warn(
                "evaluation saw no rows (an empty eval set, or max_steps/eval_steps of 0): "
                "its loss and metrics are NaN", RuntimeWarning, stacklevel=2,
            )
            return {name: float("nan") for name in ["loss", *names]}
        loss = float((loss_sum / n_targets.clamp(min=1)).sum())
        if not with_metrics:
            return {"loss": loss}
        # torchmetrics all-gathers/all-reduces the states here under DDP; a rank
        # without rows first takes the others' row layout.
        align_empty_states(self.model, self.state)
        return {"loss": loss, **_flatten(self.model.compute_metrics())}
