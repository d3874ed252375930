"""The GPU's utilisation, sampled in a thread while a benchmark path runs.

NVML's ``utilization.gpu`` is the share of the last sample period (1/6 s to 1 s, by GPU)
in which at least one kernel ran. It is read through ``pynvml`` when installed, else
through ``nvidia-smi``; without CUDA nothing is sampled and the mean is None.
"""

import shutil
import subprocess
import threading
import time
from typing import Callable, List, Optional, Tuple


def _nvml_reader(index: int) -> Optional[Callable[[], float]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no pynvml, or no driver behind it
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _smi_reader(index: int) -> Optional[Callable[[], float]]:
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu",
           "--format=csv,noheader,nounits"]
    return lambda: float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


class UtilisationSampler:
    """Samples GPU ``index`` every ``interval`` seconds between ``start()`` and ``stop()``.

    Parameters
    ----------
    index : int or None
        The CUDA device's index; None samples nothing.
    interval : float
        Seconds between samples.
    """

    def __init__(self, index: Optional[int], interval: float = 0.1):
        self.interval = interval
        self.samples: List[Tuple[float, float]] = []  # (perf_counter, percent)
        self._read = None if index is None else (_nvml_reader(index) or _smi_reader(index))
        self._stop = threading.Event()
        self._thread = None

    @property
    def available(self) -> bool:
        return self._read is not None

    def start(self) -> "UtilisationSampler":
        self.samples, self._stop = [], threading.Event()
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-utilisation", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def mean(self, start: Optional[float], end: Optional[float]) -> Optional[float]:
        """Mean percent over the samples taken between ``start`` and ``end`` (perf_counter)."""
        if start is None or end is None:
            return None
        window = [p for t, p in self.samples if start <= t <= end]
        return sum(window) / len(window) if window else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self._read()))
            except Exception:  # a transient NVML/nvidia-smi failure loses one sample
                pass
            self._stop.wait(self.interval)
