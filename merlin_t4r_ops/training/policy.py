"""One policy for ``fit`` and the ``Trainer``: seeds, unused parameters and the run's log.

Both call these functions, so the two entry points cannot drift apart again:

* **Seeds.** Every rank seeds ``random``, numpy and torch with the same ``seed``, with
  ``transformers.set_seed`` as Hugging Face's Trainer does with ``args.seed`` (default
  :data:`DEFAULT_SEED`, ``TrainingArguments``'). The data order comes from
  ``data_seed`` when given, else from ``seed`` (``args.data_seed``); it is the same
  on every rank, so the shards stay disjoint.
* **Unused parameters.** Unless told (``fit(find_unused_parameters=)``,
  ``args.ddp_find_unused_parameters``), DDP is not left to find unused parameters on
  every step: one probe batch finds those that no rank uses, they are frozen for the
  run, and ``find_unused_parameters`` is True only when the ranks disagree
  (:mod:`~merlin_t4r_ops.training.unused`). Hugging Face would pass True for any
  model that is not a ``PreTrainedModel``, a T4R model among them.
* **The log.** ``fit`` logs into ``log_dir``, by default its ``checkpoint_dir`` (the
  Trainer logs under its ``output_dir``); ``log_dir=False`` logs nothing. The log keeps
  the rows up to the step the run starts from (the resumed checkpoint's, else 0).
"""

import logging
from typing import Dict, Optional, Tuple

import transformers

from merlin_t4r_ops.training.data import first_batch, to_device
from merlin_t4r_ops.training.state import DistributedState
from merlin_t4r_ops.training.unused import freeze, probe_unused_parameters

__all__ = ["DEFAULT_SEED", "seed_everything", "data_order_seed", "settle_unused_parameters",
           "log_folder"]

logger = logging.getLogger(__name__)

DEFAULT_SEED = 42  # transformers.TrainingArguments.seed


def seed_everything(seed: Optional[int]) -> None:
    """Seed ``random``, numpy, torch and CUDA with ``seed`` on this rank; None seeds nothing.

    The same seed on every rank, as Hugging Face's Trainer: ranks differ by their data,
    not by their random streams.
    """
    if seed is not None:
        transformers.set_seed(seed)


def data_order_seed(seed: Optional[int], data_seed: Optional[int]) -> int:
    """The seed of the data order: ``data_seed`` when given, else ``seed`` (else 0)."""
    if data_seed is not None:
        return data_seed
    return seed if seed is not None else 0


def settle_unused_parameters(
    model, train_loader, state: DistributedState, find_unused_parameters: Optional[bool]
) -> Tuple[bool, Dict[str, bool]]:
    """DDP's ``find_unused_parameters`` for ``model``, probing when it is None.

    Parameters
    ----------
    model : torch.nn.Module
        Unwrapped, on ``state.device``.
    train_loader : iterable of (x, y)
        Its first batch is the probe; the pass is closed.
    state : DistributedState
        Under DDP a collective when ``find_unused_parameters`` is None.
    find_unused_parameters : bool or None
        A bool is the answer as is (nothing probed, nothing frozen).

    Returns
    -------
    find_unused_parameters : bool
    frozen : dict
        The ``requires_grad`` flags of the frozen parameters, for
        :func:`~merlin_t4r_ops.training.unused.restore_requires_grad` once the run ends.
    """
    if not state.is_distributed or find_unused_parameters is not None:
        return bool(find_unused_parameters), {}
    batch = first_batch(train_loader)
    batch = None if batch is None else tuple(to_device(b, state.device) for b in batch)
    unused, disagree = probe_unused_parameters(model, batch, state)
    frozen = freeze(model, unused)
    if state.is_main_process and unused:
        logger.info("freezing %d parameters the task never uses: %s", len(unused), unused)
    if state.is_main_process and disagree:
        logger.info("ranks use different parameters; DDP find_unused_parameters=True")
    return disagree, frozen


def log_folder(log_dir, checkpoint_dir):
    """Where ``fit`` logs: ``log_dir``, by default (None) ``checkpoint_dir``; False: nowhere."""
    if log_dir is False:
        return None
    return log_dir if log_dir is not None else checkpoint_dir
