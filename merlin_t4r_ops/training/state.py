"""Which distributed strategy this process trains under, as one small object.

:func:`resolve_strategy` looks at the launcher's environment once and returns a
frozen :class:`DistributedState`; everything else (``fit``, the trainer, the
dataloaders, checkpointing) receives that object instead of re-reading
``os.environ`` or ``torch.distributed`` globals, so the decision is made in one
place and can be logged in one line.
"""

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from merlin_t4r_ops.errors import StrategyError
from merlin_t4r_ops.wrappers import unwrap_model
from merlin_t4r_ops.training.data_parallel import data_parallel

__all__ = ["DistributedState", "resolve_strategy", "prepare_model", "unwrap_model", "STRATEGIES"]

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "single", "dp", "ddp")



@dataclass(frozen=True)
class DistributedState:
    """How this process takes part in training.

    Attributes
    ----------
    strategy : str
        ``"single"``, ``"dp"`` (one process, ``torch.nn.DataParallel`` over all
        visible GPUs) or ``"ddp"`` (one process per device,
        ``DistributedDataParallel``).
    rank : int
        Global rank; 0 outside DDP.
    local_rank : int
        Rank within this node; picks the GPU under DDP.
    world_size : int
        Number of processes; 1 for ``single`` and ``dp``.
    device : torch.device
        This process's device.
    reason : str
        One line on why this strategy was chosen.
    n_devices : int
        Devices this process computes on: the GPUs ``DataParallel`` splits each
        batch over under ``"dp"``, else 1. A per-device batch size times this
        is the batch one process loads.
    local_world_size : int
        Processes of this run on this node (torchrun's ``LOCAL_WORLD_SIZE``); they
        share the node's cores, hence the dataloader workers.
    """

    strategy: str
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    reason: str
    n_devices: int = 1
    local_world_size: int = 1

    @property
    def is_main_process(self) -> bool:
        """True on the one process that logs and writes files (global rank 0)."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True under DDP, where collectives are needed to agree across processes."""
        return self.strategy == "ddp"

    def barrier(self) -> None:
        """Wait for every rank; a no-op unless DDP (one process needs no waiting)."""
        if self.is_distributed and dist.is_available() and dist.is_initialized():
            dist.barrier()


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise StrategyError(
            f"environment variable {name} must be an integer (as torchrun sets it), got {value!r}"
        ) from None


def _restart_safe_store(world_size: int):
    """The store for a torchrun world, with keys private to this restart attempt.

    After ``torchrun --max-restarts`` restarts the workers, the new gloo world was seen
    (torch 2.13, 2 CPU cores) connecting to addresses that the previous, dead attempt had
    published, and failing with "connectFullMesh ... Connection refused". A prefix per attempt
    keeps every attempt's rendezvous keys apart. Outside torchelastic, ``env://`` as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           world_size, is_master=False, timeout=timedelta(minutes=10))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"merlin_t4r_ops/attempt_{attempt}", client)


def resolve_strategy(strategy: str = "auto") -> DistributedState:
    """Decide how this process trains and set up the process group if needed.

    Parameters
    ----------
    strategy : {"auto", "single", "dp", "ddp"}
        ``"auto"`` picks ``"ddp"`` when launched by torchrun (``RANK`` and
        ``WORLD_SIZE`` set) or when a process group is already initialized,
        ``"dp"`` when one process sees more than one GPU, else ``"single"``
        (``cuda:0`` when there is a GPU, else CPU).

    Returns
    -------
    DistributedState

    Raises
    ------
    StrategyError
        Unknown ``strategy``; ``"dp"`` with fewer than two visible GPUs;
        ``"ddp"`` without a torchrun environment or initialized process group.

    Notes
    -----
    Under DDP the process group is initialized here (``nccl`` when CUDA is
    available, ``gloo`` otherwise) unless the caller already did it, and the
    current CUDA device is set to ``cuda:LOCAL_RANK``.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise StrategyError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}"
        )
    # Read the launcher environment once; everything below uses these values.
    env = dict(os.environ)
    env_rank = _env_int(env, "RANK")
    env_world = _env_int(env, "WORLD_SIZE")
    env_local = _env_int(env, "LOCAL_RANK")
    env_local_world = _env_int(env, "LOCAL_WORLD_SIZE")
    launched = env_rank is not None and env_world is not None
    pg_ready = dist.is_available() and dist.is_initialized()
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0

    if strategy == "auto":
        if launched:
            chosen, reason = "ddp", f"launched by torchrun (RANK={env_rank}, WORLD_SIZE={env_world})"
        elif pg_ready:
            chosen, reason = "ddp", "a torch.distributed process group is already initialized"
        elif n_gpus > 1:
            chosen, reason = "dp", f"one process sees {n_gpus} GPUs and no torchrun environment"
        else:
            where = "one GPU" if n_gpus == 1 else "no GPU"
            chosen, reason = "single", f"no torchrun environment and {where} visible"
    else:
        chosen, reason = strategy, f"strategy={strategy!r} was asked for"

    if chosen == "single":
        device = torch.device("cuda:0" if n_gpus else "cpu")
        state = DistributedState("single", 0, 0, 1, device, reason)
    elif chosen == "dp":
        if n_gpus < 2:
            raise StrategyError(
                "strategy='dp' needs one process that sees two or more CUDA GPUs, "
                f"found {n_gpus} GPU(s) (torch.cuda.is_available()={torch.cuda.is_available()}); "
                "use strategy='single' or 'auto'"
            )
        state = DistributedState(
            "dp", 0, 0, 1, torch.device("cuda:0"), reason + f"; {n_gpus} GPUs", n_devices=n_gpus
        )
    else:
        state = _resolve_ddp(env_rank, env_world, env_local, launched, pg_ready, n_gpus, reason,
                             env_local_world)

    if state.is_main_process:
        logger.info(
            "training strategy %s: world_size=%d, device=%s (%s)",
            state.strategy,
            state.world_size,
            state.device,
            state.reason,
        )
    return state


