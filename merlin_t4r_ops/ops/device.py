"""Pick the torch device for a model loaded inside a Triton model instance."""

import sys
from typing import Optional, Union

import torch

from merlin_t4r_ops.errors import T4ROpsError

__all__ = ["triton_instance_device", "resolve_device"]


def triton_instance_device() -> Optional[torch.device]:
    """The device of the Triton model instance that is loading this code, if any.

    Triton hands ``model_instance_kind`` and ``model_instance_device_id`` to the Python
    model's ``initialize(args)``. Merlin's executor model calls the operators'
    ``load_artifacts`` from there but does not pass ``args`` on, so we read them from that
    frame rather than guess with a hard-coded ``.cuda()``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        args = frame.f_locals.get("args")
        if (
            frame.f_code.co_name == "initialize"
            and isinstance(args, dict)
            and "model_instance_kind" in args
        ):
            if args["model_instance_kind"] == "GPU":
                return torch.device("cuda", int(args.get("model_instance_device_id") or 0))
            return torch.device("cpu")
        frame = frame.f_back
    return None


def resolve_device(requested: Union[str, torch.device, None]) -> torch.device:
    """``requested`` if given, else the Triton instance's device, else the CPU."""
    if requested is not None:
        device = torch.device(requested)
    else:
        device = triton_instance_device() or torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise T4ROpsError(f"device {device} was asked for, but torch sees no CUDA device")
    return device
