"""The exact loss of a batch that ``torch.nn.DataParallel`` splits over GPUs.

DataParallel cuts every tensor of a batch with ``Tensor.chunk`` along dim 0, runs
one replica per chunk and concatenates the replicas' outputs. A T4R model's
``loss`` is the mean over the targets of *its* chunk, so

* the mean of the gathered losses weighs a replica with 3 targets like one with
  30: inexact whenever a batch does not split evenly, and always under masked
  language modelling, where each chunk masks its own number of positions;
* a replica whose chunk holds no target (MLM or CLM over sessions of one item)
  returns NaN, and the whole step becomes NaN.

:class:`ReplicaLoss` makes every replica also return its loss *sum* and target
count for each task; :func:`batch_loss` divides their totals task by task and
adds them with the model's task and head weights, which is the loss one device
computes over the whole batch, and a replica without targets adds nothing.
``fit``, ``evaluate`` and the ``Trainer`` all wrap with :func:`data_parallel`
and read the loss with :func:`batch_loss`.

DDP has the same flaw across processes: it averages the ranks' gradients, each of
a mean over that rank's own targets (under CLM and MLM every rank holds another
number). :func:`rank_loss` scales each rank's loss sum by the *global* target
count (one all-reduce of the counts), so DDP's average is the gradient of the
mean over all targets of the global batch, as one process would compute it.
"""

from typing import Iterator, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "ReplicaLoss", "data_parallel", "forward_batch", "batch_loss", "loss_sum_and_count", "rank_loss",
]


def target_count(labels) -> int:
    """How many targets a task's ``labels`` hold (its loss is a mean over them).

    One target per row along dim 0 (next-item: one per masked position).
    """
    return int(labels.shape[0]) if labels.dim() > 0 else 1


