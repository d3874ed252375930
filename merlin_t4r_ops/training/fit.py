"""``fit``: train a Transformers4Rec model in place on one device, DataParallel or DDP.

Launching
---------
One script serves every setup; the launcher, not the script, decides (the
nanoGPT way). DDP is ``torch.distributed`` itself, started by ``torchrun``; this
package has no process manager of its own::

    # single process: cuda:0 if there is a GPU, else CPU; DataParallel
    # automatically when the process sees several GPUs ("auto")
    python train.py

    # one node, N processes (one per GPU; gloo on CPU-only machines)
    torchrun --standalone --nproc_per_node=N train.py

    # several nodes: run on every node, same endpoint and job id
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST_OF_NODE0:29500 --rdzv-id=JOB train.py

where ``train.py`` is essentially::

    from merlin_t4r_ops.training import fit
    history = fit(model, "data/train/", eval_data="data/valid/", epochs=3)
    # `model` now holds the trained weights on every rank, unwrapped

Under DDP each process trains on its own shard of the data, chosen by its
*global* rank, so multi-node sharding needs nothing extra; gradients are
averaged by DDP's all-reduce; evaluation metrics are reduced exactly over the
whole eval set and are equal on every rank; only the main process (global
rank 0) prints and writes checkpoints.

Batch size and learning rate
----------------------------
``batch_size`` is per device, as in Hugging Face's ``per_device_train_batch_size``:
under DDP each rank loads ``batch_size`` rows; under DataParallel the one
process loads ``batch_size * n_gpus`` rows and DataParallel splits them over
its GPUs. Moving a script between ``python train.py`` (DataParallel) and
``torchrun`` (DDP) on the same GPUs therefore keeps the global batch. One
optimizer step sees ``n_devices * batch_size`` examples, and an epoch has
``n_devices`` times fewer steps than on one device. To keep training comparable to a single-process run with batch
``B`` either keep the global batch (``batch_size = B // world_size``, same
``lr``) or keep the per-rank batch and scale the learning rate linearly,
``lr = base_lr * world_size`` (with a warm-up for large worlds; for Adam a
square-root scaling is often safer). ``fit`` does not rescale ``lr`` for you;
``world_size`` stands for the number of devices under DataParallel as well.
"""

import contextlib
import itertools
import logging
import math
import time
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from merlin_t4r_ops.errors import StrategyError
from merlin_t4r_ops.training.checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from merlin_t4r_ops.training.data import (
    ShardedLoader,
    batches_of,
    make_loader,
    to_device,
)
from merlin_t4r_ops.training.data_parallel import forward_batch, rank_loss
from merlin_t4r_ops.training.run_log import RunLog
from merlin_t4r_ops.training.step import (
    autocast,
    check_amp,
    check_compile,
    compile_model,
    default_optimizer,
    grad_scaler,
)
from merlin_t4r_ops.training.metrics import MetricAccumulator
from merlin_t4r_ops.training.policy import (
    DEFAULT_SEED,
    data_order_seed,
    log_folder,
    seed_everything,
    settle_unused_parameters,
)
from merlin_t4r_ops.training.state import (
    DistributedState,
    prepare_model,
    resolve_strategy,
    unwrap_model,
)
from merlin_t4r_ops.training.unused import restore_requires_grad

__all__ = ["fit", "evaluate"]

logger = logging.getLogger(__name__)


def _state(strategy) -> DistributedState:
    if isinstance(strategy, DistributedState):
        return strategy
    return resolve_strategy(strategy)


def _batch_rows(x) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0])
    if isinstance(x, dict):
        for value in x.values():
            return _batch_rows(value)
    return 0


def _autocast(amp, state: DistributedState):
    return autocast(amp, state.device)


