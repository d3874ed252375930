"""Empty metric states that line up with the other ranks' before torchmetrics gathers them.

Under DDP a torchmetrics ``compute()`` all-gathers each list state (per-example rows:
T4R's ranking metrics keep ``[rows, cut-offs]`` float rows, AUROC keeps float scores
and integer targets). A rank that saw no eval batch holds an empty list, which
torchmetrics 1.x replaces with ``torch.tensor([])``: 1-D and float32. Gathered
against the other ranks' 2-D or integer tensors, gloo aborts the process ("Received
data size doesn't match expected size"), and a backend that does not check would
read garbage. :func:`align_empty_states` gives such a state the trailing shape and
dtype that another rank's rows have, with zero rows, so the gather concatenates
nothing from this rank.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchmetrics import Metric

from merlin_t4r_ops.training.state import DistributedState

__all__ = ["align_empty_states"]

# (trailing shape, dtype name) of a list state's rows, or None while it is empty.
RowLayout = Optional[Tuple[Tuple[int, ...], str]]


def _list_states(model: torch.nn.Module) -> List[Tuple[Metric, str]]:
    """Every ``(metric, state name)`` whose state is a list, in module order (equal on all ranks)."""
    return [
        (metric, name)
        for metric in model.modules() if isinstance(metric, Metric)
        for name, value in metric.metric_state.items() if isinstance(value, list)
    ]


def _row_layout(rows: list) -> RowLayout:
    if not rows:
        return None
    first = rows[0]
    # torchmetrics' dim_zero_cat turns a 0-dim entry into one row.
    return tuple(first.shape[1:]) if first.ndim else (), str(first.dtype).replace("torch.", "")


def align_empty_states(model: torch.nn.Module, state: DistributedState) -> None:
    """Under DDP, give every empty list state of ``model``'s metrics another rank's row layout.

    A collective: every rank must call it, with the same model, before
    ``compute_metrics``; outside DDP it does nothing. A state empty on every rank is
    left to torchmetrics (all ranks then gather the same empty tensor).
    """
    if not (state.is_distributed and dist.is_initialized()):
        return
    states = _list_states(model)
    local = [_row_layout(getattr(metric, name)) for metric, name in states]
    every_rank: List[List[RowLayout]] = [None] * state.world_size
    dist.all_gather_object(every_rank, local)
    for index, (metric, name) in enumerate(states):
        if local[index] is not None:
            continue
        layout = next((ranks[index] for ranks in every_rank if ranks[index] is not None), None)
        if layout is not None:
            shape, dtype = layout
            empty = torch.empty((0, *shape), dtype=getattr(torch, dtype), device=metric.device)
            setattr(metric, name, [empty])