def loss_sum_and_count(output: dict, model=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_targets)`` of a batch, per task: of a DataParallel output, or of one pass.

    Parameters
    ----------
    output : dict
        ``model(x, targets=y, training=True)`` or ``testing=True`` output, with
        ``loss`` and ``labels``; or a gathered :class:`ReplicaLoss` output,
        which carries ``loss_sum`` and ``n_targets`` per replica and task.
    model : transformers4rec.torch.Model, optional
        Required when the model has several tasks (``labels`` is a dict): each
        task's loss is a mean over its *own* targets (next-item: masked
        positions; others: rows), so it is recomputed from the task's
        ``predictions`` and ``labels`` and weighted as the model's loss weighs it.

    Returns
    -------
    tuple of torch.Tensor
        Two 1-D tensors with one entry per task; ``batch loss = sum(loss_sum /
        n_targets)``. A ``loss_sum`` is 0 (not NaN) where its ``n_targets`` is
        0 and keeps the autograd graph of the loss.
    """
    if "loss_sum" in output:
        return output["loss_sum"].sum(0), output["n_targets"].sum(0)
    if not isinstance(output["labels"], dict):
        return _weighted_sum(output["loss"].reshape(()), output["labels"], 1.0)
    if model is None:
        raise ValueError("loss_sum_and_count needs the model when it has several tasks")
    sums, counts = zip(*(
        _weighted_sum(
            task.loss(output["predictions"][name], output["labels"][name]),
            output["labels"][name],
            weight,
        )
        for name, task, weight in _weighted_tasks(model)
    ))
    return torch.cat(sums), torch.cat(counts)


def _weighted_sum(loss: torch.Tensor, labels, weight: float):
    n = torch.tensor(float(target_count(labels)), dtype=loss.dtype, device=loss.device)
    # torch.where, not a product: NaN * 0 is NaN. No gradient reaches the empty loss.
    total = torch.where(n > 0, loss * n * weight, torch.zeros_like(loss))
    return total.reshape(1), n.reshape(1)


def _weighted_tasks(model) -> Iterator[Tuple[str, torch.nn.Module, float]]:
    """``(name, task, weight)``: the model's loss is the sum of weight x the task's mean loss.

    It follows ``transformers4rec.torch.Model.forward`` and ``Head.forward``:
    task weights, then the head's ``loss_reduction``, head weights, then the
    model's ``head_reduction``.
    """
    heads = list(model.heads)
    for head, head_weight in zip(heads, model.head_weights):
        tasks = head.prediction_task_dict
        scale = _reduction_scale(model.head_reduction, len(heads)) * _reduction_scale(
            head.loss_reduction, len(tasks)
        )
        for name, task in tasks.items():
            yield name, task, head_weight * head._task_weights[name] * scale


def _reduction_scale(reduction: str, n: int) -> float:
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss reduction {reduction!r} is not supported with several tasks: the loss of a "
            "batch split over replicas is exact for 'mean' and 'sum' only"
        )
    return 1.0 / n if reduction == "mean" else 1.0


def batch_loss(output: dict) -> torch.Tensor:
    """The loss of a batch as one device computes it.

    A :class:`ReplicaLoss` output (DataParallel) gives ``sum(loss_sum /
    n_targets)`` over tasks, each summed over replicas: each replica weighted
    by its targets of each task, replicas without targets ignored. A single
    pass gives its ``loss`` unchanged.
    """
    if "loss_sum" in output:
        total, n = loss_sum_and_count(output)
        return (total / n).sum()
    loss = output["loss"]
    return loss.mean() if loss.dim() > 0 else loss


def rank_loss(output: dict, model, state) -> torch.Tensor:
    """The loss this process backpropagates: its share of the global batch's loss under DDP.

    Parameters
    ----------
    output : dict
        The training output of this process's forward pass.
    model : transformers4rec.torch.Model
        Unwrapped (for the task weights of a multi-task model).
    state : DistributedState or None
        Under DDP every rank calls this at every step (one all-reduce of the
        per-task target counts); otherwise, or None (ranks not in lockstep), it is
        :func:`batch_loss`.

    Returns
    -------
    torch.Tensor
        ``sum over tasks of world_size * loss_sum / global n_targets``: DDP's gradient
        average of it is the gradient of the global batch's loss. The mean of it
        over the ranks is that loss; a task without targets on any rank adds 0.
    """
    if state is None or not state.is_distributed:
        return batch_loss(output)
    sums, counts = loss_sum_and_count(output, model)
    total = counts.detach().clone()
    dist.all_reduce(total)
    return (sums * state.world_size / total.clamp_min(1)).sum()


class ReplicaLoss(torch.nn.Module):
    """A T4R model whose output also carries ``loss_sum`` and ``n_targets``, for DataParallel.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Kept as ``self.model``, not ``module``: Hugging Face's ``unwrap_model``
        follows every ``.module`` and would take a ReplicaLoss for a wrapper
        when deciding whether to wrap. This package's
        :func:`~merlin_t4r_ops.training.state.unwrap_model` looks through it
        explicitly.

    Notes
    -----
    Both are ``[1, tasks]`` tensors, so DataParallel gathers them into one
    row per replica (a 0-dim ``loss`` would make it warn and unsqueeze). Inference
    outputs (no ``loss``) pass through unchanged.
    """

    wraps_model = True  # merlin_t4r_ops.wrappers.unwrap_model looks through it

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs, targets=None, training=False, testing=False):
        output = self.model(inputs, targets=targets, training=training, testing=testing)
        if not isinstance(output, dict) or "loss" not in output:
            return output
        loss_sum, n = loss_sum_and_count(output, self.model)
        return {
            **output,
            "loss": output["loss"].reshape(1),
            "loss_sum": loss_sum.reshape(1, -1),
            "n_targets": n.reshape(1, -1),
        }


def data_parallel(model: torch.nn.Module) -> torch.nn.DataParallel:
    """``DataParallel`` over all visible GPUs whose replicas return exact loss statistics."""
    return torch.nn.DataParallel(ReplicaLoss(model))


def forward_batch(model, inputs, targets, *, training: bool = False, testing: bool = False):
    """``model(inputs, targets=targets, training=training, testing=testing)``, DataParallel-safe.

    The arguments are passed positionally: DataParallel copies non-tensor
    keyword arguments (``training=True``, ``targets=None``) to *every* GPU but
    cuts tensors into at most as many chunks as there are rows, and then calls
    the extra replicas with keyword arguments and no inputs (a 5-row batch on 4
    GPUs is cut 2+2+1: a ``TypeError`` on the fourth). Positional arguments are
    zipped with the chunks instead, so only as many replicas as chunks run.
    """
    return model(inputs, targets, training, testing)
