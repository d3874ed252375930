"""How wide a model's sessions are, and the one rule that crops and pads them.

Training and serving must show a model its sessions the same way: ``width`` positions, the
most recent items kept, right-padded with 0. T4R's ``pad_batch`` (used by its dataloaders and
by ``Model.forward``) crops from the right and keeps the *oldest* items, so a model trained
through it learns and is scored on "predict item ``width``", never on the session's real next
item. ``fit``'s loader, the ``Trainer``'s loader and ``PredictT4RPyTorch`` all go through
:func:`crop_and_pad`, at the width :func:`resolve_sequence_length` finds.
"""

import logging
from typing import Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from merlin_t4r_ops.arguments import is_positive_int
from merlin_t4r_ops.errors import SessionLengthError, T4ROpsError

__all__ = [
    "core_schema",
    "input_block_sizes",
    "crop_and_pad",
    "crop_and_pad_rows",
    "pad_sessions",
    "unpad_rows",
    "padded_lengths",
    "pad_lists_fn",
    "session_lengths",
    "resolve_sequence_length",
]

logger = logging.getLogger(__name__)

# T4R's Config.build stores total_seq_length under each architecture's own name, some with 2
# extra positions "to account for target positions at inference mode" (GPT2: n_positions;
# BERT, ALBERT, ELECTRA, RoBERTa, Reformer: max_position_embeddings). XLNet keeps none.
_T4R_LENGTH_FIELDS = (("total_seq_length", 0), ("n_positions", 0), ("max_position_embeddings", 2))
_FROM_SCHEMA = "the schema's value_count.max"


def core_schema(schema):
    """``schema`` as a ``merlin.schema.Schema`` (``None`` stays ``None``)."""
    from merlin.schema import Schema

    if schema is None or isinstance(schema, Schema):
        return schema
    from transformers4rec.torch.utils.data_utils import to_core_schema

    return to_core_schema(schema)  # a merlin_standard_lib schema, as T4R's Trainer accepts


def _list_names(schema) -> list:
    return [column.name for column in schema if column.is_list] if schema is not None else []


def input_block_sizes(model) -> dict:
    """``{column: size}`` of the model's input block, as T4R's ``from_schema`` built it:
    ``[batch, width]`` for a list column, ``[batch]`` for a scalar one; ``{}`` if none."""
    from transformers4rec.torch.features.tabular import TabularFeatures

    for module in model.modules():
        sizes = getattr(module, "input_size", None)
        if isinstance(module, TabularFeatures) and isinstance(sizes, dict):
            return sizes
    return {}


def _input_block_length(model, schema) -> Optional[int]:
    """The width ``TabularSequenceFeatures.from_schema(max_sequence_length=...)`` was built for.

    T4R keeps it only in the block's ``input_size``: ``[batch, width]`` per list column.
    """
    sizes = input_block_sizes(model)
    widths = [sizes[n][1] for n in _list_names(schema) if n in sizes and len(sizes[n]) > 1]
    widths = [int(w) for w in widths if w and w > 0]
    return max(widths) if widths else None


def _transformer_length(model) -> Optional[int]:
    """``total_seq_length`` of the T4R transformer config, where ``build`` kept it."""
    from transformers4rec.config.transformer import T4RecConfig

    for module in model.modules():
        config = getattr(module, "config", None)
        if not isinstance(config, T4RecConfig):
            continue  # a plain Hugging Face config's position limit is not a training width
        for field, extra in _T4R_LENGTH_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, int) and value - extra > 0:
                return value - extra
    return None


def _schema_length(schema) -> Optional[int]:
    widths = [column.shape.dims[1].max for column in schema or []
              if column.is_list and column.shape.dims and len(column.shape.dims) > 1]
    widths = [int(w) for w in widths if w]
    return max(widths) if widths else None


def resolve_sequence_length(
    model, schema=None, *, requested=None, required_for: Optional[str] = None
) -> Optional[int]:
    """The width sessions are cropped and padded to, for training and serving alike.

    Looked up in this order: ``requested``, ``model.max_sequence_length``, the input block's
    ``max_sequence_length``, the T4R transformer config's ``total_seq_length``, the schema's
    largest ``value_count.max`` of a list column.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Unwrapped (not inside DataParallel/DDP).
    schema : merlin.schema.Schema or merlin_standard_lib Schema, optional
        Default ``model.input_schema``.
    requested : int, optional
        An explicit width (the operator's ``max_sequence_length=``, the ``Trainer``'s
        ``args.max_sequence_length``); it wins, with a warning if the model says otherwise.
    required_for : str, optional
        Why a width is needed; with it, finding none raises instead of returning None.

    Returns
    -------
    int or None

    Raises
    ------
    T4ROpsError
        ``requested`` is not a positive int, or ``required_for`` is given and no width is
        known; the message names every place looked at.
    """
    if requested is not None and not is_positive_int(requested):
        raise T4ROpsError(f"max_sequence_length must be a positive int, got {requested!r}")
    schema = core_schema(model.input_schema if schema is None else schema)
    found = {
        "model.max_sequence_length": getattr(model, "max_sequence_length", None),
        "the input block's max_sequence_length": _input_block_length(model, schema),
        "the transformer config's total_seq_length": _transformer_length(model),
        _FROM_SCHEMA: _schema_length(schema),
    }
    source, width = next(((s, int(w)) for s, w in found.items() if w), (None, None))
    if requested is not None:
        if source not in (None, _FROM_SCHEMA) and width != requested:
            logger.warning("max_sequence_length=%d overrides %s=%d", requested, source, width)
        return int(requested)
    if width is None and required_for:
        raise T4ROpsError(
            f"the sequence length is unknown, and {required_for}: looked at "
            f"{', '.join(found)}, and none is set; pass max_sequence_length="
        )
    return width


