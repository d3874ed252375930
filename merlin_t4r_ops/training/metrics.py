"""Evaluation metrics reduced exactly over a dataset sharded across ranks.

T4R's metrics are torchmetrics objects whose ``compute()`` averages per-batch
or per-example values on one process. Averaging per-rank averages is wrong when
shards differ in size, so :class:`MetricAccumulator` keeps *sufficient
statistics* instead (per-example metric sums and example counts, confusion
counts, squared-error sums) in float64, all-reduces them once as one tensor and
only then divides. Every rank therefore returns the same numbers, equal to a
single-process evaluation over the whole eval set.
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from merlin_t4r_ops.training.data_parallel import loss_sum_and_count
from merlin_t4r_ops.training.state import DistributedState, unwrap_model

__all__ = ["MetricAccumulator", "prediction_tasks"]


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


def _kind(task) -> str:
    from transformers4rec.torch import (
        BinaryClassificationTask,
        NextItemPredictionTask,
        RegressionTask,
    )

    if isinstance(task, NextItemPredictionTask):
        return "next-item"
    if isinstance(task, BinaryClassificationTask):
        return "binary"
    if isinstance(task, RegressionTask):
        return "regression"
    raise TypeError(
        f"prediction task must be NextItemPrediction, BinaryClassification or Regression, "
        f"got {type(task).__name__}"
    )


class MetricAccumulator:
    """Accumulate sufficient statistics of T4R outputs; reduce them across ranks once.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Read for its prediction tasks (kind, name, ranking cut-offs).
    state : DistributedState
        Under DDP, :meth:`compute` all-reduces over the default process group.

    Notes
    -----
    Names follow T4R's: ``next-item/ndcg_at_10``, ``click/binary_classification_task/binary_precision``,
    ``rating/regression_task/mean_squared_error``, plus ``loss`` (each task's
    mean over all its targets of the eval set, weighted as the model's loss
    weighs its tasks: each batch, and under DataParallel each replica,
    weighted by its number of targets; see
    :func:`~merlin_t4r_ops.training.data_parallel.loss_sum_and_count`).
    Ranking metrics reuse each T4R ranking metric's per-example ``_metric``, so
    they match T4R's definitions exactly; binary metrics threshold at 0.5 like
    torchmetrics.
    """

    def __init__(self, model, state: DistributedState):
        self.state = state
        self.model = unwrap_model(model)
        self.tasks = [(name, task, _kind(task)) for name, task in prediction_tasks(model)]
        self._sums: Dict[str, torch.Tensor] = {}
        self._layout: List[Tuple[str, int]] = []
        self._ranking = {}
        for name, task, kind in self.tasks:
            if kind == "next-item":
                # Only metrics with cut-offs are per-example ranking metrics we can sum.
                self._ranking[name] = [m for m in task.metrics if getattr(m, "top_ks", None)]
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated so far."""
        self._sums = {}

    def _add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64).reshape(-1)
        if key in self._sums:
            self._sums[key] = self._sums[key] + value.to(self._sums[key].device)
        else:
            self._sums[key] = value

    def update(self, output: dict) -> None:
        """Add one batch of ``model(x, targets=y, testing=True)`` output.

        Parameters
        ----------
        output : dict
            With ``loss`` and ``labels``, or the ``loss_sum`` and ``n_targets``
            of a :class:`~merlin_t4r_ops.training.data_parallel.ReplicaLoss`
            (DataParallel); and ``predictions`` and ``labels`` for the other
            metrics (dicts keyed by task name when the model has several
            tasks). Without ``predictions`` only the loss is accumulated.
        """
        loss_sum, n_targets = loss_sum_and_count(output, self.model)
        self._add("loss/sum", loss_sum)
        self._add("loss/n", n_targets)
        if output.get("predictions") is None:
            return
        preds_all, labels_all = output["predictions"], output["labels"]
        for name, task, kind in self.tasks:
            preds = preds_all[name] if isinstance(preds_all, dict) else preds_all
            labels = labels_all[name] if isinstance(labels_all, dict) else labels_all
            if isinstance(labels, dict):
                labels = labels[task.target_name]
            labels = labels.detach()
            preds = task.forward_to_prediction_fn(preds.detach())
            if kind == "next-item":
                self._update_ranking(name, preds, labels)
            elif kind == "binary":
                self._update_binary(name, preds, labels)
            else:
                err = preds.reshape(-1).to(torch.float64) - labels.reshape(-1).to(torch.float64)
                self._add(f"{name}/sse", (err * err).sum())
                self._add(f"{name}/n", torch.tensor(float(err.numel())))

    def _update_ranking(self, name, preds, labels):
        from transformers4rec.torch.utils.torch_utils import tranform_label_to_onehot

        preds = preds.reshape(-1, preds.size(-1))
        onehot = tranform_label_to_onehot(labels, preds.size(-1)).to(preds.device)
        n = preds.shape[0]
        if n == 1:
            # T4R's RecallAt squeezes its row index to 0-dim and fails on a one-row
            # batch; a duplicated row gives the same per-example value.
            preds, onehot = preds.repeat(2, 1), onehot.repeat(2, 1)
        for metric in self._ranking[name]:
            per_example = metric._metric(list(metric.top_ks), preds, onehot)[:n]
            self._add(f"{name}/{type(metric).__name__}", per_example.sum(0))
        self._add(f"{name}/n", torch.tensor(float(n)))

    def _update_binary(self, name, probs, labels):
        hit = probs.reshape(-1) > 0.5
        truth = labels.reshape(-1) > 0.5
        counts = torch.stack(
            [(hit & truth).sum(), (hit & ~truth).sum(), (~hit & truth).sum(), (~hit & ~truth).sum()]
        )
        self._add(f"{name}/confusion", counts)

    def compute(self) -> Dict[str, float]:
        """Reduce across ranks (under DDP) and return the metrics as floats.

        Every rank must call this, even one that saw no batch; keys are fixed by
        the model's tasks so all ranks all-reduce tensors of one shape.
        """
        keys, sizes = self._keys_and_sizes()
        device = self.state.device if self.state.is_distributed else torch.device("cpu")
        parts = []
        for key, size in zip(keys, sizes):
            value = self._sums.get(key)
            parts.append(
                torch.zeros(size, dtype=torch.float64) if value is None else value.cpu()
            )
        flat = torch.cat(parts).to(device)
        if self.state.is_distributed and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat.cpu()
        totals, offset = {}, 0
        for key, size in zip(keys, sizes):
            totals[key] = flat[offset : offset + size]
            offset += size
        return self._finish(totals)

    def _keys_and_sizes(self):
        # One loss sum and count per task (see loss_sum_and_count).
        keys, sizes = ["loss/sum", "loss/n"], [len(self.tasks)] * 2
        for name, task, kind in self.tasks:
            if kind == "next-item":
                for metric in self._ranking[name]:
                    keys.append(f"{name}/{type(metric).__name__}")
                    sizes.append(len(metric.top_ks))
                keys.append(f"{name}/n")
                sizes.append(1)
            elif kind == "binary":
                keys.append(f"{name}/confusion")
                sizes.append(4)
            else:
                keys += [f"{name}/sse", f"{name}/n"]
                sizes += [1, 1]
        return keys, sizes

    def _finish(self, totals):
        def ratio(a, b):
            return float(a / b) if float(b) > 0 else 0.0

        result = {"loss": sum(ratio(s, n) for s, n in zip(totals["loss/sum"], totals["loss/n"]))}
        for name, task, kind in self.tasks:
            if kind == "next-item":
                n = totals[f"{name}/n"][0]
                for metric in self._ranking[name]:
                    sums = totals[f"{name}/{type(metric).__name__}"]
                    base = task.metric_name(metric)
                    for k, s in zip(metric.top_ks, sums):
                        result[f"{base}_{k}"] = ratio(s, n)
            elif kind == "binary":
                tp, fp, fn, tn = totals[f"{name}/confusion"]
                result[task.child_name("binary_precision")] = ratio(tp, tp + fp)
                result[task.child_name("binary_recall")] = ratio(tp, tp + fn)
                result[task.child_name("binary_accuracy")] = ratio(tp + tn, tp + fp + fn + tn)
            else:
                result[task.child_name("mean_squared_error")] = ratio(
                    totals[f"{name}/sse"][0], totals[f"{name}/n"][0]
                )
        return result
