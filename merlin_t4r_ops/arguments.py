"""One check of the integer knobs users pass, so every knob accepts the same values.

``top_k``, ``max_sequence_length`` and ``cuda_graph_buckets`` are counts: NumPy's integers
(``np.int64(5)``, as a config or a DataFrame gives them) are counts too, while ``True`` is an
``int`` in Python but never a count.
"""

import numbers

__all__ = ["is_positive_int"]


def is_positive_int(value) -> bool:
    """True for 1, 2, ... of any integral type, False for bools and anything else."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral)
            and value >= 1)
