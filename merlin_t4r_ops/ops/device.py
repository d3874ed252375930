"""Pick the torch device of a model loaded inside a Triton model instance, and make it current.

Triton hands each Python-backend instance its placement in ``initialize(args)``:
``model_instance_kind`` (``"GPU"``, ``"CPU"`` or ``"MODEL"``), ``model_instance_device_id``
and ``model_instance_name`` (``"<group>_<index>"``). :func:`choose_device` maps these, the
operator's ``device`` argument and the number of GPUs torch sees to one device:

================  ===============  =========================  =========  ===========
``device=``       KIND_GPU, GPU N  KIND_MODEL, instance i     KIND_CPU   no Triton
================  ===============  =========================  =========  ===========
None              cuda:N           cuda:(i mod GPUs), or cpu  cpu        cpu
``"cuda"``        cuda:N           cuda:(i mod GPUs)          as MODEL   cuda
``"cuda:K"``      cuda:K           cuda:K                     cuda:K     cuda:K
``"cpu"``         cpu              cpu                        cpu        cpu
================  ===============  =========================  =========  ===========

So ``device="cuda"`` at export means "a GPU: this instance's own", never GPU 0 for all, and
KIND_MODEL (Triton leaves placement to the model) spreads its instances over the GPUs.
"""

import re
import sys
from typing import Optional, Tuple, Union

import torch

from merlin_t4r_ops.errors import T4ROpsError
from merlin_t4r_ops.ops.cuda_graphs import log_load

__all__ = [
    "choose_device",
    "instance_placement",
    "triton_instance_args",
    "resolve_device",
    "make_current",
]

Placement = Tuple[Optional[str], int, int]  # (instance kind, device id, instance index)


def triton_instance_args() -> Optional[dict]:
    """The ``args`` that Triton passed to the ``initialize`` now on the stack, if any.

    Merlin's executor model calls the operators' ``load_artifacts`` from
    ``TritonPythonModel.initialize(args)`` but does not pass ``args`` on, so we read them from
    that frame rather than guess.
    """
    frame = sys._getframe(1)
    while frame is not None:
        args = frame.f_locals.get("args")
        if (
            frame.f_code.co_name == "initialize"
            and isinstance(args, dict)
            and "model_instance_kind" in args
        ):
            return args
        frame = frame.f_back
    return None


def instance_placement(args: Optional[dict]) -> Placement:
    """``(kind, device_id, instance_index)`` from Triton's ``initialize`` args (all strings).

    ``(None, 0, 0)`` outside Triton. The index is the number that ends the instance's name.
    """
    if args is None:
        return None, 0, 0
    index = re.search(r"(\d+)$", args.get("model_instance_name", ""))
    return (
        str(args["model_instance_kind"]).upper(),
        int(args.get("model_instance_device_id") or 0),
        int(index.group(1)) if index else 0,
    )


def _checked_gpu(index: int, cuda_count: int, why: str) -> torch.device:
    if cuda_count == 0:
        raise T4ROpsError(f"{why} asks for GPU {index}, but torch sees no CUDA device")
    if index >= cuda_count:
        raise T4ROpsError(
            f"{why} asks for GPU {index}, but torch sees only {cuda_count} CUDA device(s) "
            "(check CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", index)


def choose_device(
    requested: Union[str, torch.device, None],
    instance_kind: Optional[str],
    device_id: int,
    cuda_count: int,
    instance_index: int = 0,
) -> torch.device:
    """The device a model instance runs on; see the module's table.

    Parameters
    ----------
    requested : str, torch.device or None
        The operator's ``device`` argument.
    instance_kind : {"GPU", "CPU", "MODEL"} or None
        Triton's ``model_instance_kind``; None outside Triton.
    device_id : int
        Triton's ``model_instance_device_id``.
    cuda_count : int
        ``torch.cuda.device_count()``.
    instance_index : int
        The instance's number within its group (spreads KIND_MODEL instances over GPUs).

    Raises
    ------
    T4ROpsError
        A GPU is asked for (by ``device=`` or by Triton) that torch does not see.
    """
    wanted = None if requested is None else torch.device(requested)
    if wanted is not None and wanted.type != "cuda":
        return wanted
    if wanted is not None and wanted.index is not None:
        return _checked_gpu(wanted.index, cuda_count, f"device={str(requested)!r}")
    # From here on, device= is None or "cuda" without an index.
    if instance_kind == "GPU":
        return _checked_gpu(
            device_id, cuda_count, f"Triton's KIND_GPU instance on device {device_id}"
        )
    if wanted is None and (instance_kind in (None, "CPU") or cuda_count == 0):
        return torch.device("cpu")
    if instance_kind is None:  # in process, device="cuda": torch's current GPU
        _checked_gpu(0, cuda_count, "device='cuda'")
        return wanted
    why = "device='cuda'" if wanted is not None else f"Triton's KIND_{instance_kind} instance"
    return _checked_gpu(instance_index % max(cuda_count, 1), cuda_count, why)


def resolve_device(requested: Union[str, torch.device, None]) -> torch.device:
    """:func:`choose_device` for the Triton instance now loading, if any; logged to Triton."""
    args = triton_instance_args()
    kind, device_id, index = instance_placement(args)
    device = choose_device(requested, kind, device_id, torch.cuda.device_count(), index)
    if args is not None:
        log_load(
            f"PredictT4RPyTorch in {args.get('model_instance_name')} "
            f"(KIND_{kind}, device {device_id}) runs on {device}"
        )
    return device


def make_current(device: torch.device) -> None:
    """Make a CUDA ``device`` the current one, so nothing this process does lands on GPU 0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
