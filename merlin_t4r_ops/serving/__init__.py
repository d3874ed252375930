"""Run a real Triton Inference Server on an exported ensemble, and talk to it."""

from merlin_t4r_ops.serving.server import TritonServer, triton_server

__all__ = ["TritonServer", "triton_server"]
