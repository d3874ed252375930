"""What ``Trainer.predict()`` returns, as ``transformers4rec.torch.Trainer`` 23.12 returns it.

T4R's contract for next-item predictions (its ``test_trainer.py``):

* with ``args.predict_top_k`` or ``model.top_k`` set, a tuple ``(item_ids,
  scores)``, each ``[rows, k]`` with ``k = predict_top_k or model.top_k``;
  otherwise the full ``[rows, catalogue]`` score matrix;
* a model with ``top_k`` already returns its top ``model.top_k`` as
  ``(scores, ids)``: they are swapped to ``(ids, scores)`` and cut to
  ``predict_top_k``, and a ``predict_top_k`` above ``model.top_k`` is a
  ``ValueError``;
* with several tasks, a dict by task name; the next-item entry gets the above,
  the others are ``[rows]`` arrays.

:func:`gather_to_main` collects the batches of all DDP ranks on rank 0 only.
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from accelerate.utils import concatenate
from transformers.trainer_pt_utils import nested_numpify

from merlin_t4r_ops.training.state import DistributedState

__all__ = ["check_top_k", "select_top_k", "gather_to_main"]

TOP_K_TOO_LARGE = "The args.predict_top_k should not be larger than model.top_k"


def check_top_k(predict_top_k: Optional[int], model_top_k: Optional[int]) -> None:
    """Raise T4R's ``ValueError`` when ``predict_top_k`` asks for more than the model returns.

    Raises
    ------
    ValueError
        ``predict_top_k > model_top_k``; the message starts with T4R's own.
    """
    if predict_top_k and model_top_k and predict_top_k > model_top_k:
        raise ValueError(
            f"{TOP_K_TOO_LARGE} (got args.predict_top_k={predict_top_k}, "
            f"model.top_k={model_top_k}): a model with top_k returns only its top "
            f"{model_top_k} item ids and scores. Lower args.predict_top_k or raise model.top_k"
        )


def select_top_k(preds, next_item_names: List[str], predict_top_k, model_top_k):
    """One batch of inference output in T4R's order: ``(ids, scores)`` for next-item tasks.

    Parameters
    ----------
    preds : torch.Tensor, tuple or dict
        ``model(x)`` in eval mode: scores, ``(scores, ids)`` when the model has
        ``top_k``, or a dict by task name with several tasks.
    next_item_names : list of str
        Names of the model's next-item tasks (keys of ``preds`` when a dict).
    predict_top_k, model_top_k : int or None

    Returns
    -------
    Same structure as T4R's evaluation loop produces.
    """
    if isinstance(preds, dict):
        return {
            name: _one_task(value, predict_top_k, model_top_k) if name in next_item_names else value
            for name, value in preds.items()
        }
    if not next_item_names:
        return preds
    return _one_task(preds, predict_top_k, model_top_k)


def _one_task(preds, predict_top_k, model_top_k):
    if model_top_k and isinstance(preds, (tuple, list)):
        scores, ids = preds
        check_top_k(predict_top_k, model_top_k)
        if predict_top_k:
            scores, ids = scores[:, :predict_top_k], ids[:, :predict_top_k]
        return ids, scores
    if predict_top_k:
        scores, ids = torch.topk(preds, k=predict_top_k, dim=-1)
        return ids, scores
    return preds


def gather_to_main(pieces: list, state: DistributedState):
    """This rank's batches concatenated, then all ranks' in rank order, on rank 0 only.

    Parameters
    ----------
    pieces : list
        Per-batch CPU tensors, tuples or dicts of them (possibly empty).
    state : DistributedState

    Returns
    -------
    numpy arrays in the structure of one piece (tuple, dict) on the main
    process; ``None`` on every other DDP rank, and where no rank had a batch.
    """
    # accelerate's concatenate cats all batches at once; Hugging Face's pairwise
    # nested_concat would copy the growing result once per batch.
    local = concatenate(pieces) if pieces else None
    if state.is_distributed:
        everyone = [None] * state.world_size if state.is_main_process else None
        # Objects, not tensors: ranks may hold different numbers of rows.
        dist.gather_object(local, everyone, dst=0)
        if not state.is_main_process:
            return None
        everyone = [x for x in everyone if x is not None]
        local = concatenate(everyone) if everyone else None
    return None if local is None else nested_numpify(local)
