"""The shop's raw item ids behind the encoded ids of a fitted NVTabular ``Categorify``.

NVTabular 23.08's ``Categorify`` writes each column's vocabulary to
``categories/unique.<column>.parquet``: one row per distinct raw value, and the row's index
is the value's encoded id. The ids below the first row are reserved: 0 for padding, 1 for
nulls, then one out-of-vocabulary id (or ``num_buckets`` of them), so the first raw item is
encoded as 3 by default. Those reserved ids have no raw item behind them.

An :class:`ItemVocabulary` holds the raw ids in encoded-id order and travels as two checked
files: ``raw_ids.parquet`` (one Arrow column, int or UTF-8 string, no pandas metadata and
no pickle) and ``vocabulary.json`` (column name, first encoded id, count, kind).
"""

import functools
import io
import json
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import merlin.dtypes as md
from merlin.schema import Tags
from merlin_t4r_ops.errors import (
    AmbiguousFillerWarning, ArtifactError, SchemaMismatchError, T4ROpsError)
from merlin_t4r_ops.ops.lineage import categorify_of
from merlin_t4r_ops.ops.masking import FILLER_ID

__all__ = ["ItemVocabulary", "VOCABULARY_FILES"]

RAW_IDS_FILE = "raw_ids.parquet"
VOCABULARY_FILE = "vocabulary.json"
VOCABULARY_FILES = (RAW_IDS_FILE, VOCABULARY_FILE)
_RAW_ID = "raw_id"
# NVTabular's fixed reserved ids: 0 padding, 1 nulls, then the OOV ids (see _encode).
_OOV_OFFSET = 2


@dataclass(frozen=True)
class ItemVocabulary:
    """Raw item ids in encoded-id order: encoded id ``first_id + i`` is ``raw_ids[i]``.

    Attributes
    ----------
    column : str
        The workflow's item-id column.
    first_id : int
        Encoded id of the first raw item; every id below it is reserved by Categorify.
    raw_ids : numpy.ndarray
        1-D, the raw column's integer dtype, or ``object`` holding ``str`` for string ids.
    """

    column: str
    first_id: int
    raw_ids: np.ndarray

    def __post_init__(self):
        if len(self.raw_ids) and (self.raw_ids == self.filler).any():
            warnings.warn(
                f"{self.column!r} holds the raw item id {self.filler!r}, which DecodeItemIds "
                "also gives a top-k slot that no item was left for (exclude_seen): a client "
                "cannot tell the two apart; item_id_scores is -inf in an empty slot",
                AmbiguousFillerWarning, stacklevel=3)

    @property
    def is_string(self) -> bool:
        return self.raw_ids.dtype == object

    @property
    def filler(self):
        """The raw id of a top-k slot that no item was left for (``FILLER_ID``, scored
        ``-inf``): ``-1`` for signed integer ids, the dtype's largest value for unsigned ones
        (which cannot hold ``-1``), ``""`` for string ids."""
        if self.is_string:
            return ""
        if self.raw_ids.dtype.kind == "u":
            return np.iinfo(self.raw_ids.dtype).max
        return FILLER_ID

    @property
    def dtype(self) -> md.DType:
        """The raw column's dtype: an integer, or ``object`` for strings as NVTabular has it.

        Not ``merlin.dtypes.string``: Merlin's executor casts outputs to their schema's
        dtype by name, and ``str`` becomes a fixed-width numpy array that Triton refuses.
        """
        return md.dtype(self.raw_ids.dtype)

    @classmethod
    def from_workflow(cls, workflow, column: Optional[str] = None) -> "ItemVocabulary":
        """The vocabulary of ``workflow``'s item-id column (the one tagged ``Tags.ITEM_ID``).

        Raises
        ------
        SchemaMismatchError
            No (or more than one) item-id column, or the column is not made by Categorify.
        """
        column = _item_id_column(workflow, column)
        categorify, encoded = _categorify_of(workflow, column)
        first_id, raw_ids = _read_unique_values(categorify, encoded)
        return cls(column, first_id, raw_ids)

    @functools.cached_property
    def lookup(self) -> np.ndarray:
        """The raw id of encoded id ``e`` at ``lookup[e + 1]``: ``lookup[0]`` is :attr:`filler`
        (for ``FILLER_ID``, -1), the reserved ids have the filler too, then :attr:`raw_ids`.

        The one table behind :meth:`decode` (a numpy ``take``) and :meth:`device_lookup`
        (the same lookup inside the operator's CUDA graph).
        """
        head = np.full(1 + self.first_id, self.filler, dtype=self.raw_ids.dtype)
        return np.concatenate([head, self.raw_ids])

    @property
    def decodes_on_device(self) -> bool:
        """Whether torch can hold the raw ids: signed integers (not strings, not unsigned)."""
        return self.raw_ids.dtype.kind == "i"

    def device_lookup(self, device):
        """:attr:`lookup` as a torch tensor on ``device`` (signed integer ids only)."""
        import torch

        if not self.decodes_on_device:
            raise T4ROpsError(
                f"the raw ids of {self.column!r} are {self.raw_ids.dtype}, which torch cannot "
                "look up on a device; only signed integer ids decode there")
        return torch.from_numpy(self.lookup).to(device)

    def decode(self, encoded: np.ndarray, source: str = "item_ids") -> np.ndarray:
        """Raw ids for an array of encoded ids, same shape, with one ``take`` of
        :attr:`lookup`; ``FILLER_ID`` becomes :attr:`filler`. Reserved or unknown ids raise
        an error that names ``source``, the column they came from."""
        encoded = np.asarray(encoded)
        filler = encoded == FILLER_ID
        if encoded.size:
            unknown = (encoded < self.first_id) | (encoded >= self.first_id + len(self.raw_ids))
            unknown &= ~filler
            if unknown.any():
                raise T4ROpsError(
                    f"{source} holds encoded id {int(encoded[unknown][0])}, which has no raw "
                    f"item id: the vocabulary of {self.column!r} covers ids {self.first_id} to "
                    f"{self.first_id + len(self.raw_ids) - 1}, and Categorify reserves the ids "
                    f"below {self.first_id} for padding, nulls and out-of-vocabulary items"
                )
        return np.take(self.lookup, encoded.astype(np.int64, copy=False) + 1)

    # -- artifact files --------------------------------------------------------------------
    def to_files(self) -> Dict[str, bytes]:
        """The two artifact files, as bytes for ``write_checked``."""
        stream = io.BytesIO()
        pq.write_table(pa.table({_RAW_ID: pa.array(self.raw_ids)}), stream)
        meta = {"column": self.column, "first_id": self.first_id, "count": len(self.raw_ids),
                "kind": "string" if self.is_string else self.raw_ids.dtype.name}
        return {RAW_IDS_FILE: stream.getvalue(),
                VOCABULARY_FILE: json.dumps(meta, sort_keys=True).encode()}

    @classmethod
    def from_files(cls, files: Dict[str, bytes]) -> "ItemVocabulary":
        """Rebuild from the bytes that ``read_checked`` verified."""
        try:
            meta = json.loads(files[VOCABULARY_FILE])
            column = pq.read_table(pa.BufferReader(files[RAW_IDS_FILE])).column(_RAW_ID)
            raw_ids = column.to_numpy(zero_copy_only=False)
            kind = meta["kind"]
            expected = object if kind == "string" else np.dtype(kind)
            if raw_ids.dtype != expected or len(raw_ids) != meta["count"]:
                raise ValueError(f"expected {meta['count']} ids of kind {kind}, read "
                                 f"{len(raw_ids)} of dtype {raw_ids.dtype}")
            return cls(str(meta["column"]), int(meta["first_id"]), raw_ids)
        except (KeyError, ValueError, TypeError, pa.ArrowException) as exc:
            raise ArtifactError(f"the item vocabulary artifact is not valid: {exc}") from exc