def evaluate(
    model,
    eval_data,
    *,
    strategy: Union[str, DistributedState] = "auto",
    num_workers: Optional[int] = None,
    pin_memory: Optional[bool] = None,
    batch_size: int = 32,
    amp: Union[bool, str] = False,
) -> dict:
    """Evaluate a T4R model over ``eval_data``; under DDP, exactly over all shards.

    Parameters
    ----------
    model : transformers4rec.torch.Model or a DataParallel/DDP wrapper of one
        Under DDP the unwrapped module is run on each rank's shard (no
        collectives in the forward pass, so unequal shards cannot hang).
    eval_data : path(s), merlin.io.Dataset or iterable of (x, y)
        See :func:`fit`.
    strategy : str or DistributedState
    num_workers, pin_memory : optional
        See :func:`fit`.
    batch_size : int
        Per-device batch size (times the GPU count under DataParallel).
    amp : {False, True, "fp16", "bf16"}
        Autocast the forward pass: ``True``/``"fp16"`` to float16 (CUDA only),
        ``"bf16"`` to bfloat16.

    Returns
    -------
    dict
        Metric name to float, identical on every rank (see
        :class:`~merlin_t4r_ops.training.metrics.MetricAccumulator`).
    """
    state = _state(strategy)
    check_amp(amp, state)
    loader = make_loader(eval_data, model, state, batch_size=batch_size, shuffle=False,
                         num_workers=num_workers, pin_memory=pin_memory)
    model = unwrap_model(model)
    if state.strategy == "dp":
        # Re-wrapped even if the caller's was DataParallel: replicas must return loss sums.
        model = prepare_model(model, state)
    model.to(state.device)
    return _evaluate(model, loader, state, amp)


def _evaluate(model, loader, state: DistributedState, amp: bool) -> dict:
    # DP replicates the forward and gathers dict outputs; DDP's forward would
    # sync buffers collectively, so each rank runs its own module instead.
    runner = unwrap_model(model) if state.is_distributed else model
    inner = unwrap_model(model)
    accumulator = MetricAccumulator(inner, state)
    was_training = inner.training
    inner.eval()
    with torch.no_grad(), batches_of(loader) as batches:
        for x, y in batches:
            x, y = to_device(x, state.device), to_device(y, state.device)
            with _autocast(amp, state):
                output = forward_batch(runner, x, y, testing=True)
            accumulator.update(output)
    inner.train(was_training)
    return accumulator.compute()


def _check_args(model, epochs, batch_size, amp, compile, state, resume, checkpoint_dir,
                save_steps, gradient_accumulation_steps, optimizer, lr_scheduler,
                lr_scheduler_interval):
    """Refuse ``fit``'s arguments that cannot work together, before any data is read."""
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (per device), got {batch_size!r}")
    check_amp(amp, state)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True expects checkpoint_dir= naming where checkpoints are, got None")
    if lr_scheduler_interval not in ("epoch", "step"):
        raise ValueError(
            f"lr_scheduler_interval must be 'epoch' or 'step', got {lr_scheduler_interval!r}"
        )
    check_compile(compile, state)
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(
            "gradient_accumulation_steps must be a positive int, got "
            f"{gradient_accumulation_steps!r}"
        )
    if save_steps is not None and (not isinstance(save_steps, int) or save_steps < 1
                                   or checkpoint_dir is None):
        raise ValueError(
            "save_steps must be None or a positive int with checkpoint_dir= set, got "
            f"save_steps={save_steps!r}, checkpoint_dir={checkpoint_dir!r}"
        )
    if unwrap_model(model) is not model:
        raise StrategyError(
            f"fit expects an unwrapped model (it wraps for the strategy itself), got "
            f"{type(model).__name__}; pass unwrap_model(model)"
        )
    if lr_scheduler is not None and (
        optimizer is None or getattr(lr_scheduler, "optimizer", None) is not optimizer
    ):
        raise ValueError(
            f"lr_scheduler must schedule the optimizer that fit steps; got a "
            f"{type(lr_scheduler).__name__} bound to another optimizer than optimizer="
            + ("None (fit would make its own Adam): pass the scheduler's optimizer as optimizer="
               if optimizer is None else f"{type(optimizer).__name__}")
        )


def _resume_point(resume, checkpoint_dir, model, optimizer, lr_scheduler, scaler, state):
    """``(start_epoch, history, resume_at, log_step)``: from ``checkpoint_dir/last.pt`` when
    resuming from one, else a fresh start."""
    ckpt = load_checkpoint(checkpoint_dir, map_location="cpu", state=state) if resume else None
    if ckpt is None:
        if resume and state.is_main_process:
            logger.info("resume=True but %s holds no checkpoint; starting at epoch 1",
                        checkpoint_dir)
        return 0, [], None, 0
    start_epoch, history, resume_at = _restore(ckpt, model, optimizer, lr_scheduler, scaler,
                                               state)
    return start_epoch, history, resume_at, ckpt.get("log_step")


