"""Turn the columns of a request into the padded tensors a T4R model takes, or say why not.

Sessions arrive as ragged lists (values and offsets) or as fixed-length lists. The model
wants ``[batch, sequence_length]`` tensors, right-padded with 0. A session longer than the
model's sequence length keeps its most recent items: T4R's own ``pad_inputs`` crops from the
right and keeps the oldest ones, which is right for nothing at serving time.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from merlin.schema import Schema, Tags
from merlin_t4r_ops.errors import InvalidRequestError

__all__ = ["InputSpec", "input_specs", "to_model_inputs"]


@dataclass(frozen=True)
class InputSpec:
    """What the model expects of one input column."""

    name: str
    is_list: bool
    is_categorical: bool
    cardinality: Optional[int]  # ids must lie in [0, cardinality)


def input_specs(schema: Schema) -> List[InputSpec]:
    """One :class:`InputSpec` per column of a T4R model's input schema."""
    specs = []
    for column in schema:
        categorical = Tags.CATEGORICAL in column.tags or np.issubdtype(
            column.dtype.to_numpy, np.integer
        )
        domain = column.int_domain
        # T4R sizes each embedding table int_domain.max + 1 rows.
        cardinality = int(domain.max) + 1 if categorical and domain and domain.max else None
        specs.append(InputSpec(column.name, bool(column.is_list), bool(categorical), cardinality))
    return specs


def _lengths_from_offsets(name: str, offsets: np.ndarray, n_values: int) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.size == 0:
        raise InvalidRequestError(
            f"input {name!r}: offsets must be a 1-D array of rows + 1 entries, "
            f"got shape {offsets.shape}"
        )
    if not np.issubdtype(offsets.dtype, np.integer):
        raise InvalidRequestError(
            f"input {name!r}: offsets must be integers, got dtype {offsets.dtype}"
        )
    if offsets[0] != 0:
        raise InvalidRequestError(f"input {name!r}: offsets must start at 0, got {offsets[0]}")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        row = int(np.argmax(lengths < 0))
        raise InvalidRequestError(
            f"input {name!r}: offsets must not decrease, but offsets[{row + 1}]="
            f"{offsets[row + 1]} < offsets[{row}]={offsets[row]}"
        )
    if offsets[-1] != n_values:
        raise InvalidRequestError(
            f"input {name!r}: the last offset must equal the number of values "
            f"({n_values}), got {offsets[-1]}"
        )
    return lengths.astype(np.int64)


def _padded_lengths(values: np.ndarray) -> np.ndarray:
    """Per-row length of a right-padded id matrix: one past the last non-zero id."""
    nonzero = values != 0
    width = values.shape[1]
    last = width - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)


def _most_recent(flat: np.ndarray, ends: np.ndarray, lengths: np.ndarray, width: int):
    """``[rows, width]``: the last ``min(length, width)`` values before each end, then zeros."""
    kept = np.minimum(lengths, width)
    positions = np.arange(width)
    index = (ends - kept)[:, None] + positions[None, :]
    inside = positions[None, :] < kept[:, None]
    if flat.size == 0:
        return np.zeros((len(ends), width), dtype=flat.dtype)
    return np.where(inside, flat[np.clip(index, 0, flat.size - 1)], 0).astype(flat.dtype)


def _check_ids(spec: InputSpec, values: np.ndarray) -> None:
    if not np.issubdtype(values.dtype, np.integer):
        raise InvalidRequestError(
            f"input {spec.name!r}: expected integer ids, got dtype {values.dtype}"
        )
    if values.size == 0:
        return
    smallest, largest = values.min(), values.max()
    if smallest < 0:
        raise InvalidRequestError(
            f"input {spec.name!r}: ids must be >= 0, got {smallest}"
        )
    if spec.cardinality is not None and largest >= spec.cardinality:
        raise InvalidRequestError(
            f"input {spec.name!r}: ids must be < {spec.cardinality} (the embedding table's "
            f"size), got {largest}"
        )


def to_model_inputs(
    table, specs: List[InputSpec], sequence_length: int, device: torch.device
) -> Dict[str, torch.Tensor]:
    """Validate the request columns in ``table`` and build the model's input tensors.

    Parameters
    ----------
    table : merlin.table.TensorTable
        The request, as the graph hands it to the operator.
    specs : list of InputSpec
        The model's inputs.
    sequence_length : int
        Width of every list input after padding or cropping.
    device : torch.device
        Where the tensors go.

    Raises
    ------
    InvalidRequestError
        Naming the input and the problem: missing, empty, bad offsets, bad dtype, bad ids,
        or columns whose row counts disagree.
    """
    present = set(table.columns)
    missing = [spec.name for spec in specs if spec.name not in present]
    if missing:
        raise InvalidRequestError(
            f"input {missing[0]!r} is missing: the model needs {[s.name for s in specs]}, "
            f"the request has {sorted(present)}"
        )

    columns = {}
    for spec in specs:
        column = table[spec.name]
        values = np.asarray(column.values)
        if spec.is_list and column.offsets is not None:
            lengths = _lengths_from_offsets(spec.name, column.offsets, len(values))
            columns[spec.name] = (values, lengths)
        elif spec.is_list:
            if values.ndim != 2:
                raise InvalidRequestError(
                    f"input {spec.name!r}: expected a list column (ragged values and offsets, "
                    f"or a [rows, length] array), got shape {values.shape}"
                )
            columns[spec.name] = (values, None)
        else:
            columns[spec.name] = (values.reshape(len(values), -1)[:, 0], None)

    rows = {name: (len(lengths) if lengths is not None else len(values))
            for name, (values, lengths) in columns.items()}
    if len(set(rows.values())) > 1:
        raise InvalidRequestError(f"inputs disagree on the number of rows: {rows}")
    n_rows = next(iter(rows.values()))
    if n_rows == 0:
        raise InvalidRequestError(
            f"the request has 0 rows in {sorted(rows)}; send at least one session"
        )

    # Fixed-width lists are right-padded with id 0; their categorical columns tell how long
    # each session really is, and every list column of the session shares that length.
    fixed_lengths = None
    for spec in specs:
        values, lengths = columns[spec.name]
        if spec.is_list and spec.is_categorical and lengths is None:
            row_lengths = _padded_lengths(values)
            fixed_lengths = (row_lengths if fixed_lengths is None
                             else np.maximum(fixed_lengths, row_lengths))

    tensors = {}
    for spec in specs:
        values, lengths = columns[spec.name]
        if spec.is_categorical:
            _check_ids(spec, values)
            values = values.astype(np.int64, copy=False)
        elif not np.issubdtype(values.dtype, np.number):
            raise InvalidRequestError(
                f"input {spec.name!r}: expected numbers, got dtype {values.dtype}"
            )
        else:
            values = values.astype(np.float32, copy=False)
        if spec.is_list:
            if lengths is not None:  # ragged
                ends = np.cumsum(lengths)
                values = _most_recent(values, ends, lengths, sequence_length)
            else:  # fixed width, right-padded
                row_lengths = (
                    fixed_lengths if fixed_lengths is not None
                    else np.full(n_rows, values.shape[1], dtype=np.int64)
                )
                width = values.shape[1]
                ends = np.arange(1, n_rows + 1) * width - (width - row_lengths)
                values = _most_recent(values.reshape(-1), ends, row_lengths, sequence_length)
        tensors[spec.name] = torch.from_numpy(np.ascontiguousarray(values)).to(device)
    return tensors
