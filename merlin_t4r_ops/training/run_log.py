"""What ``fit`` logs, as Hugging Face's Trainer logs it: a CSV file and TensorBoard.

Per optimizer step ``train/loss`` and ``train/learning_rate``, per epoch
``eval/<metric>``: the names of Hugging Face's TensorBoard callback. Only the
main process (global rank 0) writes. TensorBoard is optional, as with
``report_to``: without the ``tensorboard`` package only the CSV is written.

A run that starts at optimizer step ``S`` (a resumed checkpoint's step, else 0)
keeps the rows of steps up to ``S`` and drops the later ones, which the run
being resumed wrote after its checkpoint and this run writes again; TensorBoard
purges them (``purge_step``) the same way.
"""

import csv
import os
from typing import Dict, Optional

from merlin_t4r_ops.training.state import DistributedState

__all__ = ["RunLog", "CSV_NAME"]

CSV_NAME = "log.csv"


def _summary_writer(folder: str, purge_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # no tensorboard package: the CSV alone, as report_to would
        return None
    return SummaryWriter(os.path.join(folder, "runs"), purge_step=purge_step)


def _keep_rows_up_to(path: str, step: int) -> None:
    """Rewrite the CSV at ``path`` without its rows past ``step`` (atomically)."""
    with open(path, newline="") as stream:
        rows = list(csv.reader(stream))
    kept = rows[:1] + [row for row in rows[1:] if row and int(row[0]) <= step]
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as stream:
        csv.writer(stream).writerows(kept)
    os.replace(tmp, path)


class RunLog:
    """Rows ``step, epoch, name, value`` in ``folder/log.csv``, from :meth:`start` on.

    Parameters
    ----------
    folder : str, optional
        Where to write; ``None`` logs nothing.
    state : DistributedState
        Ranks other than the main process log nothing.
    """

    def __init__(self, folder: Optional[str], state: DistributedState):
        self._file = self._rows = self._board = None
        self._folder = os.fspath(folder) if folder is not None and state.is_main_process else None
        # None where nothing is written (as a checkpoint's log_step: nothing to drop).
        self.last_step = None if self._folder is None else 0
        # Same on every rank (all ranks take part in reducing what the main one writes).
        self.active = folder is not None

    def start(self, step: Optional[int] = 0) -> None:
        """Open the log for a run that starts at optimizer ``step``; later rows are dropped.

        ``step=None`` (a checkpoint that does not say) keeps every row.
        """
        if self._folder is None:
            return
        os.makedirs(self._folder, exist_ok=True)
        path = os.path.join(self._folder, CSV_NAME)
        is_new = not os.path.exists(path)
        if not is_new and step is not None:
            _keep_rows_up_to(path, step)
        self._file = open(path, "a", newline="")
        self._rows = csv.writer(self._file)
        if is_new:
            self._rows.writerow(["step", "epoch", "name", "value"])
        self.last_step = step or 0
        self._board = _summary_writer(self._folder, None if step is None else step + 1)

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
