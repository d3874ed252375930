"""Replay the operator's GPU work (forward, masking, top-k) from CUDA graphs, one per batch bucket.

A T4R model at serving sizes spends far longer in Python and kernel launches than on the
GPU (H200, XLNet d_model 64: 3.6 ms eager against 0.3 ms of GPU time at batch 1). A CUDA
graph replays all of a forward's kernels with one launch, but only for the shapes it was
captured with. So the batch sizes are split into buckets (default 1, 2, 4, ..., 256): a
request's rows are copied into the static input buffers of the smallest bucket that holds
them, the rest of those buffers is zero (empty sessions: every row of a T4R model is
computed on its own, so padding rows never change the real ones; a padding row of seen ids
masks only id 0 in a row that is cut off), the graph is replayed,
and only the request's rows are copied back. Larger requests, and buckets whose capture
failed, run eagerly.

The capture runs under ``with torch.device(device)``: XLNet in transformers 4.30 builds
``arange``/``eye`` tensors on the CPU and copies them on every forward, which a capture
refuses and which costs a host round trip each time in eager mode.
"""

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from merlin_t4r_ops.arguments import is_positive_int
from merlin_t4r_ops.errors import T4ROpsError

__all__ = [
    "DEFAULT_BUCKETS",
    "CudaGraphBuckets",
    "bucket_for",
    "check_buckets",
    "cut_rows",
    "example_request",
    "log_load",
    "pad_rows",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS: Tuple[int, ...] = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256

Tensors = Dict[str, torch.Tensor]


def check_buckets(buckets: Optional[Iterable[int]]) -> Tuple[int, ...]:
    """The batch buckets, sorted and unique; ``None`` or empty turns capturing off.

    Raises
    ------
    T4ROpsError
        Naming ``cuda_graph_buckets`` when a bucket is not a positive int.
    """
    if buckets is None:
        return ()
    buckets = tuple(buckets)
    bad = [b for b in buckets if not is_positive_int(b)]
    if bad:
        raise T4ROpsError(
            f"cuda_graph_buckets must be positive ints (batch sizes), got {bad[0]!r} in "
            f"{buckets!r}"
        )
    return tuple(sorted({int(b) for b in buckets}))


def bucket_for(rows: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket that holds ``rows``, or ``None`` when none does."""
    for bucket in buckets:
        if bucket >= rows:
            return bucket
    return None


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (returned as is when it has them)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        raise T4ROpsError(f"cannot pad {tensor.shape[0]} rows down to {rows}")
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def cut_rows(outputs: Tensors, rows: int) -> Tensors:
    """The first ``rows`` rows of every output: the request's own, without the padding."""
    return {name: value[:rows] for name, value in outputs.items()}


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: Tensors  # static buffers the graph reads
    outputs: Tensors  # static buffers the graph writes
    pool_mib: float  # CUDA memory reserved while warming up and capturing this bucket
    buffer_mib: float  # the static inputs and outputs themselves


def _mib(tensors: Iterable[torch.Tensor]) -> float:
    return sum(t.element_size() * t.nelement() for t in tensors) / 2**20


class CudaGraphBuckets:
    """CUDA graphs of ``fn(inputs) -> outputs`` for a set of batch sizes, replayed by rows.

    Parameters
    ----------
    fn : callable
        ``fn(dict of [batch, ...] tensors on device) -> dict of [batch, ...] tensors``, with
        no host synchronisation inside (the operator's forward + masking + top-k). Called in
        ``torch.inference_mode``.
    example : dict of torch.Tensor
        One valid row of every input (``[1, ...]``, any device): shapes, dtypes, and values
        for the warm-up runs.
    buckets : sequence of int
        Batch sizes to capture (see :func:`check_buckets`).
    device : torch.device
        A CUDA device.
    warmup : int
        Eager runs before each capture (cuBLAS and allocator set-up happen there).

    Attributes
    ----------
    captured : dict
        Bucket -> the captured graph and its buffers.
    failed : dict
        Bucket -> why its capture failed; those batch sizes run eagerly.
    """

    def __init__(self, fn: Callable[[Tensors], Tensors], example: Tensors,
                 buckets: Sequence[int], device: torch.device, warmup: int = 2):
        if torch.device(device).type != "cuda":
            raise T4ROpsError(f"CUDA graphs need a CUDA device, got {device}")
        self.fn = fn
        self.device = torch.device(device)
        self.buckets = check_buckets(buckets)
        self.captured: Dict[int, _Captured] = {}
        self.failed: Dict[int, str] = {}
        self._lock = threading.Lock()  # one replay at a time: the buffers are shared
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller buckets then reuse the pool's blocks instead of growing it.
        for bucket in sorted(self.buckets, reverse=True):
            try:
                self.captured[bucket] = self._capture(example, bucket, pool, warmup)
            except Exception as error:  # whatever refuses capture runs eagerly instead
                self.failed[bucket] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        self.covered = tuple(b for b in self.buckets if b in self.captured)

    def _capture(self, example: Tensors, bucket: int, pool, warmup: int) -> _Captured:
        static = {name: value.to(self.device).expand(bucket, *value.shape[1:]).contiguous()
                  for name, value in example.items()}
        reserved = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode(), torch.device(self.device):
            for _ in range(warmup):
                self.fn(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.device(self.device):
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs = self.fn(static)
        torch.cuda.synchronize(self.device)
        pool_mib = (torch.cuda.memory_reserved(self.device) - reserved) / 2**20
        return _Captured(graph, static, outputs, pool_mib,
                         _mib(list(static.values()) + list(outputs.values())))

    def bucket_for(self, rows: int) -> Optional[int]:
        """The captured bucket a request of ``rows`` rows replays, or ``None`` (run eagerly)."""
        return bucket_for(rows, self.covered)

    def __call__(self, inputs: Tensors, outputs: Optional[Iterable[str]] = None) -> Tensors:
        """Pad ``inputs`` (CPU or device tensors of one request) to its bucket, replay, cut.

        Returns copies of the request's rows of the ``outputs`` named (default all), on the
        device: the static outputs are overwritten by the next replay, and a caller may work
        on them further (the operator masks a long session's older items on the scores)
        before it copies to the host.
        """
        rows = next(iter(inputs.values())).shape[0]
        bucket = self.bucket_for(rows)
        if bucket is None:
            raise T4ROpsError(
                f"no captured bucket holds {rows} rows (captured: {list(self.covered)})"
            )
        captured = self.captured[bucket]
        names = list(captured.outputs) if outputs is None else list(outputs)
        unknown = [name for name in names if name not in captured.outputs]
        if unknown:
            raise T4ROpsError(
                f"outputs {unknown} are not outputs of the captured graphs; they write "
                f"{list(captured.outputs)}"
            )
        with self._lock:
            for name, value in inputs.items():
                captured.inputs[name].copy_(pad_rows(value, bucket), non_blocking=True)
            captured.graph.replay()
            wanted = {name: captured.outputs[name] for name in names}
            return {name: value.clone() for name, value in cut_rows(wanted, rows).items()}

    def report(self) -> List[str]:
        """One line per bucket: captured with its memory, or why it runs eagerly."""
        lines = []
        for bucket in self.buckets:
            if bucket in self.captured:
                c = self.captured[bucket]
                lines.append(f"bucket {bucket}: captured, buffers {c.buffer_mib:.2f} MiB, "
                             f"reserved +{c.pool_mib:.2f} MiB")
            else:
                lines.append(f"bucket {bucket}: eager, capture failed ({self.failed[bucket]})")
        return lines

    def summary(self) -> str:
        """The load-time log line: what replays, what runs eagerly, and the memory used."""
        eager = (f"batches above {max(self.covered)} rows run eagerly" if self.covered
                 else "every batch runs eagerly")
        if self.failed:  # their rows pad up to the next captured bucket, if any
            eager += f"; capture failed for buckets {sorted(self.failed)}"
        total = sum(c.pool_mib + c.buffer_mib for c in self.captured.values())
        return (f"CUDA graphs on {self.device}: buckets {list(self.covered)} captured "
                f"({total:.1f} MiB in all); {eager}. " + "; ".join(self.report()))


def example_request(specs, width: int) -> Tensors:
    """One valid one-row request, built by the same code as real requests (on the CPU).

    Every list holds ``width`` items of id 1 (id 0 where a table has one row), every
    continuous value is 1: shapes and dtypes are exactly those of a real request.
    """
    import numpy as np
    from merlin.table import TensorTable

    from merlin_t4r_ops.ops.inputs import to_model_inputs

    columns = {}
    for spec in specs:
        shape = (1, width) if spec.is_list else (1,)
        value = 0 if spec.cardinality == 1 else 1
        dtype = np.int64 if spec.is_categorical else np.float32
        columns[spec.name] = np.full(shape, value, dtype=dtype)
    return to_model_inputs(TensorTable(columns), specs, width, torch.device("cpu"))


def log_load(message: str, warning: bool = False) -> None:
    """Log ``message`` here and, inside a Triton Python-backend stub, in the server's log.

    The stub does not forward Python's ``logging`` below WARNING, and the capture report is
    what an operator needs to read at load; Triton's own ``pb_utils.Logger`` writes it to
    the server log at the matching level.
    """
    (logger.warning if warning else logger.info)(message)
    try:
        import triton_python_backend_utils as pb_utils

        triton_logger = pb_utils.Logger
    except (ImportError, AttributeError):  # not inside a stub
        return
    (triton_logger.log_warn if warning else triton_logger.log_info)(message)
