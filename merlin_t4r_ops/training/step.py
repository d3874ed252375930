"""How ``fit`` runs its training step: mixed precision, its default optimizer, ``torch.compile``.

Each option that can change the numbers is off by default:

* ``amp``: ``False``; ``True`` or ``"fp16"`` autocasts to float16 with a ``GradScaler``
  (CUDA only); ``"bf16"`` autocasts to bfloat16 with no scaler (bfloat16 has float32's
  exponent range, so gradients do not underflow), on CUDA GPUs that support it or on the CPU.
* ``compile``: ``torch.compile`` of the (DDP-wrapped) model. On one CUDA device with
  ``drop_last=True`` every batch has as many rows, so the compiled graphs run as CUDA
  graphs (``"reduce-overhead"``: one launch for the kernels that the step's Python would
  launch one by one), except those whose shapes still change from batch to batch
  (:func:`cuda_graph_options`); otherwise the default mode. DataParallel replicates the
  module at every step, which ``torch.compile`` cannot follow: it is refused.

The default optimizer is ``Adam(lr=lr)``, as before (Hugging Face's and T4R's default is
AdamW with weight decay 0, betas (0.9, 0.999) and eps 1e-8: the same update). On CUDA it
is the fused implementation, one kernel for all parameters instead of several per
parameter group; its results equal the loop's to float rounding.
"""

import contextlib
import logging
from typing import Optional, Union

import torch

from merlin_t4r_ops.errors import StrategyError

__all__ = ["AMP_CHOICES", "amp_dtype", "autocast", "check_amp", "default_optimizer",
           "compile_model", "cuda_graph_options", "takes_cuda_graphs"]

logger = logging.getLogger(__name__)

AMP_CHOICES = (False, True, "fp16", "bf16")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def amp_dtype(amp: Union[bool, str]) -> Optional[torch.dtype]:
    """The autocast dtype that ``amp`` asks for, None for full precision.

    Raises
    ------
    ValueError
        ``amp`` is not one of ``False``, ``True``, ``"fp16"``, ``"bf16"``.
    """
    if amp is False or amp is None:
        return None
    if amp is True:
        return torch.float16
    if isinstance(amp, str) and amp in _DTYPES:
        return _DTYPES[amp]
    raise ValueError(f"amp must be one of False, True, 'fp16' or 'bf16', got {amp!r}")


def check_amp(amp, state) -> None:
    """Refuse an ``amp`` that this process's device cannot run.

    Raises
    ------
    ValueError
        Unknown ``amp``.
    StrategyError
        float16 off CUDA; bfloat16 on a GPU without it.
    """
    dtype = amp_dtype(amp)
    device = state.device
    if dtype == torch.float16 and device.type != "cuda":
        raise StrategyError(
            f"amp={amp!r} expects a CUDA device (autocast float16 + GradScaler); this process "
            f"trains on {device} (strategy {state.strategy!r}). Pass amp=False or amp='bf16' "
            "on CPU"
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise StrategyError(
            f"amp='bf16' expects a GPU with bfloat16 (Ampere or newer); {device} "
            f"({torch.cuda.get_device_name(device)}) has none. Pass amp='fp16'"
        )


def autocast(amp, device: torch.device):
    """``torch.autocast`` to ``amp``'s dtype on ``device``, or nothing."""
    dtype = amp_dtype(amp)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(amp) -> Optional[torch.amp.GradScaler]:
    """A ``GradScaler`` for float16; bfloat16 and float32 need none."""
    return torch.amp.GradScaler("cuda") if amp_dtype(amp) == torch.float16 else None


def default_optimizer(model: torch.nn.Module, lr: float, device: torch.device):
    """``Adam(lr=lr)``; fused on CUDA."""
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.Adam(model.parameters(), lr=lr, **fused)


def check_compile(compile: bool, state) -> None:
    """Refuse ``compile`` where it cannot work.

    Raises
    ------
    ValueError
        ``compile`` is not a bool.
    StrategyError
        ``compile=True`` under DataParallel.
    """
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be a bool, got {compile!r}")
    if compile and state.strategy == "dp":
        raise StrategyError(
            "compile=True cannot compile a DataParallel model (it replicates the module at "
            f"every step); this process trains with strategy 'dp' on {state.n_devices} GPUs. "
            "Launch one process per GPU with torchrun (strategy 'ddp'), or pass compile=False"
        )


def cuda_graph_options() -> dict:
    """``torch.compile`` options: ``"reduce-overhead"``'s CUDA graphs, except for the graphs
    whose shapes change from batch to batch, which run as plain compiled kernels.

    T4R's next-item head keeps each batch's non-padded positions, a count that differs in
    every batch: recorded anew for each count, CUDA graphs made ``fit(compile=True)`` run at
    0.22-0.30 of the cached loop's pace (the model alone, eager) on an H100; skipped, at
    1.14-1.36 (docs/benchmarks.md). The skip needs torch 2.3 or newer; older torch gets
    ``"reduce-overhead"`` alone. A new dict each call: ``torch.compile`` pops from it.
    """
    from torch._inductor import config

    options = {"triton.cudagraphs": True}
    if hasattr(config.triton, "cudagraph_skip_dynamic_graphs"):
        options["triton.cudagraph_skip_dynamic_graphs"] = True
    return options


def takes_cuda_graphs(state, drop_last: bool) -> bool:
    """Whether compiled graphs can replay as CUDA graphs: on one GPU, with ``drop_last``,
    where every batch has as many rows."""
    return state.device.type == "cuda" and state.strategy == "single" and drop_last


def compile_model(wrapped: torch.nn.Module, state, drop_last: bool) -> torch.nn.Module:
    """``torch.compile(wrapped)``; with CUDA graphs (:func:`cuda_graph_options`) where
    :func:`takes_cuda_graphs`."""
    static = takes_cuda_graphs(state, drop_last)
    if state.is_main_process:
        logger.info("torch.compile of the training model, %s",
                    "CUDA graphs where shapes are static" if static else "mode default")
    return torch.compile(wrapped, options=cuda_graph_options() if static else None)