def _resolve_ddp(env_rank, env_world, env_local, launched, pg_ready, n_gpus, reason,
                 env_local_world=None):
    if not dist.is_available():
        raise StrategyError("strategy='ddp' needs torch.distributed, which this torch build lacks")
    if not launched and not pg_ready:
        raise StrategyError(
            "strategy='ddp' expects to be launched by torchrun (environment variables RANK and "
            "WORLD_SIZE set) or an initialized torch.distributed process group; found "
            f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} and no "
            "process group. Launch with `torchrun --nproc_per_node=N script.py`"
        )
    backend = "nccl" if n_gpus else "gloo"
    if not pg_ready:
        dist.init_process_group(backend=backend, rank=env_rank, world_size=env_world,
                                store=_restart_safe_store(env_world))
    rank, world = dist.get_rank(), dist.get_world_size()
    if launched and (rank != env_rank or world != env_world):
        raise StrategyError(
            f"the initialized process group (rank={rank}, world_size={world}) disagrees with "
            f"the environment (RANK={env_rank}, WORLD_SIZE={env_world})"
        )
    local = env_local if env_local is not None else (rank % n_gpus if n_gpus else 0)
    if n_gpus:
        if local >= n_gpus:
            raise StrategyError(
                f"LOCAL_RANK={local} expects at least {local + 1} visible GPUs, found {n_gpus}"
            )
        device = torch.device(f"cuda:{local}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend_used = dist.get_backend()
    # Without torchrun's count, assume every rank shares this node (the fewer workers each).
    local_world = env_local_world or world
    return DistributedState("ddp", rank, local, world, device, f"{reason}; backend {backend_used}",
                            local_world_size=local_world)


def prepare_model(
    model: torch.nn.Module,
    state: DistributedState,
    *,
    find_unused_parameters: bool = False,
) -> torch.nn.Module:
    """Move ``model`` to ``state.device`` and wrap it for ``state.strategy``.

    Parameters
    ----------
    model : torch.nn.Module
        An unwrapped model; it is moved in place, so the caller's object keeps
        the trained weights.
    state : DistributedState
    find_unused_parameters : bool
        Passed to ``DistributedDataParallel``. Prefer freezing parameters the
        task never uses (``requires_grad=False``) over turning this on: it costs
        an extra graph traversal every step.

    Returns
    -------
    torch.nn.Module
        ``model`` (single), ``DataParallel(ReplicaLoss(model))`` (dp, see
        :mod:`~merlin_t4r_ops.training.data_parallel`) or
        ``DistributedDataParallel(model)`` (ddp).

    Raises
    ------
    StrategyError
        ``model`` is already wrapped in DataParallel/DistributedDataParallel.
    """
    if unwrap_model(model) is not model:
        raise StrategyError(
            f"prepare_model expects an unwrapped model, got one already wrapped in "
            f"{type(model).__name__}; pass unwrap_model(model) instead"
        )
    if not isinstance(state, DistributedState):
        raise StrategyError(
            f"state must be a DistributedState from resolve_strategy(), got {type(state).__name__}"
        )
    model.to(state.device)
    if state.strategy == "dp":
        return data_parallel(model)
    if state.strategy == "ddp":
        ids = [state.device.index] if state.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=ids,
            output_device=ids[0] if ids else None,
            find_unused_parameters=find_unused_parameters,
        )
    return model
