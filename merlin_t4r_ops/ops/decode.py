"""``DecodeItemIds``: turn the encoded ``item_ids`` of a top-k into the shop's own item ids."""

from pathlib import Path
from typing import Optional

import numpy as np

from merlin.dag import BaseOperator, ColumnSelector
from merlin.schema import Schema
from merlin.table import TensorTable
from merlin_t4r_ops.errors import SchemaMismatchError, T4ROpsError
from merlin_t4r_ops.ops.artifacts import read_checked, write_checked
from merlin_t4r_ops.ops.export_folders import (
    VOCABULARY_PREFIX,
    new_folder_name,
    replacing_earlier_exports,
)
from merlin_t4r_ops.ops.predict_t4r import TOP_K_IDS
from merlin_t4r_ops.ops.vocabulary import VOCABULARY_FILES, ItemVocabulary

__all__ = ["DecodeItemIds"]


class DecodeItemIds(BaseOperator):
    """Map ``item_ids`` to the raw ids of the workflow's item-id column; pass the rest on.

    The raw ids come from the fitted Categorify vocabulary of the column that the
    workflow tags ``Tags.ITEM_ID``, found through the workflow's graph (Categorify on the
    event rows, then Groupby, ListSlice, Rename, tags, as in T4R's tutorial ETL; see
    :mod:`merlin_t4r_ops.ops.lineage`). The decoded ``item_ids`` have the raw column's dtype:
    integers stay integers, strings travel to Triton clients as BYTES. A slot that no item
    was left for (``exclude_seen`` took them all; id ``-1``, scored ``-inf``) stays ``-1``;
    it becomes ``""`` for string ids, and the dtype's largest value for unsigned ones. An id
    that Categorify reserves, or one beyond the vocabulary, is an error. ``item_id_scores``
    and every other column pass through unchanged.

    Parameters
    ----------
    workflow : nvtabular.Workflow
        The fitted workflow whose Categorify encoded the item ids the model scores.
    column : str, optional
        The item-id output column of ``workflow``; default the one tagged ``Tags.ITEM_ID``.
    ids_column : str, default ``"item_ids"``
        The column of encoded ids to decode, e.g. ``"cart_item_ids"`` after a
        ``PredictT4RPyTorch(..., output_prefix="cart_")``.

    Raises
    ------
    SchemaMismatchError
        If the workflow is not fitted, or has no item-id column made by Categorify (the
        message names it and any operator on the way that may change the ids).

    Examples
    --------
    >>> pipeline = (workflow.input_schema.column_names
    ...             >> TransformWorkflow(workflow)
    ...             >> PredictT4RPyTorch(model, top_k=20, exclude_seen=True)
    ...             >> DecodeItemIds(workflow))
    """

    def __init__(self, workflow, *, column: Optional[str] = None, ids_column: str = TOP_K_IDS):
        super().__init__()
        self.vocabulary = ItemVocabulary.from_workflow(workflow, column)
        self.column = self.vocabulary.column
        self.ids_column = ids_column
        self.raw_dtype = self.vocabulary.dtype
        self._artifact_dir = new_folder_name(VOCABULARY_PREFIX)

    # -- graph contract ------------------------------------------------------------------
    def compute_input_schema(
        self,
        root_schema: Schema,
        parents_schema: Schema,
        deps_schema: Schema,
        selector: ColumnSelector,
    ) -> Schema:
        """Everything the parent produces; it must include integer ``ids_column``."""
        available = parents_schema + deps_schema
        if self.ids_column not in available.column_names:
            raise SchemaMismatchError(
                f"DecodeItemIds needs column {self.ids_column!r} (the top-k of "
                f"PredictT4RPyTorch with top_k=); the parent produces {available.column_names}"
            )
        if not available[self.ids_column].dtype.is_integer:
            raise SchemaMismatchError(
                f"DecodeItemIds needs encoded integer ids in {self.ids_column!r}, the parent "
                f"produces dtype {available[self.ids_column].dtype.name}"
            )
        return available

    def compute_output_schema(
        self, input_schema: Schema, col_selector: ColumnSelector, prev_output_schema=None
    ) -> Schema:
        """The input columns, with ``ids_column`` in the raw item-id column's dtype."""
        return Schema([
            column.with_dtype(self.raw_dtype.with_shape(column.shape))
            if column.name == self.ids_column else column
            for column in input_schema
        ])

    # -- artifacts: the vocabulary never goes into ensemble.pkl ----------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        state["vocabulary"] = None
        return state

    def save_artifacts(self, artifact_path=None) -> None:
        """Write the vocabulary and a manifest of its digests under ``artifact_path``.

        Replaces the folders an earlier export of this package left there, and nothing else.
        """
        if artifact_path is None:
            raise T4ROpsError("save_artifacts needs artifact_path, got None")
        with replacing_earlier_exports(artifact_path, self._artifact_dir) as folder:
            write_checked(folder, self.vocabulary.to_files())

    def load_artifacts(self, artifact_path=None) -> None:
        """Verify and load the vocabulary written by :meth:`save_artifacts`."""
        if not artifact_path:
            # merlin.dag.Graph calls load_artifacts("") while it is built in-process,
            # where the op still holds the vocabulary it read from the workflow.
            if getattr(self, "vocabulary", None) is None:
                raise T4ROpsError("load_artifacts needs the export's artifact_path, got none")
            return
        files = read_checked(Path(artifact_path) / self._artifact_dir, VOCABULARY_FILES)
        self.vocabulary = ItemVocabulary.from_files(files)

    # -- inference -----------------------------------------------------------------------
    def transform(self, col_selector: ColumnSelector, transformable):
        """Decode ``ids_column`` of a TensorTable or DataFrame; returns the same kind of object."""
        name = self.ids_column
        if isinstance(transformable, TensorTable):
            columns = transformable.to_dict()
            columns[name] = self.vocabulary.decode(columns[name], name)
            return TensorTable(columns)
        frame = transformable.copy(deep=False)
        encoded = np.stack(frame[name].to_list()) if len(frame) else np.empty((0, 0), int)
        frame[name] = list(self.vocabulary.decode(encoded, name))
        return frame