def _on_host(array) -> np.ndarray:
    """A numpy view of lengths or ids, wherever they live (the index math runs on the host)."""
    return array.cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)


def _gather_index(ends: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """``[rows, width]`` positions in the values: each row's last ``min(length, width)``
    values (the row's values end before ``ends``), then -1 for the padding."""
    kept = np.minimum(lengths, width)
    positions = np.arange(width)
    index = (ends - kept)[:, None] + positions[None, :]
    index[positions[None, :] >= kept[:, None]] = -1
    return index


def _ragged_index(lengths: np.ndarray, width: int) -> np.ndarray:
    """:func:`_gather_index` for rows stored one after another (Merlin's ``__values``)."""
    return _gather_index(np.cumsum(lengths), lengths, width)


def _take_padded(values, index: np.ndarray):
    """``values[index]`` where index -1 reads a zero: one gather, no boolean masks.

    Host values go through numpy: torch's CPU indexing runs on its intra-op threads, which
    cost a loader 0.2-4 ms a column (by the machine's load) for a few thousand values.
    """
    as_array = _host_array(values)
    if as_array is None:  # on a GPU (serving), or a dtype numpy lacks (bfloat16)
        zero = values.new_zeros((1,) + tuple(values.shape[1:]))
        return torch.cat([values, zero])[torch.from_numpy(index).to(values.device)]
    zero = np.zeros((1,) + as_array.shape[1:], dtype=as_array.dtype)
    padded = np.concatenate([as_array, zero])[index]  # -1 reads the zero appended last
    return torch.from_numpy(padded) if isinstance(values, torch.Tensor) else padded


def _host_array(values) -> Optional[np.ndarray]:
    if not isinstance(values, torch.Tensor):
        return np.asarray(values)
    if values.device.type != "cpu" or values.requires_grad or values.dtype == torch.bfloat16:
        return None
    return values.numpy()


def crop_and_pad(values, lengths, width: int):
    """``[rows, width, ...]``: each row's last ``min(length, width)`` values, then zeros.

    Parameters
    ----------
    values : torch.Tensor or numpy.ndarray
        The rows' values one after another (Merlin's ``__values``): first dimension
        ``sum(lengths)``, any trailing dimensions (pretrained embeddings) kept.
    lengths : torch.Tensor or numpy.ndarray
        Values per row.
    width : int

    Returns
    -------
    torch.Tensor or numpy.ndarray
        Of the same kind, dtype and device as ``values``.
    """
    lengths = _on_host(lengths).astype(np.int64, copy=False)
    return _take_padded(values, _ragged_index(lengths, width))


def unpad_rows(matrix, lengths):
    """The first ``lengths[r]`` values of each row ``r`` of ``matrix``, one row after another
    (Merlin's ``__values`` for right-padded ``[rows, n]`` lists); same kind and device."""
    lengths = _on_host(lengths)
    held = np.arange(matrix.shape[1])[None, :] < lengths[:, None]
    if isinstance(matrix, torch.Tensor):
        held = torch.from_numpy(held).to(matrix.device)
    return matrix[held]


def crop_and_pad_rows(matrix, lengths, width: int):
    """:func:`crop_and_pad` for right-padded ``[rows, n]`` lists whose rows hold ``lengths``."""
    lengths = _on_host(lengths).astype(np.int64, copy=False)
    rows, n = matrix.shape[0], matrix.shape[1]
    ends = np.arange(rows, dtype=np.int64) * n + lengths  # in the matrix's rows end to end
    flat = matrix.reshape((rows * n,) + tuple(matrix.shape[2:]))
    return _take_padded(flat, _gather_index(ends, lengths, width))


def padded_lengths(ids) -> np.ndarray:
    """Per-row length of a right-padded ``[rows, n]`` id matrix: one past its last non-zero id.

    Id 0 is T4R's padding id, so trailing zeros are padding.
    """
    nonzero = _on_host(ids) != 0
    last = nonzero.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)


