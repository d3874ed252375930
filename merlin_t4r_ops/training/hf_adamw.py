"""Hugging Face's ``AdamW`` (``optim="adamw_hf"``, T4R's default) stepped tensor list by list.

Hugging Face 4.30's ``transformers.optimization.AdamW`` steps each parameter in a Python
loop: seven kernel launches a parameter, about 300 a step for T4R's tutorial model, all on
the host while the GPU waits (issue 22: 0.07-0.16 of the model's own pace).
:class:`MultiTensorAdamW` runs the same operations in the same order on the same state, each
one launched once for all the parameters of a group that share a device, dtype and step
count (``torch._foreach_*``); float32 and float64 ones, that is: half-precision parameters
are stepped one by one as Hugging Face steps them. Parameters are independent of one
another, so the values are the same; ``tests/test_hf_adamw.py`` checks them bit for bit
against Hugging Face's class, on the CPU and on a GPU. The state (``step``, ``exp_avg``, ``exp_avg_sq``) is Hugging Face's, so
checkpoints load either way.
"""

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
from transformers.optimization import AdamW as HuggingFaceAdamW

__all__ = ["MultiTensorAdamW", "multi_tensor"]

# torch's list ops round a Python scalar (beta1 = 0.9) to a bfloat16 or float16 list's own
# dtype on the CPU, where a tensor's ``mul_`` keeps it in float32: half-precision parameters
# are stepped one by one, as Hugging Face steps them.
_EXACT_IN_LISTS = (torch.float32, torch.float64)


class MultiTensorAdamW(HuggingFaceAdamW):
    """``transformers.optimization.AdamW``, each operation launched once per tensor list."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            loss = closure()  # under no_grad, as Hugging Face's step calls it
        for group in self.param_groups:
            for (_, dtype, step), tensors in self._tensor_lists(group).items():
                if dtype in _EXACT_IN_LISTS:
                    self._update(group, step, *tensors)
                else:
                    for one_each in zip(*tensors):
                        self._update_one(group, step, *one_each)
        return loss

    def _tensor_lists(self, group) -> Dict[Tuple, Tuple[List[torch.Tensor], ...]]:
        """(device, dtype, step) -> (params, grads, exp_avgs, exp_avg_sqs), each state
        created and its step counted as Hugging Face's loop does."""
        lists: Dict[Tuple, Tuple[List[torch.Tensor], ...]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    "Adam does not support sparse gradients, please consider SparseAdam instead")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            params, grads, exp_avgs, exp_avg_sqs = lists.setdefault(
                (p.device, p.dtype, state["step"]), ([], [], [], []))
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
        return lists

    @staticmethod
    def _update(group, step: int, params, grads, exp_avgs, exp_avg_sqs) -> None:
        """Hugging Face's arithmetic, line for line, over lists of tensors."""
        beta1, beta2 = group["betas"]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=(1.0 - beta1))
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denoms, group["eps"])
        step_size = _step_size(group, step)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-step_size)
        if group["weight_decay"] > 0.0:
            torch._foreach_add_(params, params, alpha=(-group["lr"] * group["weight_decay"]))

    @staticmethod
    def _update_one(group, step: int, p, grad, exp_avg, exp_avg_sq) -> None:
        """Hugging Face's arithmetic on one parameter, for half-precision ones."""
        beta1, beta2 = group["betas"]
        exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1))
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = _step_size(group, step)
        p.addcdiv_(exp_avg, denom, value=-step_size)
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=(-group["lr"] * group["weight_decay"]))


def _step_size(group, step: int) -> float:
    """Hugging Face's learning rate for the update at ``step``, bias-corrected."""
    beta1, beta2 = group["betas"]
    step_size = group["lr"]
    if group["correct_bias"]:  # No bias correction for Bert
        bias_correction1 = 1.0 - beta1 ** step
        bias_correction2 = 1.0 - beta2 ** step
        step_size = step_size * math.sqrt(bias_correction2) / bias_correction1
    return step_size


def multi_tensor(optimizer: HuggingFaceAdamW) -> MultiTensorAdamW:
    """A :class:`MultiTensorAdamW` over ``optimizer``'s parameter groups and settings (and
    its state, if it has stepped)."""
    defaults = optimizer.defaults
    replacement = MultiTensorAdamW(
        optimizer.param_groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
        weight_decay=defaults["weight_decay"], correct_bias=defaults["correct_bias"],
        no_deprecation_warning=True,
    )
    replacement.state.update(optimizer.state)  # keyed by parameter, as load_state_dict keys it
    return replacement
