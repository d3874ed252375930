"""Merlin Systems operators."""

from merlin_t4r_ops.ops.decode import DecodeItemIds
from merlin_t4r_ops.ops.predict_t4r import PredictT4RPyTorch

__all__ = ["PredictT4RPyTorch", "DecodeItemIds"]