def session_lengths(lists: Mapping, id_columns: Iterable[str]) -> Optional[np.ndarray]:
    """The one length per session that every list column agrees on, or None if none tells.

    Training's loaders and the operator both ask this function, so a batch is trained on
    exactly when a request of the same sessions is served. Ragged columns tell a session's
    length by their offsets, right-padded id columns (``id_columns``: T4R's
    ``Tags.CATEGORICAL``, whose id 0 is padding) by where their padding starts. Any other
    right-padded column (numbers, where 0 is a value) can only be too narrow for it.

    Parameters
    ----------
    lists : mapping of str to array or tensor
        Per list column, in order: 1-D, each session's length (a ragged column's offsets'
        differences); or 2-D, the right-padded ``[rows, n]`` column itself.
    id_columns : iterable of str
        The names, among ``lists``, of categorical columns.

    Returns
    -------
    numpy.ndarray of int64 or None

    Raises
    ------
    SessionLengthError
        Naming the first row whose list columns disagree, and each column's length there.
    """
    id_columns = set(id_columns)
    known, widths = {}, {}
    for name, value in lists.items():
        if value.ndim == 1:
            known[name] = _on_host(value)
        elif name in id_columns:
            known[name] = padded_lengths(value)
        else:
            widths[name] = value.shape[1]
    if not known:
        return None
    session = next(iter(known.values())).astype(np.int64)
    bad = np.zeros(len(session), dtype=bool)
    for lengths in known.values():
        bad |= lengths != session
    for width in widths.values():
        bad |= session > width
    if bad.any():
        row = int(np.argmax(bad))
        found = {name: int(lengths[row]) for name, lengths in known.items()}
        found.update({name: f"at most {width}" for name, width in widths.items()})
        found = {name: found[name] for name in lists}  # in the columns' order
        raise SessionLengthError(
            f"row {row}: the list inputs disagree on the session's length: {found}; every list "
            "column holds one value per event of the session"
        )
    return session


def pad_sessions(lists: Mapping, width: int, id_columns: Iterable[str]) -> dict:
    """Every list column as ``[rows, width]``: the one crop-and-pad rule of training and serving.

    Parameters
    ----------
    lists : mapping of str to (values, lengths)
        Per list column: a ragged column's ``__values`` and its lengths per session, or a
        right-padded ``[rows, n]`` column and ``None``.
    width : int
    id_columns : iterable of str
        The categorical columns among ``lists`` (see :func:`session_lengths`).

    Returns
    -------
    dict
        Column name to :func:`crop_and_pad` of its sessions, at the lengths that
        :func:`session_lengths` finds (a right-padded column's full width where none does).

    Raises
    ------
    SessionLengthError
        When the columns disagree on a session's length.
    """
    session = session_lengths(
        {name: values if lengths is None else lengths for name, (values, lengths) in lists.items()},
        id_columns)
    padded, ragged_index = {}, None
    for name, (values, lengths) in lists.items():
        if lengths is not None:  # ragged: session holds these lengths, already on the host
            if ragged_index is None:  # the same for every ragged column: made once
                ragged_index = _ragged_index(session, width)
            padded[name] = _take_padded(values, ragged_index)
        else:
            rows = session if session is not None else np.full(len(values), values.shape[1])
            padded[name] = crop_and_pad_rows(values, rows, width)
    return padded


def _pad_lists(batch: Mapping, width: int, list_columns, id_columns) -> dict:
    lists = {}
    for key, value in batch.items():
        if key.endswith("__values"):
            offsets = batch[key[: -len("__values")] + "__offsets"].reshape(-1)
            lists[key[: -len("__values")]] = (value, offsets[1:] - offsets[:-1])
        elif key in list_columns:
            lists[key] = (value, None)
    padded = pad_sessions(lists, width, id_columns)
    out = {}
    for key, value in batch.items():
        if key.endswith("__offsets"):
            continue
        name = key[: -len("__values")] if key.endswith("__values") else key
        out[name] = padded.get(name, value)
    return out


def pad_lists_fn(width: int, list_columns: Iterable[str] = (),
                 id_columns: Iterable[str] = ()) -> Callable:
    """A Merlin loader's ``(x, y) -> (x, y)`` map giving every list column ``[rows, width]``.

    Ragged columns (``name__values``/``name__offsets``) and the fixed-width ones among
    ``list_columns`` go through :func:`crop_and_pad`, at the lengths :func:`session_lengths`
    finds (``id_columns``: the categorical ones): dense tensors are what DataParallel can split
    along the batch dimension, where it would split values and offsets independently.
    """
    list_columns, id_columns = tuple(list_columns), tuple(id_columns)

    def pad(x, y=None):
        x = _pad_lists(x, width, list_columns, id_columns)
        if isinstance(y, dict):
            y = _pad_lists(y, width, list_columns, id_columns)
        return x, y

    return pad
