"""Serve Transformers4Rec models through Merlin Systems on Triton, and train them on many GPUs.

* :class:`PredictT4RPyTorch` runs a T4R model in eager PyTorch inside a Merlin ensemble.
* :class:`DecodeItemIds` turns its top-k item ids back into the shop's own item ids.
* :mod:`merlin_t4r_ops.serving` starts a real ``tritonserver`` and talks to it.
* :mod:`merlin_t4r_ops.training` trains with DataParallel, DDP or one device.
"""

from merlin_t4r_ops.harmless_warnings import ignore_tensorflow_dtypes_warning

# Before anything imports merlin-core: its TensorFlow dtypes are of no use to a PyTorch model.
ignore_tensorflow_dtypes_warning()

from merlin_t4r_ops.errors import (  # noqa: E402
    ArtifactError,
    InvalidRequestError,
    SchemaMismatchError,
    ServerStartError,
    StrategyError,
    T4ROpsError,
)
from merlin_t4r_ops.ops import DecodeItemIds, PredictT4RPyTorch  # noqa: E402
from merlin_t4r_ops.serving.triton_env import put_scripts_on_path  # noqa: E402

# Merlin's run_triton_server finds tritonserver on PATH, which an unactivated venv lacks.
put_scripts_on_path()

__version__ = "0.1.0"

__all__ = [
    "PredictT4RPyTorch",
    "DecodeItemIds",
    "T4ROpsError",
    "ArtifactError",
    "InvalidRequestError",
    "SchemaMismatchError",
    "ServerStartError",
    "StrategyError",
]
