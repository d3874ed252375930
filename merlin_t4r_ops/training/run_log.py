"""What ``fit`` logs, as Hugging Face's Trainer logs it: a CSV file and TensorBoard.

Per optimizer step ``train/loss`` and ``train/learning_rate``, per epoch
``eval/<metric>``: the names of Hugging Face's TensorBoard callback. Only the
main process (global rank 0) writes. TensorBoard is optional, as with
``report_to``: without the ``tensorboard`` package only the CSV is written.
"""

import csv
import os
from typing import Dict, Optional

from merlin_t4r_ops.training.state import DistributedState

__all__ = ["RunLog", "CSV_NAME"]

CSV_NAME = "log.csv"


def _summary_writer(folder: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # no tensorboard package: the CSV alone, as report_to would
        return None
    return SummaryWriter(os.path.join(folder, "runs"))


class RunLog:
    """Rows ``step, epoch, name, value`` in ``folder/log.csv`` (appended when resuming).

    Parameters
    ----------
    folder : str, optional
        Where to write; ``None`` logs nothing.
    state : DistributedState
        Ranks other than the main process log nothing.
    """

    def __init__(self, folder: Optional[str], state: DistributedState):
        self._file = self._rows = self._board = None
        self.last_step = 0
        # Same on every rank (all ranks take part in reducing what the main one writes).
        self.active = folder is not None
        if folder is None or not state.is_main_process:
            return
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, CSV_NAME)
        is_new = not os.path.exists(path)
        self._file = open(path, "a", newline="")
        self._rows = csv.writer(self._file)
        if is_new:
            self._rows.writerow(["step", "epoch", "name", "value"])
        self._board = _summary_writer(folder)

    def write(self, step: int, epoch: float, values: Dict[str, float]) -> None:
        """Log ``values`` at global optimizer ``step`` (``epoch``: fractional, as HF's)."""
        if self._rows is None:
            return
        self.last_step = step
        for name, value in values.items():
            self._rows.writerow([step, round(epoch, 4), name, value])
            if self._board is not None:
                self._board.add_scalar(name, value, step)
        self._file.flush()

    def close(self) -> None:
        """Close the CSV file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()
        self._file = self._rows = self._board = None
