"""Keep reserved and already-seen item ids out of a next-item top-k.

The model scores every id of its item embedding table, including ids that stand for no
item: the padding id, and, when NVTabular's ``Categorify`` encoded the column, its null
and out-of-vocabulary ids. Those ids, and on request the items that the session already
holds, are set to minus infinity on the scores before ``torch.topk``, on the model's
device. :func:`mask_scores` takes scores and returns masked scores and nothing else, so a
captured (CUDA-graph) path can call it as it is.

The seen items reach the scores in one of two forms. Eagerly, every ``(row, id)`` pair of
the request (:func:`seen_items`). In a CUDA graph, whose inputs have fixed shapes, a
``[rows, width]`` matrix of each session's most recent ids, and the pairs of the older
items that did not fit, masked after the replay (:func:`seen_matrix`).
"""

from typing import Optional, Tuple

import numpy as np
import torch

from merlin.schema import ColumnSchema
from merlin_t4r_ops.sequence import padded_lengths, unpad_rows

__all__ = ["FILLER_ID", "mask_scores", "reserved_item_ids", "seen_items", "seen_matrix",
           "top_k_unmasked"]

# Where a row has fewer than k ids left after masking, the rest of its top-k holds this id
# (no item has it) with score -inf.
FILLER_ID = -1


def reserved_item_ids(column: ColumnSchema, padding_id: int) -> Tuple[int, ...]:
    """The item ids that stand for no item, read from the item-id column's schema.

    A column that NVTabular's ``Categorify`` made carries its properties (``cat_path``,
    ``num_buckets``...). Categorify reserves the padding id, the null id and the
    out-of-vocabulary ids (one, or ``num_buckets`` of them); NVTabular's own constants
    say where each starts. Any other column reserves only the model's padding id.

    Parameters
    ----------
    column : merlin.schema.ColumnSchema
        The item-id column the model reads.
    padding_id : int
        The id the model pads sessions with (T4R's ``padding_idx``).
    """
    properties = column.properties or {}
    if "cat_path" not in properties:
        return (int(padding_id),)
    # Categorify's own encoding convention (NVTabular 23.08: 0 pad, 1 null, 2.. OOV).
    from nvtabular.ops.categorify import NULL_OFFSET, OOV_OFFSET, PAD_OFFSET

    oov_ids = int(properties.get("num_buckets") or 1)
    return tuple(sorted({int(padding_id), PAD_OFFSET, NULL_OFFSET,
                         *range(OOV_OFFSET, OOV_OFFSET + oov_ids)}))


def _session_ids(table, column: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, lengths, rows)``: the sessions' item ids one after another, ids per session,
    and the session (row) of each id.

    A fixed-width column's rows end where their right padding (T4R's padding id 0)
    begins, as :func:`~merlin_t4r_ops.sequence.padded_lengths` says.
    """
    host = table[column].cpu()  # a GPU workflow hands over cupy or CUDA columns
    values, offsets = np.asarray(host.values), host.offsets
    if offsets is not None:
        lengths = np.diff(np.asarray(offsets))
    else:
        values = values.reshape(len(values), -1)
        lengths = padded_lengths(values)
        values = unpad_rows(values, lengths)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    return values.reshape(-1).astype(np.int64, copy=False), lengths, rows


def seen_items(table, column: str, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ids)``: every item id of each session in ``table``, as the request sent it.

    Nothing is cropped: the older items that padding to the model's width drops are
    included. Call it after :func:`merlin_t4r_ops.ops.inputs.to_model_inputs`, which has
    checked the offsets and that every id lies inside the embedding table.
    """
    ids, _, rows = _session_ids(table, column)
    return (torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device))


def seen_matrix(table, column: str, width: int, filler: int
                ) -> Tuple[np.ndarray, Optional[Tuple[np.ndarray, np.ndarray]]]:
    """``(recent, older)``: the seen items of :func:`seen_items`, shaped for a CUDA graph.

    ``recent`` is ``[rows, width]`` int64: each session's most recent ``width`` ids, then
    ``filler``, a reserved id, so that masking it changes nothing. ``older`` is
    ``(rows, ids)`` of the items that did not fit, or ``None`` when every session did.
    The work is per id sent, not per cell of ``recent``, so a wide matrix costs little.
    """
    ids, lengths, row_of = _session_ids(table, column)
    position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # A session longer than width keeps its last width ids; a shorter one sits at the left.
    slot = position - np.maximum(lengths - width, 0)[row_of]
    fits = slot >= 0
    recent = np.full((len(lengths), width), filler, dtype=np.int64)
    recent[row_of[fits], slot[fits]] = ids[fits]
    if fits.all():
        return recent, None
    return recent, (row_of[~fits], ids[~fits])


def mask_scores(
    scores: torch.Tensor,
    reserved: torch.Tensor,
    seen: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    seen_recent: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``scores`` with the reserved ids, and each row's seen ids, set to ``-inf``.

    Parameters
    ----------
    scores : torch.Tensor
        ``[batch, catalogue]`` float scores; changed in place and returned.
    reserved : torch.Tensor
        1-D int64 ids masked in every row, on the scores' device.
    seen : (torch.Tensor, torch.Tensor), optional
        ``(rows, ids)`` pairs masked one by one (see :func:`seen_items`).
    seen_recent : torch.Tensor, optional
        ``[batch, width]`` ids masked in their row (``recent`` of :func:`seen_matrix`).
    """
    scores.index_fill_(1, reserved, float("-inf"))
    if seen_recent is not None:
        scores.scatter_(1, seen_recent, float("-inf"))
    if seen is not None:
        scores.index_put_(seen, scores.new_tensor(float("-inf")))
    return scores


def top_k_unmasked(masked: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ids, scores)`` of each row's ``k`` best ids; ids scored ``-inf`` become FILLER_ID.

    A masked id scores ``-inf``, so it can only enter a top-k when the row has fewer than
    ``k`` ids left; it is then replaced by :data:`FILLER_ID` and never returned.
    """
    scores, ids = torch.topk(masked, k=k, dim=-1)
    return ids.masked_fill(torch.isneginf(scores), FILLER_ID), scores
