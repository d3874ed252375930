"""The model inside the wrappers that training puts around it, for training and serving alike.

Light on purpose: the operator imports it inside Triton's stub, where the training package
(T4R's Trainer, accelerate) is not needed.
"""

import torch

__all__ = ["unwrap_model"]

_PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Return the model inside ``DataParallel``/``DistributedDataParallel``/``ReplicaLoss``
    and ``torch.compile``'s ``OptimizedModule``, in any nesting.

    ``ReplicaLoss`` (training's) keeps its model as ``model`` and says so with a class
    attribute ``wraps_model``, so that this module need not import the training package.
    ``OptimizedModule`` keeps its model as the submodule ``_orig_mod`` (whose name would
    prefix every ``state_dict`` key); it is recognised by that submodule rather than by
    its class, so that importing this module does not import ``torch._dynamo``.

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    torch.nn.Module
        ``model`` itself when it is not wrapped.
    """
    while True:
        if isinstance(model, _PARALLEL):
            model = model.module
        elif getattr(type(model), "wraps_model", False):
            model = model.model
        elif isinstance(getattr(model, "_modules", {}).get("_orig_mod"), torch.nn.Module):
            model = model._modules["_orig_mod"]
        else:
            return model