def _item_id_column(workflow, column: Optional[str]) -> str:
    outputs = workflow.output_schema
    if outputs is None:  # Merlin computes a workflow's output schema in fit
        raise SchemaMismatchError(
            "DecodeItemIds needs a fitted workflow, got one that is not fitted (its "
            "output_schema is None): call workflow.fit first"
        )
    if column is not None:
        if column not in outputs.column_names:
            raise SchemaMismatchError(
                f"column={column!r} is not an output of the workflow; it outputs "
                f"{outputs.column_names}"
            )
        return column
    tagged = outputs.select_by_tag(Tags.ITEM_ID).column_names
    if len(tagged) != 1:
        raise SchemaMismatchError(
            f"the workflow must tag exactly one output column with Tags.ITEM_ID, it tags "
            f"{tagged}; pass column= to choose the item-id column"
        )
    return tagged[0]


def _categorify_of(workflow, column: str):
    """The fitted ``Categorify`` that encoded ``column``, and its name there."""
    categorify, encoded = categorify_of(workflow, column)
    if categorify.encode_type == "combo" or categorify.single_table:
        raise SchemaMismatchError(
            f"column {column!r} is Categorify-d with encode_type='combo' or "
            "single_table=True, whose ids do not map to one raw item id each"
        )
    return categorify, encoded


def unique_values(categorify, column: str):
    """Categorify's unique-values table of ``column`` as written at fit: a pandas Series of
    the raw values, indexed as stored (the row index is the encoded id; see
    :func:`_read_unique_values` for a table whose index starts inside the reserved ids).

    Raises
    ------
    SchemaMismatchError
        ``categorify`` is not fitted.
    """
    import pandas as pd

    storage = categorify.storage_name.get(column, column)
    path = categorify.categories.get(storage)
    if path is None:
        raise SchemaMismatchError(
            f"the Categorify of column {column!r} is not fitted: call workflow.fit first"
        )
    return pd.read_parquet(path, columns=[storage])[storage]


def _read_unique_values(categorify, column: str):
    """``(first encoded id, raw ids in encoded order)`` from Categorify's unique-values file."""
    values = unique_values(categorify, column)
    buckets = categorify.num_buckets
    if isinstance(buckets, dict):
        buckets = buckets.get(values.name)  # the storage name
    first_id = _OOV_OFFSET + (buckets or 1)
    labels = values.index.to_numpy()
    # NVTabular's own _encode shifts a table whose index starts inside the reserved range
    # (cudf can drop the stored RangeIndex); the same rule here keeps decode its inverse.
    if len(labels) and labels[0] < first_id:
        labels = labels + first_id
    if len(labels) and not np.array_equal(labels, np.arange(labels[0], labels[0] + len(labels))):
        raise SchemaMismatchError(
            f"the unique-values table of column {column!r} has non-contiguous ids")
    raw_ids = values.to_numpy()
    if raw_ids.dtype == object and not all(isinstance(value, str) for value in raw_ids):
        raise SchemaMismatchError(
            f"column {column!r} holds raw ids that are neither integers nor strings"
        )
    if raw_ids.dtype != object and raw_ids.dtype.kind not in "iu":
        raise SchemaMismatchError(
            f"column {column!r} holds raw ids of dtype {raw_ids.dtype}; DecodeItemIds "
            "returns integer or string ids"
        )
    return (int(labels[0]) if len(labels) else first_id), raw_ids
