"""Train Transformers4Rec models on one device, with DataParallel, or with DDP.

Quick start::

    from merlin_t4r_ops.training import fit
    history = fit(model, "data/train/", eval_data="data/valid/", epochs=3, seed=0)

Launch the same script as ``python train.py`` (one device, or DataParallel when
one process sees several GPUs), ``torchrun --standalone --nproc_per_node=N
train.py`` (DDP on one node; gloo on CPU) or, on every node,
``torchrun --nnodes=M --nproc_per_node=N --rdzv-backend=c10d
--rdzv-endpoint=HOST:29500 --rdzv-id=JOB train.py``. DDP is torch.distributed
itself; there is no home-made process manager. ``batch_size`` is per device, as
in Hugging Face, so the global batch is ``batch_size`` times the number of GPUs
under DDP and DataParallel alike: keep the global batch or scale the learning
rate (see :mod:`merlin_t4r_ops.training.fit` for the full story).

The strategy decision is one :class:`DistributedState` made by
:func:`resolve_strategy` and passed around, never a global.
"""

from merlin_t4r_ops.training.checkpoint import load_checkpoint, save_checkpoint
from merlin_t4r_ops.training.data import ShardedLoader, make_loader
from merlin_t4r_ops.training.fit import evaluate, fit
from merlin_t4r_ops.training.metrics import MetricAccumulator
from merlin_t4r_ops.training.state import (
    DistributedState,
    prepare_model,
    resolve_strategy,
    unwrap_model,
)
from merlin_t4r_ops.training.trainer import Trainer

__all__ = [
    "DistributedState",
    "resolve_strategy",
    "prepare_model",
    "unwrap_model",
    "fit",
    "evaluate",
    "make_loader",
    "ShardedLoader",
    "MetricAccumulator",
    "save_checkpoint",
    "load_checkpoint",
    "Trainer",
]
