"""Runtimes for ``Ensemble.export(path, runtime=...)``.

* :class:`TritonRuntime`: Merlin's Triton runtime with the executor's instance group chosen
  at export (N instances per GPU, on each GPU).
* :class:`BatchingTritonRuntime`: the same, plus Triton's dynamic batcher and an executor
  that runs the graph once for all the requests it is handed.

``ensemble.export(path)`` without a runtime is Merlin's own export, unchanged.
"""

from merlin_t4r_ops.runtime.instances import instance_group
from merlin_t4r_ops.runtime.runtime import BatchingTritonRuntime, TritonRuntime

__all__ = ["TritonRuntime", "BatchingTritonRuntime", "instance_group"]
