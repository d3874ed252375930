"""Train Transformers4Rec models on one device, DataParallel or DDP.

(Launch story and API are documented in :mod:`merlin_t4r_ops.training.fit`.)
"""

from merlin_t4r_ops.training.state import (
    DistributedState,
    prepare_model,
    resolve_strategy,
    unwrap_model,
)

__all__ = [
    "DistributedState",
    "resolve_strategy",
    "prepare_model",
    "unwrap_model",
]

# --- trainer exports (helper B adds merlin_t4r_ops.training.trainer here) ---
# --- end trainer exports ---
