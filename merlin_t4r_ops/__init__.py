"""Serve Transformers4Rec models through Merlin Systems on Triton, and train them on many GPUs.

* :class:`PredictT4RPyTorch` runs a T4R model in eager PyTorch inside a Merlin ensemble.
* :mod:`merlin_t4r_ops.serving` starts a real ``tritonserver`` and talks to it.
* :mod:`merlin_t4r_ops.training` trains with DataParallel, DDP or one device.
"""

from merlin_t4r_ops.errors import (
    ArtifactError,
    InvalidRequestError,
    SchemaMismatchError,
    ServerStartError,
    StrategyError,
    T4ROpsError,
)
from merlin_t4r_ops.ops import PredictT4RPyTorch

__version__ = "0.1.0"

__all__ = [
    "PredictT4RPyTorch",
    "T4ROpsError",
    "ArtifactError",
    "InvalidRequestError",
    "SchemaMismatchError",
    "ServerStartError",
    "StrategyError",
]
