"""Resuming the ``Trainer`` from a Hugging Face checkpoint: RNG states and the data position.

Hugging Face 4.30 resumes with two steps that fail here:

* it saves ``rng_state.pth`` (``rng_state_<rank>.pth`` under DDP) with numpy arrays and
  Python tuples and loads it with ``torch.load``'s default, which in this torch is
  ``weights_only=True``: "Weights only load failed". The ``Trainer`` rewrites the file
  in :func:`~merlin_t4r_ops.training.checkpoint.rng_state`'s format (tensors and plain
  numbers, as ``fit``'s checkpoints hold them) and reads it back with
  ``weights_only=True``;
* mid-epoch it skips the batches already trained with accelerate's
  ``skip_first_batches``, which rebuilds a ``torch.utils.data.DataLoader`` from the
  loader's ``sampler``: a ``ShardedLoader`` has none. The ``Trainer`` instead places its
  loader at the epoch and batch where the checkpoint was taken
  (:func:`place_loader`) and lets Hugging Face skip nothing (``ignore_data_skip``);
* under DDP it loads the optimizer state to ``args.device``, which accelerate names
  ``cpu:<local rank>`` on CPU and torch cannot map to ("don't know how to restore data
  location ... cpu:0"): :func:`load_optimizer_and_scheduler` maps to the process's device.
"""

import json
import logging
import os
import pickle

import torch
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import get_last_checkpoint

from merlin_t4r_ops.training.checkpoint import rng_state, set_rng_state

__all__ = [
    "rng_file", "save_rng_state", "load_rng_state", "resolve_checkpoint", "place_loader",
    "load_optimizer_and_scheduler",
]

logger = logging.getLogger(__name__)


def rng_file(checkpoint, args) -> str:
    """The RNG file of this process in ``checkpoint``, named as Hugging Face names it."""
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    return os.path.join(os.fspath(checkpoint), name)


def save_rng_state(checkpoint, args) -> None:
    """Write this process's RNG states to ``checkpoint`` in the weights-only format."""
    torch.save(rng_state(), rng_file(checkpoint, args))


def load_rng_state(checkpoint, args) -> bool:
    """Restore this process's RNG states from ``checkpoint``; False when there are none to read.

    A file that ``torch.load(weights_only=True)`` refuses (Hugging Face's own format, with
    numpy arrays) is not unpickled: a warning says the random streams are not restored.
    """
    path = rng_file(checkpoint, args)
    if not os.path.isfile(path):
        logger.warning("no RNG states in %s; the random streams are not restored", path)
        return False
    try:
        states = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        logger.warning(
            "%s is not in merlin_t4r_ops' weights-only RNG format (it was written by another "
            "Trainer) and is not unpickled; the random streams are not restored: %s", path, exc
        )
        return False
    set_rng_state(states)
    return True


def resolve_checkpoint(resume_from_checkpoint, output_dir):
    """Hugging Face's reading of ``resume_from_checkpoint``: True means the newest checkpoint."""
    if resume_from_checkpoint is True:
        return get_last_checkpoint(output_dir)  # None: Hugging Face raises its own error
    return resume_from_checkpoint or None


def place_loader(loader, checkpoint, gradient_accumulation_steps: int) -> None:
    """Make ``loader``'s next pass start where the run that wrote ``checkpoint`` stood.

    Hugging Face's own arithmetic: ``global_step`` optimizer steps of
    ``len(loader) // gradient_accumulation_steps`` per epoch.
    """
    with open(os.path.join(checkpoint, "trainer_state.json")) as stream:
        global_step = int(json.load(stream)["global_step"])
    steps_per_epoch = max(len(loader) // gradient_accumulation_steps, 1)
    epoch, steps = divmod(global_step, steps_per_epoch)
    loader.set_epoch(epoch, skip_batches=steps * gradient_accumulation_steps)


def load_optimizer_and_scheduler(trainer, checkpoint, device) -> None:
    """Hugging Face's loading of the optimizer, scheduler and scaler states, mapped to ``device``.

    As Hugging Face does: nothing unless both the optimizer's and the scheduler's file
    are there; the scaler's when the trainer scales gradients.
    """
    path = os.path.join(os.fspath(checkpoint), OPTIMIZER_NAME)
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME))):
        return
    trainer.optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    trainer.lr_scheduler.load_state_dict(
        torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
    )
    scaler = os.path.join(checkpoint, SCALER_NAME)
    if trainer.do_grad_scaling and os.path.isfile(scaler):
        trainer.scaler.load_state_dict(torch.load(scaler, weights_only=True))
