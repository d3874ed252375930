"""Find what Merlin holds a few frames up: it hands an operator neither its node nor the graph.

:func:`search_callers` serves :func:`~merlin_t4r_ops.ops.collisions.calling_node` (the
``Node`` calling into an operator) and :mod:`~merlin_t4r_ops.ops.export_folders` (the
``Ensemble`` being exported).
"""

import inspect
from typing import Any, Callable, Mapping

__all__ = ["search_callers"]


def search_callers(look: Callable[[Mapping[str, Any]], Any], frames: int) -> Any:
    """The first answer that is not ``None`` of ``look(locals)`` over the ``frames`` frames
    above the function that calls this one, nearest first; ``None`` if none answers."""
    frame = inspect.currentframe().f_back  # the function asking
    try:
        for _ in range(frames):
            frame = frame.f_back
            if frame is None:
                return None
            found = look(frame.f_locals)
            if found is not None:
                return found
        return None
    finally:
        del frame  # frames hold references to their locals
