"""How many copies of the executor model Triton runs, and where: the ``instance_group``.

Merlin exports one ``instance_group { kind: KIND_AUTO }``: one instance, on GPU 0 if there
is a GPU. Triton reads ``count`` of a ``KIND_GPU`` group as "this many on **each** GPU of
``gpus``", and on every GPU it sees when ``gpus`` is left out, so ``count=N, kind="gpu"``
is N instances per GPU, on each GPU. Each Python-backend instance is its own process with
its own copy of the model; the operator puts it on the GPU Triton gave it
(:mod:`merlin_t4r_ops.ops.device`).
"""

from typing import Optional, Sequence

import tritonclient.grpc.model_config_pb2 as model_config

from merlin_t4r_ops.errors import T4ROpsError

__all__ = ["instance_group", "KINDS"]

KINDS = {
    "auto": model_config.ModelInstanceGroup.Kind.KIND_AUTO,
    "cpu": model_config.ModelInstanceGroup.Kind.KIND_CPU,
    "gpu": model_config.ModelInstanceGroup.Kind.KIND_GPU,
}


def instance_group(
    count: int = 1, kind: str = "auto", gpus: Optional[Sequence[int]] = None
) -> model_config.ModelInstanceGroup:
    """One ``instance_group`` entry of a Triton model config.

    Parameters
    ----------
    count : int
        Instances per GPU for ``kind="gpu"`` (on each GPU of ``gpus``, or on each GPU
        Triton sees); instances in all for ``"cpu"``; for ``"auto"``, Triton's choice of
        GPU (per GPU) or CPU.
    kind : {"auto", "cpu", "gpu"}
        Where the instances run.
    gpus : sequence of int, optional
        The GPUs to place ``count`` instances on each of; only with ``kind="gpu"``.

    Raises
    ------
    T4ROpsError
        Naming the argument that is out of range.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise T4ROpsError(f"instances must be a positive int, got {count!r}")
    if kind not in KINDS:
        raise T4ROpsError(f"instance_kind must be one of {sorted(KINDS)}, got {kind!r}")
    if gpus is not None:
        if kind != "gpu":
            raise T4ROpsError(f"gpus={list(gpus)} needs instance_kind='gpu', got {kind!r}")
        gpus = list(gpus)
        if not gpus or any(not isinstance(g, int) or g < 0 for g in gpus):
            raise T4ROpsError(f"gpus must be a non-empty list of GPU indices, got {gpus!r}")
    return model_config.ModelInstanceGroup(kind=KINDS[kind], count=count, gpus=gpus or [])
