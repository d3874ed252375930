"""A model's structure for export: no weights, and nothing that a forward pass left behind.

T4R keeps per-call tensors as plain module attributes: ``SequenceEmbeddingFeatures.item_seq``
holds the last batch's item ids, the masking modules its ``masked_targets`` and
``mask_schema``, and the task metrics (torchmetrics) accumulate scores and counts. A copy of
a trained model therefore carries the last batch of users' sessions. The skeleton keeps
parameters (as meta tensors: the weights travel in the ``state_dict``), buffers and
configuration, and drops everything else that holds tensors or arrays.
"""

import copy

import numpy as np
import torch
import torchmetrics

__all__ = ["model_skeleton", "holds_any", "holds_data", "forget_forward_state"]

# What nn.Module keeps in its __dict__ for parameters, buffers and submodules.
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})
_CONTAINERS = (list, tuple, set, frozenset)


def holds_any(value, types: tuple, depth: int = 0) -> bool:
    """Whether ``value`` is, or a list/tuple/set/dict in it holds, an instance of ``types``."""
    if isinstance(value, types):
        return True
    if depth > 8:
        return False
    if isinstance(value, dict):
        return any(holds_any(item, types, depth + 1) for item in value.values())
    if isinstance(value, _CONTAINERS):
        return any(holds_any(item, types, depth + 1) for item in value)
    return False


def holds_data(value) -> bool:
    """Whether ``value`` is, or a list/tuple/set/dict in it holds, a tensor or an array."""
    return holds_any(value, (torch.Tensor, np.ndarray))


def forget_forward_state(module: torch.nn.Module) -> None:
    """Set to ``None`` the attributes of ``module`` that hold data but no parameter or buffer.

    A torchmetrics ``Metric`` is ``reset()`` first, which puts its states back to the
    defaults it was built with; those and the defaults are kept so that it still works.
    """
    kept = set()
    if isinstance(module, torchmetrics.Metric):
        module.reset()
        kept = {"_defaults", *module._defaults}
    for name, value in list(vars(module).items()):
        if name not in _REGISTRIES and name not in kept and holds_data(value):
            # Not setattr: nn.Module.__setattr__ would treat None as a buffer/module update.
            module.__dict__[name] = None


def model_skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with meta-tensor parameters and no forward-pass state.

    Seeding ``deepcopy``'s memo with the meta parameters keeps tied weights tied and never
    copies a real parameter. Buffers stay real because some are not in the ``state_dict``
    (GPT-2's causal mask is registered ``persistent=False``).
    """
    memo = {
        id(param): torch.nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
        for param in model.parameters()
    }
    skeleton = copy.deepcopy(model, memo)
    for module in skeleton.modules():
        forget_forward_state(module)
    return skeleton
