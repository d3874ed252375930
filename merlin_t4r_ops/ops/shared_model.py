"""One model object behind several operators: one lock, one artifact folder, one load.

``PredictT4RPyTorch`` operators built over the same model object (a top-20 and a top-5 of
one model, say) share one :class:`SharedModel`:

* T4R keeps per-call tensors on the model's modules, so they call it under one lock;
* an export writes the model's artifacts once, into one folder (the first of them in the
  graph writes it: :func:`~merlin_t4r_ops.ops.export_folders.saved_by_an_earlier_operator`);
* ``ensemble.pkl`` is one pickle, so the operators loaded from it share one unpickled
  :class:`SharedModel` as well, which loads the model once per device: one copy of the
  weights in memory and one module object, which every operator's CUDA graphs read.
"""

import threading
import weakref
from pathlib import Path

import torch

from merlin_t4r_ops.ops.artifacts import load_model
from merlin_t4r_ops.ops.cuda_graphs import log_load
from merlin_t4r_ops.ops.export_folders import new_folder_name

__all__ = ["SharedModel", "shared_model"]


class SharedModel:
    """The artifact folder, the lock and the loaded module of one model's operators."""

    def __init__(self, folder: str):
        self.folder = folder
        self.lock = threading.Lock()
        self._loaded = {}  # (artifact folder, device) -> the module loaded from it

    def __getstate__(self):
        return {"folder": self.folder}  # no lock (it does not pickle), no loaded model

    def __setstate__(self, state):
        self.__init__(state["folder"])

    def load(self, artifact_path, device: torch.device) -> torch.nn.Module:
        """The model saved under ``artifact_path``, loaded on ``device`` by the first caller."""
        key = (Path(artifact_path) / self.folder, device)
        with self.lock:
            if key in self._loaded:
                log_load(f"PredictT4RPyTorch: shares the model of {self.folder} already "
                         f"loaded on {device}")
            else:
                self._loaded[key] = load_model(key[0], device)
            return self._loaded[key]

    def saved(self) -> None:
        """Forget the models loaded before: a later load reads what was just saved."""
        with self.lock:
            self._loaded.clear()


# Keyed weakly by the (unwrapped) model, so that its SharedModel goes with it.
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, SharedModel]" = weakref.WeakKeyDictionary()
_SHARED_GUARD = threading.Lock()


def shared_model(model: torch.nn.Module) -> SharedModel:
    """The one :class:`SharedModel` of every operator built over ``model`` in this process."""
    with _SHARED_GUARD:
        if model not in _SHARED:
            _SHARED[model] = SharedModel(new_folder_name())
        return _SHARED[model]
