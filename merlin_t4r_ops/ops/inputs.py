"""Turn the columns of a request into the padded tensors a T4R model takes, or say why not.

Sessions arrive as ragged lists (values and offsets) or as fixed-length lists, right-padded
with 0. The model wants ``[batch, sequence_length]`` tensors: :mod:`merlin_t4r_ops.sequence`
crops and pads them exactly as training does (most recent items kept). Every list column of a
session holds one value per event, so columns that disagree on a session's length are refused.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from merlin.schema import Schema, Tags
from merlin_t4r_ops.errors import InvalidRequestError
from merlin_t4r_ops.sequence import pad_sessions

__all__ = ["InputSpec", "input_specs", "to_model_inputs"]


@dataclass(frozen=True)
class InputSpec:
    """What the model expects of one input column."""

    name: str
    is_list: bool
    is_categorical: bool
    cardinality: Optional[int]  # ids must lie in [0, cardinality)


def input_specs(schema: Schema, embedding_rows: Optional[Dict[str, int]] = None
                ) -> List[InputSpec]:
    """One :class:`InputSpec` per column of a T4R model's input schema.

    An id must lie inside its embedding table: ``embedding_rows`` (the model's own tables,
    :func:`~merlin_t4r_ops.ops.model_block.embedding_rows`) says how many rows each has;
    without it, the schema's ``domain`` does (T4R sizes a table ``max + 1`` rows).
    """
    specs = []
    for column in schema:
        # As T4R's from_schema: ids are the CATEGORICAL columns; an integer CONTINUOUS one
        # (a quantity) is numbers, where 0 and negatives are values.
        categorical = Tags.CATEGORICAL in column.tags
        domain = column.int_domain
        cardinality = int(domain.max) + 1 if categorical and domain and domain.max else None
        if categorical and embedding_rows and column.name in embedding_rows:
            cardinality = embedding_rows[column.name]
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


def _check_ids(spec: InputSpec, values: np.ndarray, lengths: Optional[np.ndarray]) -> None:
    if not np.issubdtype(values.dtype, np.integer):
        raise InvalidRequestError(
            f"input {spec.name!r}: expected integer ids, got dtype {values.dtype}"
        )
    if values.size == 0:
        return
    smallest, largest = values.min(), values.max()
    if smallest < 0:
        raise InvalidRequestError(
            f"input {spec.name!r}: ids must be >= 0, got {smallest} "
            f"in row {_row_of(values, lengths, smallest)}"
        )
    if spec.cardinality is not None and largest >= spec.cardinality:
        raise InvalidRequestError(
            f"input {spec.name!r}: ids must be < {spec.cardinality} (the embedding table's "
            f"size), got {largest} in row {_row_of(values, lengths, largest)}"
        )


def _row_of(values: np.ndarray, lengths: Optional[np.ndarray], value) -> int:
    """The row of the first ``value`` in ``values``: ragged (with ``lengths``) or one per row."""
    position = int(np.argmax(values.reshape(-1) == value))
    if lengths is None:  # [rows] scalars or [rows, width] fixed lists
        return position // max(1, values.size // max(1, len(values)))
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


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
        columns whose row counts disagree, or list columns that disagree on a session's
        length (naming the row).
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
        column = table[spec.name].cpu()  # a GPU workflow hands over cupy or CUDA columns
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

    for spec in specs:
        values, lengths = columns[spec.name]
        columns[spec.name] = (_checked_values(spec, values, lengths), lengths)
    # The rule training's loaders follow: ragged lengths, or right-padded columns.
    padded = pad_sessions({spec.name: columns[spec.name] for spec in specs if spec.is_list},
                          sequence_length, [spec.name for spec in specs if spec.is_categorical])
    tensors = {}
    for spec in specs:
        values = padded.get(spec.name, columns[spec.name][0])
        tensors[spec.name] = torch.from_numpy(np.ascontiguousarray(values)).to(device)
    return tensors


def _checked_values(spec: InputSpec, values: np.ndarray,
                    lengths: Optional[np.ndarray]) -> np.ndarray:
    """``values`` as the model's dtype: int64 ids in range, or float32 numbers."""
    if spec.is_categorical:
        _check_ids(spec, values, lengths)
        return values.astype(np.int64, copy=False)
    if not np.issubdtype(values.dtype, np.number):
        raise InvalidRequestError(
            f"input {spec.name!r}: expected numbers, got dtype {values.dtype}"
        )
    return values.astype(np.float32, copy=False)