def fit(
    model,
    train_data,
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    epochs: int = 1,
    strategy: Union[str, DistributedState] = "auto",
    eval_data=None,
    amp: Union[bool, str] = False,
    compile: bool = False,
    batch_size: int = 32,
    eval_batch_size: Optional[int] = None,
    lr: float = 1e-3,
    lr_scheduler=None,
    lr_scheduler_interval: str = "epoch",
    max_grad_norm: Optional[float] = None,
    gradient_accumulation_steps: int = 1,
    checkpoint_dir=None,
    save_steps: Optional[int] = None,
    resume: bool = False,
    seed: Optional[int] = DEFAULT_SEED,
    data_seed: Optional[int] = None,
    shuffle: bool = True,
    drop_last: bool = False,
    find_unused_parameters: Optional[bool] = None,
    progress: bool = True,
    callbacks: Sequence[Callable[[dict], None]] = (),
    log_dir=None,
    num_workers: Optional[int] = None,
    pin_memory: Optional[bool] = None,
) -> List[dict]:
    """Train ``model`` in place; return the per-epoch history.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Unwrapped. Next-item prediction, binary classification and regression
        heads are supported. On return it holds the trained weights on every
        rank, unwrapped, on ``state.device``, with ``requires_grad`` flags as given.
    train_data : str, os.PathLike, list of them, merlin.io.Dataset, or iterable of (x, y)
        Parquet path(s) (with ``schema.pbtxt``) or a Dataset: ``fit`` builds
        per-rank Merlin loaders from the model's input schema and targets,
        with sessions cropped and padded as the operator serves them
        (:mod:`merlin_t4r_ops.sequence`), sharded by global rank and balanced
        by rows whatever the partition sizes: every rank gets
        ``ceil(rows / world_size)`` rows per epoch, at most ``world_size - 1``
        of them repeated, as ``DistributedSampler`` pads (see
        :class:`~merlin_t4r_ops.training.data.ShardedLoader`).
        Anything else is a ready dataloader used as is (re-iterable; shard it
        yourself under DDP). If such loaders give ranks unequal ``len()``, a
        rank with fewer batches repeats batches from its start so all ranks
        take the same optimizer steps (weights and optimizer states stay
        identical); loaders without ``len()`` fall back to DDP's ``join``
        context manager, which cannot hang but lets optimizer states drift.
    optimizer : torch.optim.Optimizer, optional
        Over ``model.parameters()``; default ``Adam(lr=lr)``, fused on CUDA.
    epochs : int
        Total number of epochs, counting those already done when resuming.
    strategy : {"auto", "single", "dp", "ddp"} or DistributedState
        See :func:`~merlin_t4r_ops.training.state.resolve_strategy`.
    eval_data : optional
        Same forms as ``train_data``; evaluated after each epoch on every rank
        over its shard, metrics reduced exactly over the whole set.
    amp : {False, True, "fp16", "bf16"}
        ``True`` or ``"fp16"``: ``torch.autocast`` float16 + ``GradScaler``, CUDA
        only (on CPU it raises :class:`StrategyError` rather than silently
        training in fp32). ``"bf16"``: autocast bfloat16 without a scaler (GPUs
        with bfloat16, or the CPU). See :mod:`~merlin_t4r_ops.training.step`.
    compile : bool
        ``torch.compile`` the training model (CUDA graphs on one CUDA device with
        ``drop_last=True``, but not for the graphs whose shapes change per batch: see
        :mod:`~merlin_t4r_ops.training.step`); evaluation runs eagerly. Refused under
        DataParallel.
    batch_size : int
        Per device, as in Hugging Face. Under DDP each rank loads
        ``batch_size`` rows (global batch ``world_size * batch_size``); under
        DataParallel the process loads ``batch_size * n_gpus`` rows, which
        DataParallel splits over the GPUs. See the module docstring for
        learning-rate scaling.
    eval_batch_size : int, optional
        Defaults to ``batch_size``.
    lr : float
        Learning rate of the default optimizer.
    lr_scheduler : torch.optim.lr_scheduler.LRScheduler, optional
        Stepped once per epoch, or once per optimizer step with
        ``lr_scheduler_interval="step"``.
    max_grad_norm : float, optional
        Clip the global gradient norm (after unscaling under AMP).
    gradient_accumulation_steps : int
        Batches whose gradients make one optimizer step (each loss divided by it, as
        Hugging Face does; the last step of an epoch may take fewer). Under DDP the
        batches before a step run under ``no_sync``: one gradient all-reduce per step.
        ``save_steps`` and ``lr_scheduler_interval="step"`` count optimizer steps.
    checkpoint_dir : str or os.PathLike, optional
        Write ``last.pt`` after each epoch (main process, atomically).
    save_steps : int, optional
        Also write ``last.pt`` every ``save_steps`` optimizer steps of an epoch (counted
        from the epoch's start), so that a run resumes mid-epoch. Needs ``checkpoint_dir``;
        under DDP, loaders with ``len()`` on every rank (else only epoch checkpoints).
    resume : bool
        Continue from ``checkpoint_dir/last.pt`` when it exists, at its epoch and batch:
        the data order is restored exactly (the loaders ``fit`` builds start at that
        batch without reading the ones before; a user's loader is read up to it).
        Under DDP rank
        0 reads its own ``checkpoint_dir`` and broadcasts the checkpoint, so
        every rank resumes from the same state even when the nodes have
        separate local disks.
    seed : int, optional
        Seeds torch, numpy and random with the same seed on every rank, as Hugging
        Face's Trainer does with ``args.seed`` (and its default, 42); None seeds
        nothing. See :mod:`~merlin_t4r_ops.training.policy`.
    data_seed : int, optional
        Seeds the data shuffle (from ``(data_seed, epoch)``, equal on all ranks), as
        ``args.data_seed``; by default ``seed``.
    shuffle, drop_last : bool
        For loaders that ``fit`` builds.
    find_unused_parameters : bool, optional
        None: probe one batch, freeze parameters no rank uses (T4R XLNet has
        several) and fall back to ``True`` only when ranks disagree. A bool is
        passed to DDP as is, without probing.
    progress : bool
        tqdm bar on the main process.
    callbacks : sequence of callable
        Called on every rank with each epoch's history entry, after the
        checkpoint is written.
    log_dir : str or False, optional
        Where the main process logs each optimizer step's ``train/loss`` and
        ``train/learning_rate`` and each evaluation's ``eval/<metric>``:
        ``log.csv`` (rows ``step, epoch, name, value``) and, where the
        ``tensorboard`` package is installed, TensorBoard events under
        ``runs/``. None (the default): ``checkpoint_dir``, when given, as the
        Trainer logs under its ``output_dir``; False logs nothing. A resumed run
        drops the rows past its checkpoint's step, a fresh one every row.
    num_workers : int, optional
        Worker processes per rank that read, convert and pad batches ahead of the
        step, for the loaders ``fit`` builds. Default 0: the batches are made in the
        training process, which kept the GPU busiest in the measurements of
        :func:`~merlin_t4r_ops.training.data.worker_share`.
    pin_memory : bool, optional
        Page-locked batches (CUDA only), copied to the device with
        ``non_blocking=True``. Default: on CUDA.

    Returns
    -------
    list of dict
        One dict per epoch with ``epoch``, ``train_loss`` (mean batch loss over
        all ranks), ``train_samples`` (rows processed on all ranks, repeats
        included), ``train_seconds`` (slowest rank), ``lr`` and
        ``eval_<metric>`` entries when ``eval_data`` is given.
    """
    state = _state(strategy)
    _check_args(model, epochs, batch_size, amp, compile, state, resume, checkpoint_dir,
                save_steps, gradient_accumulation_steps, optimizer, lr_scheduler,
                lr_scheduler_interval)
    seed_everything(seed)  # the one policy of fit and the Trainer: training/policy.py
    model.to(state.device)
    train_loader = make_loader(
        train_data,
        model,
        state,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=data_order_seed(seed, data_seed),
        drop_last=drop_last,
        equal_shards=True,  # every rank takes the same optimizer steps
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    eval_loader = None
    if eval_data is not None:
        eval_loader = make_loader(
            eval_data, model, state, batch_size=eval_batch_size or batch_size, shuffle=False,
            num_workers=num_workers, pin_memory=pin_memory,
        )
    if optimizer is None:
        optimizer = default_optimizer(model, lr, state.device)
    scaler = grad_scaler(amp)

    frozen = {}
    run_log = RunLog(log_folder(log_dir, checkpoint_dir), state)
    try:
        # Before restoring RNG states: a resumed run must continue the
        # uninterrupted run's random stream, which drew this probe at its start.
        find_unused_parameters, frozen = settle_unused_parameters(
            model, train_loader, state, find_unused_parameters)

        start_epoch, history, resume_at, log_step = _resume_point(
            resume, checkpoint_dir, model, optimizer, lr_scheduler, scaler, state)
        run_log.start(log_step)

        wrapped = prepare_model(model, state, find_unused_parameters=bool(find_unused_parameters))
        trained = compile_model(wrapped, state, drop_last) if compile else wrapped
        def save_mid_epoch(epoch, step, optimizer_steps, totals):
            if optimizer_steps % save_steps == 0:
                save_checkpoint(
                    checkpoint_dir, state, model=model, optimizer=optimizer, epoch=epoch,
                    history=history, lr_scheduler=lr_scheduler, scaler=scaler, step=step,
                    epoch_totals=_global_totals(totals, state), log_step=run_log.last_step,
                )

        for epoch in range(start_epoch, epochs):
            entry = _train_epoch(
                trained, train_loader, optimizer, state, epoch, epochs, amp, scaler,
                max_grad_norm, lr_scheduler if lr_scheduler_interval == "step" else None, progress,
                resume_at=resume_at if epoch == start_epoch else None,
                save=save_mid_epoch if save_steps else None,
                accumulate=gradient_accumulation_steps, log=run_log if run_log.active else None,
            )
            if lr_scheduler is not None and lr_scheduler_interval == "epoch":
                lr_scheduler.step()
            if eval_loader is not None:
                metrics = _evaluate(wrapped, eval_loader, state, amp)
                entry.update({f"eval_{k}": v for k, v in metrics.items()})
                run_log.write(run_log.last_step, epoch + 1,
                              {f"eval/{k}": v for k, v in metrics.items()})
            history.append(entry)
            if state.is_main_process:
                print(_format(entry, epochs), flush=True)
            if checkpoint_dir is not None:
                save_checkpoint(
                    checkpoint_dir, state, model=model, optimizer=optimizer, epoch=epoch + 1,
                    history=history, lr_scheduler=lr_scheduler, scaler=scaler,
                    log_step=run_log.last_step,
                )
            for callback in callbacks:
                callback(entry)
    finally:
        run_log.close()
        restore_requires_grad(model, frozen)
    state.barrier()
    return history


def _restore(ckpt, model, optimizer, lr_scheduler, scaler, state):
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if lr_scheduler is not None and ckpt.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    if scaler is not None and ckpt.get("scaler") is not None:
        scaler.load_state_dict(ckpt["scaler"])
    rngs = ckpt.get("rng") or []
    if len(rngs) == state.world_size:
        set_rng_state(rngs[state.rank])
    elif state.is_main_process:
        logger.warning(
            "checkpoint holds RNG states of %d ranks, this run has %d; RNG streams not restored",
            len(rngs), state.world_size,
        )
    step = int(ckpt.get("step", 0))
    if state.is_main_process:
        logger.info("resumed from checkpoint after epoch %d, step %d", ckpt["epoch"], step)
    resume_at = {"step": step, "totals": ckpt["epoch_totals"].cpu()} if step else None
    return int(ckpt["epoch"]), list(ckpt.get("history") or []), resume_at


def _join(wrapped, state):
    # Safety net for loaders without len() (or an empty shard): ranks that run
    # out shadow the others' all-reduces instead of hanging.
    if state.is_distributed:
        return wrapped.join()
    return contextlib.nullcontext()


def _step_count(loader, state):
    """``(local, target, lockstep)`` batch counts; target is the largest rank's count under DDP.

    ``lockstep`` (the same on every rank): every rank takes every step, so a collective
    per step (:func:`rank_loss`'s target count) is safe. Not so when some loader has no
    ``len()`` or some rank has no batch; then DDP's ``join`` shadows its own all-reduces only.
    """
    try:
        n_local = len(loader)
    except TypeError:
        n_local = None
    if not state.is_distributed:
        return n_local, n_local, True
    known = -1 if n_local is None else n_local
    count = torch.tensor([known, -known], dtype=torch.int64, device=state.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    most, fewest = int(count[0]), -int(count[1])
    if fewest < 0:
        return n_local, None, False
    return n_local, most, fewest > 0


def _even_batches(loader, n_local, n_steps, done=0):
    """Yield this rank's batches, repeating from its start up to ``n_steps``.

    Like ``DistributedSampler`` padding: every rank takes the same number of
    optimizer steps, so replicas *and optimizer states* stay identical. DDP's
    ``join`` alone keeps weights equal only by a final broadcast, while the
    ranks that joined early skip optimizer steps and their Adam moments drift
    (a resumed run would then differ from an uninterrupted one). ``done``: batches
    the loader's first pass leaves out (resumed mid-epoch).
    """
    if n_steps is None or n_steps <= n_local:
        with batches_of(loader) as batches:
            yield from batches
        return
    produced = done
    while produced < n_steps:
        before = produced
        with batches_of(loader) as batches:
            for batch in batches:
                yield batch
                produced += 1
                if produced == n_steps:
                    return
        if produced == before:
            return  # empty shard: join() covers the missing steps


def _set_epoch(loader, epoch: int, skip: int = 0) -> bool:
    """Give ``epoch`` to whatever orders the batches, as Hugging Face's Trainer does.

    A :class:`~merlin_t4r_ops.training.data.ShardedLoader` takes it itself, with the
    ``skip`` batches its next pass leaves out; a user's ``DataLoader`` through its sampler
    (``DistributedSampler`` shuffles from ``seed + epoch``, so without it every epoch
    repeats the first one's order). Returns whether the loader skips the ``skip`` batches.
    """
    if isinstance(loader, ShardedLoader):
        loader.set_epoch(epoch, skip_batches=skip)
        return True
    samplers = [getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for target in [loader, *samplers]:
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)
            break
    return skip == 0


def _global_totals(totals: torch.Tensor, state) -> torch.Tensor:
    """``totals`` summed over the ranks (a collective under DDP)."""
    if not state.is_distributed:
        return totals.to("cpu", copy=True)
    summed = totals.to(state.device, copy=True)  # on the CPU .to() would alias totals
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.cpu()


def _train_epoch(
    wrapped, loader, optimizer, state, epoch, epochs, amp, scaler, max_grad_norm, step_scheduler,
    progress, resume_at=None, save=None, accumulate=1, log=None,
) -> dict:
    """One epoch; ``resume_at`` (``{"step", "totals"}``) continues a mid-epoch checkpoint,
    ``save(epoch, batches, optimizer_steps, totals)`` is offered after every optimizer step
    but the epoch's last (ranks in lockstep); ``accumulate`` batches make one step;
    ``log`` (a :class:`~merlin_t4r_ops.training.run_log.RunLog`) gets each step's loss and
    learning rate."""
    skip = resume_at["step"] if resume_at else 0
    placed = _set_epoch(loader, epoch, skip)
    wrapped.train()
    # On the device, read at logging steps and the epoch's end: reading a loss each step
    # would wait for the GPU to finish it before the next batch could be queued.
    totals = torch.zeros(3, dtype=torch.float64, device=state.device)  # loss sum, batches, rows
    if resume_at and state.is_main_process:
        totals += resume_at["totals"].to(state.device)  # all ranks' totals so far, counted once
    non_finite = torch.zeros((), dtype=torch.int64, device=state.device)
    start = time.perf_counter()
    n_local, n_steps, lockstep = _step_count(loader, state)
    batches = _even_batches(loader, n_local, n_steps, done=skip if placed else 0)
    if not placed:
        batches = itertools.islice(batches, skip, None)
    bar = tqdm(
        batches,
        total=n_steps,
        initial=skip,
        desc=f"epoch {epoch + 1}/{epochs}",
        disable=not (progress and state.is_main_process),
        leave=False,
    )
    step_args = (wrapped, optimizer, scaler, max_grad_norm, step_scheduler)
    pending = False
    window = torch.zeros(2, dtype=torch.float64, device=state.device)  # since the last step
    steps_log = _StepLog(log, state, lockstep)
    optimizer.zero_grad(set_to_none=True)
    with _join(wrapped, state):
        for step, (x, y) in enumerate(bar, start=skip + 1):
            x, y = to_device(x, state.device), to_device(y, state.device)
            boundary = step % accumulate == 0 or step == n_steps
            with _no_sync(wrapped, state, boundary):
                with _autocast(amp, state):
                    output = forward_batch(wrapped, x, y, training=True)
                    loss = rank_loss(output, unwrap_model(wrapped), state if lockstep else None)
                (scaler.scale(loss / accumulate) if scaler else loss / accumulate).backward()
            pending = not boundary
            value = loss.detach().to(torch.float64)
            window[0] += value
            window[1] += 1.0
            if boundary:
                _optimizer_step(*step_args)
                if log is not None:
                    steps_log.add(window, optimizer, epoch, step, n_steps, accumulate)
                    window = torch.zeros(2, dtype=torch.float64, device=state.device)
            non_finite += ~torch.isfinite(value)
            totals[0] += value
            totals[1] += 1.0
            totals[2] += float(_batch_rows(x))
            if not bar.disable and step % _POSTFIX_EVERY == 0:
                bar.set_postfix(loss=f"{float(value):.4f}")
            if save is not None and lockstep and boundary and step != n_steps:
                steps_log.flush()  # the checkpoint records the last step logged
                save(epoch, step, step // accumulate, totals)
            elif steps_log.full():
                steps_log.flush()
        if pending:  # a loader without len(): its last batches still make a step
            _optimizer_step(*step_args)
    bar.close()
    steps_log.flush()
    if int(non_finite) and state.is_main_process:
        logger.warning("non-finite training loss at %d batches of epoch %d", int(non_finite),
                       epoch + 1)
    totals = _global_totals(totals, state)
    seconds = time.perf_counter() - start
    if state.is_distributed:
        # The slowest rank's time is the epoch's time.
        t = torch.tensor([seconds], dtype=torch.float64, device=state.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t.cpu())
    return {
        "epoch": epoch + 1,
        "train_loss": float(totals[0] / totals[1]) if totals[1] > 0 else float("nan"),
        "train_samples": int(totals[2]),
        "train_seconds": seconds,
        "lr": float(optimizer.param_groups[0]["lr"]),
    }


class _StepLog:
    """Each optimizer step's mean loss and learning rate, written to ``log`` in groups.

    The losses stay on the device until :meth:`flush` (every ``_LOG_FLUSH_EVERY`` steps, before
    a checkpoint and at the epoch's end): reading one per step would make the loop wait for
    the GPU at every step. Over all ranks when they step in lockstep (one all-reduce a flush).
    """

    def __init__(self, log, state, lockstep: bool):
        self.log, self.state, self.lockstep = log, state, lockstep
        self.rows = []  # (global step, epoch, [loss sum, batches] on the device, lr)

    def add(self, window, optimizer, epoch, step, n_steps, accumulate) -> None:
        steps_per_epoch = math.ceil(n_steps / accumulate) if n_steps else 0
        global_step = epoch * steps_per_epoch + math.ceil(step / accumulate)
        self.rows.append((global_step, epoch + step / max(n_steps or step, 1), window,
                          float(optimizer.param_groups[0]["lr"])))

    def full(self) -> bool:
        return len(self.rows) >= _LOG_FLUSH_EVERY

    def flush(self) -> None:
        if not self.rows:
            return
        windows = torch.stack([row[2] for row in self.rows])
        # Every rank reaches every step in lockstep: the all-reduce cannot hang.
        windows = _global_totals(windows, self.state) if self.lockstep else windows.cpu()
        for (global_step, epoch, _, lr), (loss_sum, batches) in zip(self.rows, windows.tolist()):
            self.log.write(global_step, epoch,
                           {"train/loss": loss_sum / batches, "train/learning_rate": lr})
        self.rows = []


_LOG_FLUSH_EVERY = 50  # optimizer steps between the log's reads of the losses (each a host sync)
_POSTFIX_EVERY = 50  # steps between the progress bar's loss readings (each a host sync)


def _no_sync(wrapped, state, boundary: bool):
    """DDP's ``no_sync`` for a batch that does not end an accumulation: no all-reduce."""
    if state.is_distributed and not boundary:
        return wrapped.no_sync()
    return contextlib.nullcontext()


def _optimizer_step(wrapped, optimizer, scaler, max_grad_norm, step_scheduler) -> None:
    """Clip, step (through GradScaler under AMP), step the scheduler, clear the gradients."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_grad_norm)
    stepped = True
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        # GradScaler skips the step on inf/NaN gradients and lowers its scale.
        stepped = scaler.get_scale() >= scale
    else:
        optimizer.step()
    if step_scheduler is not None and stepped:
        step_scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _format(entry: dict, epochs: int) -> str:
    parts = [f"epoch {entry['epoch']}/{epochs}", f"train_loss={entry['train_loss']:.4f}"]
    parts += [f"{k}={v:.4f}" for k, v in entry.items() if k.startswith("eval_")]
    return "  ".join(parts)
