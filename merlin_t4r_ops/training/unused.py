"""Find and freeze parameters a T4R task never uses, so plain DDP can wrap it.

DDP without ``find_unused_parameters=True`` fails on the first backward when
some parameter gets no gradient. T4R's XLNet body carries several of those
(``mask_emb``, ``word_embedding`` because T4R feeds ``inputs_embeds``,
``r_s_bias`` and ``seg_embed``). A probe step on one local batch finds the
parameters without a gradient; ranks agree on the set with one all-reduce, and
parameters unused on *every* rank are frozen for the duration of training
(they would get no update anyway). If some parameter is used on one rank but
not another, freezing cannot help and the caller falls back to
``find_unused_parameters=True``.
"""

import logging
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from merlin_t4r_ops.training.data_parallel import batch_loss
from merlin_t4r_ops.training.state import DistributedState

__all__ = ["probe_unused_parameters", "freeze", "restore_requires_grad"]

logger = logging.getLogger(__name__)


def probe_unused_parameters(
    model: torch.nn.Module, batch, state: DistributedState
) -> Tuple[List[str], bool]:
    """Run one forward/backward of ``model`` (unwrapped) and list parameters without gradient.

    Parameters
    ----------
    model : torch.nn.Module
        The unwrapped model, already on ``state.device``.
    batch : tuple
        ``(x, y)`` from this rank's loader, or None when this rank has no data.
    state : DistributedState
        Under DDP all ranks must call this together.

    Returns
    -------
    unused : list of str
        Names of trainable parameters that got no gradient on any rank.
    disagree : bool
        True when some parameter got a gradient on some ranks but not others.

    Notes
    -----
    Gradients are cleared afterwards; the forward pass draws from the RNG like
    a training step would (T4R masking, dropout), identically on every run.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    was_training = model.training
    saved = [p.grad for _, p in named]
    for _, p in named:
        p.grad = None
    used = torch.zeros(len(named), dtype=torch.float64)
    has_batch = torch.tensor([0.0 if batch is None else 1.0], dtype=torch.float64)
    if batch is not None:
        x, y = batch
        model.train()
        batch_loss(model(x, targets=y, training=True)).backward()
        used = torch.tensor([0.0 if p.grad is None else 1.0 for _, p in named], dtype=torch.float64)
    for (_, p), g in zip(named, saved):
        p.grad = g
    model.train(was_training)
    if state.is_distributed and dist.is_initialized():
        flat = torch.cat([used, has_batch]).to(state.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat.cpu()
        used, n_ranks = flat[:-1], float(flat[-1])
    else:
        n_ranks = float(has_batch[0])
    unused = [n for (n, _), u in zip(named, used.tolist()) if u == 0]
    disagree = any(0 < u < n_ranks for u in used.tolist())
    return unused, disagree


def freeze(model: torch.nn.Module, names: List[str]) -> Dict[str, bool]:
    """Set ``requires_grad=False`` on parameters ``names``; return their previous flags."""
    params = dict(model.named_parameters())
    previous = {}
    for name in names:
        previous[name] = params[name].requires_grad
        params[name].requires_grad_(False)
    return previous


def restore_requires_grad(model: torch.nn.Module, previous: Dict[str, bool]) -> None:
    """Undo :func:`freeze`, so the caller's model comes back as it was given."""
    params = dict(model.named_parameters())
    for name, flag in previous.items():
        params[name].requires_grad_(flag)
