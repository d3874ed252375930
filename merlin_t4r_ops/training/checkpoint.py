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
import logging
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

logger = logging.getLogger(__name__)

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
    step: int = 0,
    epoch_totals: Optional[torch.Tensor] = None,
    log_step: Optional[int] = None,
) -> Optional[str]:
    """Write ``last.pt`` after ``epoch`` completed epochs and ``step`` batches; call on every rank.

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
    step : int
        Batches (optimizer steps) already taken in epoch ``epoch + 1``: 0 at an epoch's end.
    epoch_totals : torch.Tensor, optional
        That epoch's running totals over all ranks (``fit``'s loss sum, batches, rows).
    log_step : int, optional
        The last optimizer step in the run's log (``fit``'s ``RunLog``): a resumed run
        drops the log's later rows. None where nothing was logged.

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
            "step": int(step),
            "epoch_totals": epoch_totals,
            "log_step": log_step,
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
        Under DDP, call on every rank: the ranks compare the epochs of their own
        ``checkpoint_dir`` and the rank holding the newest checkpoint broadcasts its
        bytes, so every rank resumes from the same state even when each node has its
        own disk and rank 0 came back on another node than the one that wrote
        ``last.pt`` (torchrun's c10d rendezvous does not keep ranks on their nodes).
        Otherwise each process reads its own directory.

    Returns
    -------
    dict or None
        None when no rank's directory holds a checkpoint yet (on every rank).

    Raises
    ------
    CheckpointError
        A file cannot be read, or not as a checkpoint of this format; under DDP every
        rank raises, naming the ranks whose files failed, so none waits for the others.
    """
    path = os.path.join(os.fspath(checkpoint_dir), CHECKPOINT_NAME)
    if state is not None and state.is_distributed:
        return _newest_across_ranks(path, state, map_location)
    data = _read(path)
    return None if data is None else _parse(data, path, map_location)


def _read(path) -> Optional[bytearray]:
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as stream:
            return bytearray(stream.read())
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path!r} cannot be read: {exc}") from exc


def _parse(data, path, map_location) -> dict:
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


_NO_FILE, _UNREADABLE = -1, -2
_CHUNK_BYTES = 64 << 20  # broadcast piece: the whole file never sits on the GPU at once


def _newest_across_ranks(path, state: DistributedState, map_location) -> Optional[dict]:
    """The newest checkpoint of any rank's own directory, on every rank, or None on all.

    Bytes travel in uint8 tensors, not pickled objects (``broadcast_object_list``), so
    every rank still loads them through the weights-only unpickler. Every rank reaches
    the same collectives whatever it found, so a missing or broken file never hangs.
    """
    payload, error = None, None
    try:
        data = _read(path)
        payload = None if data is None else _parse(data, path, map_location)
    except CheckpointError as exc:
        data, error = None, exc
    status = _UNREADABLE if error else (_NO_FILE if payload is None else _progress(payload))
    statuses = _all_gather_ints(status, state)
    broken = [rank for rank, s in enumerate(statuses) if s == _UNREADABLE]
    if broken:
        raise CheckpointError(
            f"rank(s) {broken} cannot load their checkpoint {path!r}"
            + (f": {error}" if error else "; see their logs")
        )
    newest = max(statuses)
    if newest == _NO_FILE:
        return None
    source = statuses.index(newest)
    if state.is_main_process and any(s != newest for s in statuses):
        logger.warning("checkpoints per rank are at (epoch, step) %s; every rank resumes from "
                       "rank %d's", [divmod(s, _STEPS) for s in statuses], source)
    received = _broadcast_bytes(data, source, state)
    return payload if state.rank == source else _parse(received, path, map_location)


_STEPS = 1 << 32  # steps per epoch are fewer: epoch * _STEPS + step orders checkpoints


def _progress(payload) -> int:
    """How far a checkpoint's run got, as one int that orders checkpoints."""
    return int(payload["epoch"]) * _STEPS + int(payload.get("step", 0))


def _all_gather_ints(value: int, state: DistributedState) -> list:
    mine = torch.tensor([value], dtype=torch.int64, device=state.device)
    everyone = [torch.empty_like(mine) for _ in range(state.world_size)]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]


def _broadcast_bytes(data: Optional[bytearray], source: int, state: DistributedState):
    """``source``'s bytes on every rank, sent in pieces through one device buffer."""
    size = torch.tensor([len(data) if state.rank == source else 0], dtype=torch.int64,
                        device=state.device)
    dist.broadcast(size, src=source)
    size = int(size.item())
    out = data if state.rank == source else bytearray(size)
    host = torch.frombuffer(out, dtype=torch.uint8)
    buffer = torch.empty(min(size, _CHUNK_BYTES), dtype=torch.uint8, device=state.device)
    for start in range(0, size, _CHUNK_BYTES):
        piece, end = buffer[: min(_CHUNK_BYTES, size - start)], min(start + _CHUNK_BYTES, size)
        if state.rank == source:
            piece.copy_(host[start:end])
        dist.broadcast(piece, src=source)
        if state.rank != source:
            host[start:end].copy_(piece)
    return out
