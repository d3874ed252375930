"""``PredictT4RPyTorch``: run a Transformers4Rec model in eager PyTorch inside a Merlin graph."""

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from merlin.dag import BaseOperator, ColumnSelector
from merlin.schema import ColumnSchema, Schema, Tags
from merlin.table import TensorTable
from merlin_t4r_ops.errors import SchemaMismatchError, T4ROpsError
from merlin_t4r_ops.ops.artifacts import load_model, save_model
from merlin_t4r_ops.ops.device import make_current, resolve_device
from merlin_t4r_ops.ops.export_folders import new_folder_name, replacing_earlier_exports
from merlin_t4r_ops.ops.inputs import input_specs, to_model_inputs
from merlin_t4r_ops.ops.skeleton import holds_any
from merlin_t4r_ops.sequence import resolve_sequence_length

__all__ = ["PredictT4RPyTorch"]

TOP_K_IDS = "item_ids"
TOP_K_SCORES = "item_id_scores"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(
        model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    ):
        model = model.module
    return model


class PredictT4RPyTorch(BaseOperator):
    """Run a trained Transformers4Rec model in eager PyTorch, no TorchScript needed.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        The trained model. A model still wrapped in ``DataParallel`` or
        ``DistributedDataParallel`` is unwrapped.
    input_schema : merlin.schema.Schema, optional
        Columns the model reads; default ``model.input_schema``.
    output_schema : merlin.schema.Schema, optional
        Columns the operator returns; default derived from ``model.output_schema`` and
        ``top_k``.
    top_k : int, optional
        For next-item prediction: return the ``top_k`` best items as ``item_ids`` (int32,
        the encoded ids the model scores) and ``item_id_scores`` (float32), each
        ``[batch, top_k]``, instead of the full score matrix.
    max_sequence_length : int, optional
        Width the session lists are padded or cropped to (most recent items kept); default
        the model's own, found as training finds it
        (:func:`merlin_t4r_ops.sequence.resolve_sequence_length`).
    device : str or torch.device, optional
        Where the model runs. Default: the device of the Triton model instance (a GPU
        instance gets its own GPU), else the CPU.

    Examples
    --------
    >>> pipeline = (workflow.input_schema.column_names
    ...             >> TransformWorkflow(workflow)
    ...             >> PredictT4RPyTorch(model, top_k=20))
    >>> Ensemble(pipeline, workflow.input_schema).export("model_repository")
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_schema: Optional[Schema] = None,
        output_schema: Optional[Schema] = None,
        *,
        top_k: Optional[int] = None,
        max_sequence_length: Optional[int] = None,
        device=None,
    ):
        super().__init__()
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise T4ROpsError(f"top_k must be a positive int or None, got {top_k!r}")
        self.model = _unwrap(model)
        # Copies, so that building the op never changes the caller's schemas.
        self._input_schema = Schema(list(
            (input_schema if input_schema is not None else self.model.input_schema)
        ))
        self.top_k = top_k
        self._output_schema = Schema(list(
            output_schema if output_schema is not None else self._default_output_schema()
        ))
        self.max_sequence_length = resolve_sequence_length(
            self.model, self._input_schema, requested=max_sequence_length,
            required_for="the operator pads every request to one width",
        )
        self.requested_device = None if device is None else str(device)
        self._specs = input_specs(self._input_schema)
        self._artifact_dir = new_folder_name()

    # -- graph contract ------------------------------------------------------------------
    def _default_output_schema(self) -> Schema:
        task_columns = list(self.model.output_schema)
        is_next_item = not any(
            col.name in (TOP_K_IDS, TOP_K_SCORES) for col in task_columns
        ) and self._item_id_column() is not None and len(task_columns) == 1 and (
            task_columns[0].shape.dims is not None
            and len(task_columns[0].shape.dims) == 2
            and task_columns[0].shape.dims[1].max not in (None, 1)
        )
        if self.top_k is None or not is_next_item:
            if self.top_k is not None:
                raise T4ROpsError(
                    "top_k applies to next-item prediction only; this model's outputs are "
                    f"{[c.name for c in task_columns]}"
                )
            return Schema([
                ColumnSchema(col.name, dtype=np.float32, dims=self._score_dims(col))
                for col in task_columns
            ])
        # int32 ids halve the id bytes of every response; any embedding table fits int32.
        catalogue = int(task_columns[0].shape.dims[1].max)
        id_dtype = np.int32 if catalogue < 2**31 else self._input_schema[
            self._item_id_column()].dtype
        return Schema([
            ColumnSchema(TOP_K_IDS, dtype=id_dtype, dims=(None, self.top_k)),
            ColumnSchema(TOP_K_SCORES, dtype=np.float32, dims=(None, self.top_k)),
        ])

    @staticmethod
    def _score_dims(column: ColumnSchema):
        dims = column.shape.dims
        if dims is not None and len(dims) == 2 and dims[1].max not in (None, 1):
            return (None, int(dims[1].max))
        return (None,)

    def _item_id_column(self) -> Optional[str]:
        names = self._input_schema.select_by_tag(Tags.ITEM_ID).column_names
        return names[0] if names else None

    def compute_input_schema(
        self,
        root_schema: Schema,
        parents_schema: Schema,
        deps_schema: Schema,
        selector: ColumnSelector,
    ) -> Schema:
        """The model's input columns, checked against what the parent nodes produce."""
        available = parents_schema + deps_schema
        missing = [name for name in self._input_schema.column_names
                   if name not in available.column_names]
        if missing:
            raise SchemaMismatchError(
                f"PredictT4RPyTorch needs column {missing[0]!r}, which the graph does not "
                f"produce; the parent produces {available.column_names}"
            )
        return Schema([available[name] for name in self._input_schema.column_names])

    def compute_output_schema(
        self, input_schema: Schema, col_selector: ColumnSelector, prev_output_schema=None
    ) -> Schema:
        """The score columns (or ``item_ids``/``item_id_scores`` with ``top_k``)."""
        return self._output_schema

    # -- artifacts: the model never goes into ensemble.pkl ---------------------------------
    def __getstate__(self):
        # ensemble.pkl holds no model and no tensor: not the weights (the eval cache holds
        # the model too), and not a request's data that a cache of this op may keep.
        kept_out = (torch.nn.Module, torch.Tensor, np.ndarray)
        return {
            name: None if holds_any(value, kept_out) else value
            for name, value in self.__dict__.items()
        }

    def save_artifacts(self, artifact_path=None) -> None:
        """Write the model's weights, structure and checksums under ``artifact_path``.

        Replaces the folders an earlier export of this package left there, and nothing else.
        """
        if artifact_path is None:
            raise T4ROpsError("save_artifacts needs artifact_path, got None")
        with replacing_earlier_exports(artifact_path, self._artifact_dir) as folder:
            save_model(self.model, folder)

    def load_artifacts(self, artifact_path=None) -> None:
        """Verify and load the model saved by :meth:`save_artifacts`, on the instance's device."""
        if not artifact_path:
            # merlin.dag.Graph calls load_artifacts("") while it is built in-process,
            # where the op still holds the user's model.
            if getattr(self, "model", None) is None:
                raise T4ROpsError("load_artifacts needs the export's artifact_path, got none")
            return
        device = resolve_device(self.requested_device)
        make_current(device)  # before anything touches CUDA, or GPU 0 gets a context too
        self.model = load_model(Path(artifact_path) / self._artifact_dir, device)

    # -- inference -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        for tensor in self.model.parameters():
            return tensor.device
        return torch.device("cpu")

    def _ensure_eval(self) -> None:
        """``model.eval()``, but only when some module is in training mode.

        ``eval()`` walks and sets every module on each call (a third of a millisecond for a
        small T4R model, a tenth of its batch-1 forward on a CPU); reading the flags of a
        cached module list costs microseconds and gives the same result.
        """
        model = self.model
        cache = getattr(self, "_module_cache", None)
        if cache is None or cache[0] is not model:
            cache = self._module_cache = (model, list(model.modules()))
        if any(module.training for module in cache[1]):
            model.eval()

    def predict(self, table: TensorTable) -> dict:
        """Scores for the sessions in ``table`` as numpy arrays, keyed by output column."""
        inputs = to_model_inputs(table, self._specs, self.max_sequence_length, self.device)
        self._ensure_eval()
        with torch.inference_mode():
            scores = self.model(inputs, training=False, testing=False)
        if isinstance(scores, dict):
            scores = [scores[name] for name in self._output_schema.column_names]
        else:
            scores = [scores]
        if self.top_k is not None:
            top = torch.topk(scores[0].float(), k=min(self.top_k, scores[0].shape[-1]), dim=-1)
            id_dtype = self._output_schema[TOP_K_IDS].dtype.to_numpy
            return {
                TOP_K_IDS: top.indices.cpu().numpy().astype(id_dtype, copy=False),
                TOP_K_SCORES: top.values.cpu().numpy(),
            }
        outputs = {}
        for name, value in zip(self._output_schema.column_names, scores):
            value = value.float()
            if len(self._output_schema[name].shape.dims) == 1:
                value = value.reshape(-1)
            outputs[name] = value.cpu().numpy()
        return outputs

    def transform(self, col_selector: ColumnSelector, transformable):
        """Run the model on a TensorTable or DataFrame; returns the same kind of object."""
        table = transformable
        if not isinstance(table, TensorTable):
            table = TensorTable.from_df(transformable)
        output = TensorTable(self.predict(table))
        return output if isinstance(transformable, TensorTable) else output.to_df()
