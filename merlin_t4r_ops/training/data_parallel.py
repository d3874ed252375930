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
count; :func:`batch_loss` divides their totals, which is the loss one device
computes over the whole batch, and a replica without targets adds nothing.
``fit``, ``evaluate`` and the ``Trainer`` all wrap with :func:`data_parallel`
and read the loss with :func:`batch_loss`.
"""

from typing import Tuple

import torch

__all__ = ["ReplicaLoss", "data_parallel", "forward_batch", "batch_loss", "loss_sum_and_count"]


def target_count(labels) -> int:
    """How many targets a T4R output's ``labels`` hold (its loss is a mean over them).

    A tensor has one target per row along dim 0 (next-item: one per masked
    position). With several tasks, ``labels`` is a dict and the largest count
    is used: exact when the tasks share their rows, an approximation otherwise
    (the model returns only the weighted sum of its task losses).
    """
    if isinstance(labels, dict):
        return max((target_count(v) for v in labels.values()), default=0)
    return int(labels.shape[0]) if labels.dim() > 0 else 1


def loss_sum_and_count(output: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_targets)`` of a batch: totals of a DataParallel output, or of one pass.

    Parameters
    ----------
    output : dict
        ``model(x, targets=y, training=True)`` or ``testing=True`` output, with
        ``loss`` and ``labels``; or a gathered :class:`ReplicaLoss` output,
        which carries ``loss_sum`` and ``n_targets`` per replica.

    Returns
    -------
    tuple of torch.Tensor
        Two 0-dim tensors. ``loss_sum`` is 0 (not NaN) when ``n_targets`` is 0
        and keeps the autograd graph of ``loss``.
    """
    if "loss_sum" in output:
        return output["loss_sum"].sum(), output["n_targets"].sum()
    loss = output["loss"].reshape(())
    n = torch.tensor(float(target_count(output["labels"])), dtype=loss.dtype, device=loss.device)
    # torch.where, not a product: NaN * 0 is NaN. No gradient reaches the empty loss.
    return torch.where(n > 0, loss * n, torch.zeros_like(loss)), n


def batch_loss(output: dict) -> torch.Tensor:
    """The mean loss over all targets of a batch, as one device computes it.

    A :class:`ReplicaLoss` output (DataParallel) gives ``sum(loss_sum) /
    sum(n_targets)``: each replica weighted by its targets, replicas without
    targets ignored. A single pass gives its ``loss`` unchanged.
    """
    if "loss_sum" in output:
        total, n = loss_sum_and_count(output)
        return total / n
    loss = output["loss"]
    return loss.mean() if loss.dim() > 0 else loss


class ReplicaLoss(torch.nn.Module):
    """A T4R model whose output also carries ``loss_sum`` and ``n_targets``, for DataParallel.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Kept as ``self.model`` (not ``module``, which Hugging Face's and this
        package's ``unwrap_model`` would look through when deciding to wrap).

    Notes
    -----
    Both are 1-element tensors, so DataParallel gathers them into one entry
    per replica (a 0-dim ``loss`` would make it warn and unsqueeze). Inference
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
        loss_sum, n = loss_sum_and_count(output)
        return {
            **output,
            "loss": output["loss"].reshape(1),
            "loss_sum": loss_sum.reshape(1),
            "n_targets": n.reshape(1),
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
