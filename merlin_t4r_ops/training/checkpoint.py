"""End-of-epoch training checkpoints that load with ``torch.load(weights_only=True)``.

A checkpoint holds the unwrapped model's ``state_dict``, optimizer, LR
scheduler and GradScaler states, the number of completed epochs, the history
so far, and every rank's RNG states. RNG states are stored as tensors and plain
Python types (not numpy arrays or pickled objects) so the safe unpickler accepts
them; restoring them is what makes a resumed run end with the same weights as
an uninterrupted one.

Only the main process writes, to a temporary file that ``os.replace`` moves
over ``last.pt``, so a run killed mid-write leaves the previous checkpoint.
On resume under DDP rank 0 reads it and broadcasts it, so nodes with their own
local disks resume from the same state.
"""

import io
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from merlin_t4r_ops.errors import CheckpointError
from merlin_t4r_ops.training.state import DistributedState, unwrap_model

__all__ = [
    "CHECKPOINT_NAME",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

CHECKPOINT_NAME = "last.pt"
_FORMAT = 1


def rng_state() -> dict:
    """This process's torch, CUDA, numpy and Python RNG states as weights-only-safe types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        # Mersenne words are < 2**32, so int64 holds them exactly.
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore states produced by :func:`rng_state`."""
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"][: torch.cuda.device_count()]
        for index, s in enumerate(cuda_states):
            torch.cuda.set_rng_state(s.cpu().to(torch.uint8), index)


def _all_rng_states(state: DistributedState) -> list:
    mine = rng_state()
    if not state.is_distributed:
        return [mine]
    gathered = [None] * state.world_size
    # Collective: every rank must reach it, even though only rank 0 writes.
    dist.all_gather_object(gathered, mine)
    return gathered


def save_checkpoint(
    checkpoint_dir,
    state: DistributedState,
    *,
    model,
    optimizer,
    epoch: int,
    history: list,
    lr_scheduler=None,
    scaler=None,
) -> Optional[str]:
    """Write ``last.pt`` after ``epoch`` completed epochs; call on every rank.

    Parameters
    ----------
    checkpoint_dir : str or os.PathLike
    state : DistributedState
        Rank 0 writes; all ranks take part in gathering RNG states and wait at
        a barrier so nobody reads a half-written directory.
    model : torch.nn.Module
        Saved unwrapped, so the file loads into a plain T4R model.
    optimizer, lr_scheduler, scaler
        Saved through their ``state_dict()``.
    epoch : int
        Number of completed epochs.
    history : list of dict

    Returns
    -------
    str or None
        The checkpoint path on the main process, None elsewhere.
    """
    rngs = _all_rng_states(state)
    path = None
    if state.is_main_process:
        os.makedirs(checkpoint_dir, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "epoch": int(epoch),
            "world_size": state.world_size,
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "history": [dict(h) for h in history],
            "rng": rngs,
        }
        path = os.path.join(os.fspath(checkpoint_dir), CHECKPOINT_NAME)
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save(payload, tmp)
        os.replace(tmp, path)
    state.barrier()
    return path


def load_checkpoint(
    checkpoint_dir, map_location="cpu", state: Optional[DistributedState] = None
) -> Optional[dict]:
    """Load ``last.pt`` from ``checkpoint_dir`` with ``weights_only=True``.

    Parameters
    ----------
    checkpoint_dir : str or os.PathLike
    map_location : optional
        Passed to ``torch.load``.
    state : DistributedState, optional
        Under DDP, call on every rank: rank 0 reads its own ``checkpoint_dir``
        and broadcasts the file's bytes, so every rank resumes from rank 0's
        checkpoint even when each node has its own disk (where only rank 0's
        holds the file ``save_checkpoint`` wrote). Otherwise each process reads
        its own directory.

    Returns
    -------
    dict or None
        None when rank 0's directory holds no checkpoint yet (on every rank).

    Raises
    ------
    CheckpointError
        The file cannot be read, or not as a checkpoint of this format; under
        DDP every rank raises, so none waits for the others.
    """
    path = os.path.join(os.fspath(checkpoint_dir), CHECKPOINT_NAME)
    if state is not None and state.is_distributed:
        data = _broadcast_from_rank0(path, state)
    else:
        data = _read(path)
    if data is None:
        return None
    try:
        payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same failure to callers
        raise CheckpointError(f"checkpoint {path!r} cannot be loaded: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(
            f"checkpoint {path!r} expected format {_FORMAT}, "
            f"found {payload.get('format') if isinstance(payload, dict) else type(payload).__name__}"
        )
    return payload


def _read(path) -> Optional[bytes]:
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path!r} cannot be read: {exc}") from exc


_NO_FILE, _UNREADABLE = -1, -2


def _broadcast_from_rank0(path, state: DistributedState) -> Optional[bytes]:
    """Rank 0's checkpoint bytes on every rank, or None on every rank if it has none.

    Bytes in a uint8 tensor, not a pickled object (``broadcast_object_list``), so
    every rank still loads them through the weights-only unpickler. Rank 0 sends
    a status instead when it has nothing to send, so the other ranks never wait.
    """
    data, error = None, None
    if state.is_main_process:
        try:
            data = _read(path)
        except CheckpointError as exc:
            error = exc
    status = _UNREADABLE if error else (_NO_FILE if data is None else len(data))
    size = torch.tensor([status], dtype=torch.int64, device=state.device)
    dist.broadcast(size, src=0)
    size = int(size.item())
    if size == _UNREADABLE:
        raise error or CheckpointError(f"rank 0 cannot read its checkpoint {path!r}; see its log")
    if size == _NO_FILE:
        return None
    if size == 0:
        return b""  # an empty file: every rank fails to load it alike
    if state.is_main_process:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(state.device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=state.device)
    dist.broadcast(buffer, src=0)
    return data if state.is_main_process else buffer.cpu().numpy().tobytes()
