"""Hugging Face's ``logging_nan_inf_filter``, computed on the device instead of read on the host.

Hugging Face 4.30's training loop asks ``torch.isnan(loss) or torch.isinf(loss)`` after
every step's backward. That ``or`` reads the loss on the host: the CPU waits for the GPU
to finish the backward, so the next batch's loading never overlaps it. With the filter on
(its default), a NaN or Inf loss adds, instead of itself, the mean of the losses summed
since the last log::

    tr_loss += tr_loss / (1 + global_step - globalstep_last_logged)

:class:`LoggedLossFilter` gives the Trainer's loop that same value as the step's loss,
chosen with ``torch.where`` on the device. It keeps a copy of the loop's running sum
(``tr_loss``, a local of Hugging Face's loop), made of the same additions in the same
order, and zeroed where Hugging Face zeroes its own: at each log.
"""

from typing import Optional

import torch

__all__ = ["LoggedLossFilter"]


class LoggedLossFilter:
    """The loss each step adds to Hugging Face's logged sum, NaN and Inf replaced on the device."""

    def __init__(self):
        self._logged_sum: Optional[torch.Tensor] = None  # tr_loss since the last log

    def reset(self) -> None:
        """Hugging Face logged and zeroed its sum (``tr_loss -= tr_loss``)."""
        self._logged_sum = None

    def __call__(self, loss: torch.Tensor, steps_since_log: int) -> torch.Tensor:
        """What Hugging Face's filter adds for ``loss``: itself if finite, else the sum's mean.

        ``steps_since_log`` is ``global_step - _globalstep_last_logged`` at this step.
        """
        if self._logged_sum is None:
            # Hugging Face's tr_loss: float32 on the loss's device, whatever the loss's dtype.
            self._logged_sum = torch.zeros((), dtype=torch.float32, device=loss.device)
        replacement = self._logged_sum / (1 + steps_since_log)
        added = torch.where(torch.isfinite(loss), loss, replacement)
        self._logged_sum += added
        return added
