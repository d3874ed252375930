"""A batch's tensors in one buffer, for the trip from a loader worker to the training process.

``torch.utils.data.DataLoader`` sends every tensor a worker yields through shared memory of
its own: the worker creates a segment, and the training process receives its file
descriptor and maps it, tensor by tensor. A batch of T4R's testing data holds 15 tensors:
receiving them from 2 workers took 1.6-3.7 ms of the training process's CPU a batch (batch
384, a 2-core host), and 0.5-0.9 ms as one buffer (``python benchmarks/loader.py --rows 8000``
prints both; docs/benchmarks.md has a run). That time is the training loop's, whose step is host-bound on a GPU. The
pin-memory thread then pinned each tensor on its own.

A worker therefore yields a :class:`PackedBatch`: the batch's tensors copied into one
``uint8`` buffer, with where each one lies. The ``DataLoader`` sends and pins that one
buffer, and the training process takes the tensors back as views of it (pinned where the
buffer is), equal tensor for tensor to the batch the worker made. A view kept (labels held for
metrics, say) keeps its whole batch's buffer alive.
"""

import dataclasses
from typing import Any, Optional, Tuple

import torch

__all__ = ["PackedBatch"]

_ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype can view its bytes

# (part, name, dtype, shape, start): part "x", or "y" (name None for a lone target tensor).
Field = Tuple[str, Optional[str], torch.dtype, Tuple[int, ...], int]


@dataclasses.dataclass
class PackedBatch:
    """``(x, y)`` as one buffer and the place of each tensor in it.

    Parameters
    ----------
    buffer : torch.Tensor
        ``uint8``, every tensor's bytes at its ``start``.
    fields : tuple of (part, name, dtype, shape, start)
    targets : str
        ``"none"``, ``"tensor"`` or ``"dict"``: the form of ``y``.
    """

    buffer: torch.Tensor
    fields: Tuple[Field, ...]
    targets: str

    @classmethod
    def pack(cls, x: dict, y: Any) -> "PackedBatch":
        """Copy ``x`` (name to tensor) and ``y`` (None, a tensor, or name to tensor) into one buffer."""
        targets = "none" if y is None else "dict" if isinstance(y, dict) else "tensor"
        parts = [("x", name, t) for name, t in x.items()]
        if targets == "tensor":
            parts.append(("y", None, y))
        elif targets == "dict":
            parts += [("y", name, t) for name, t in y.items()]
        fields, size = [], 0
        for part, name, tensor in parts:
            fields.append((part, name, tensor.dtype, tuple(tensor.shape), size))
            size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        buffer = torch.empty(size, dtype=torch.uint8)
        packed = cls(buffer, tuple(fields), targets)
        for (_, _, tensor), view in zip(parts, packed._views()):
            view.copy_(tensor)
        return packed

    def _views(self):
        for _, _, dtype, shape, start in self.fields:
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            yield self.buffer[start:start + nbytes].view(dtype).view(shape)

    def unpack(self) -> Tuple[dict, Any]:
        """``(x, y)`` again: views of the buffer, in the order they were packed."""
        x, y = {}, {}
        for (part, name, _, _, _), view in zip(self.fields, self._views()):
            (x if part == "x" else y)[name] = view
        if self.targets == "none":
            return x, None
        return x, (y[None] if self.targets == "tensor" else y)

    def pin_memory(self, device=None) -> "PackedBatch":
        """What the ``DataLoader``'s pin-memory thread calls: one buffer pinned, not each tensor."""
        return dataclasses.replace(self, buffer=self.buffer.pin_memory())
