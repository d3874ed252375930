"""``torch.nn.DataParallel``'s split and merge on the CPU, for machines without two GPUs.

DataParallel's ``Scatter`` and ``Gather`` are CUDA copies, so on CPU it only
calls its module. :class:`SimulatedDataParallel` does what it does on ``n``
GPUs, step for step as torch 2.x ``torch/nn/parallel/scatter_gather.py`` and
``data_parallel.py`` do:

* every tensor is cut with ``Tensor.chunk(n, dim=0)`` (what ``comm.scatter``
  does without chunk sizes), so 50 rows on 4 GPUs are 13+13+13+11 and 5 rows
  are 2+2+1: *three* chunks;
* non-tensors are repeated once per GPU, and tuples/dicts are zipped, so
  they are cut to the fewest chunks among their tensors;
* ``scatter_kwargs`` pads the shorter of (positional, keyword) chunks: extra
  replicas get keyword arguments and no positional ones;
* one replica per chunk runs the module (replicas share the parameters; here
  they are the module itself, run one after another);
* outputs are merged by ``torch.cat`` along dim 0, dicts and tuples key by key,
  and 0-dim tensors are unsqueezed first (``Gather`` warns and does the same).

Only the devices are simulated; the models and the code under test are real.
"""

import torch


def _scatter(obj, n):
    """``scatter_map`` of torch's ``scatter`` with ``Tensor.chunk`` as the device copy."""
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(n, dim=0))
    if isinstance(obj, tuple) and len(obj) > 0:
        return list(zip(*(_scatter(o, n) for o in obj)))
    if isinstance(obj, list) and len(obj) > 0:
        return [list(i) for i in zip(*(_scatter(o, n) for o in obj))]
    if isinstance(obj, dict) and len(obj) > 0:
        return [type(obj)(i) for i in zip(*(_scatter(item, n) for item in obj.items()))]
    return [obj for _ in range(n)]


def scatter_kwargs(inputs, kwargs, n):
    """torch's ``scatter_kwargs`` for ``n`` devices."""
    scattered_inputs = _scatter(inputs, n) if inputs else []
    scattered_kwargs = _scatter(kwargs, n) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(outputs):
    """torch's ``gather`` (``gather_map``) onto one device."""
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        return torch.cat([o.unsqueeze(0) if o.dim() == 0 else o for o in outputs], dim=0)
    if out is None:
        return None
    if isinstance(out, dict):
        if not all(len(out) == len(d) for d in outputs):
            raise ValueError("All dicts must have the same number of keys")
        return type(out)((k, gather([d[k] for d in outputs])) for k in out)
    return type(out)(map(gather, zip(*outputs)))


class SimulatedDataParallel(torch.nn.DataParallel):
    """A ``DataParallel`` that splits and merges like one over ``n_devices`` GPUs.

    It is a ``DataParallel`` (``unwrap_model`` and Hugging Face see one) around
    the same module as the one it is made from.
    """

    def __init__(self, module, n_devices):
        super().__init__(module)
        self.n_devices = n_devices
        self.chunk_rows = []  # rows per replica of every forward, for the tests' own checks

    def forward(self, *inputs, **kwargs):
        inputs, module_kwargs = scatter_kwargs(inputs, kwargs, self.n_devices)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        self.chunk_rows.append([_rows(i) for i in inputs])
        outputs = [self.module(*i, **k) for i, k in zip(inputs, module_kwargs)]
        return gather(outputs)


def simulate(data_parallel, n_devices):
    """The ``DataParallel`` that the code under test built, run as on ``n_devices`` GPUs."""
    assert isinstance(data_parallel, torch.nn.DataParallel), type(data_parallel)
    return SimulatedDataParallel(data_parallel.module, n_devices)


def _rows(obj):
    if isinstance(obj, torch.Tensor):
        return int(obj.shape[0])
    if isinstance(obj, dict):
        obj = list(obj.values())
    values = obj if isinstance(obj, (tuple, list)) else []
    for value in values:
        rows = _rows(value)
        if rows is not None:
            return rows
    return None
