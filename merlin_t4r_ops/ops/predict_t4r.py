"""``PredictT4RPyTorch``: run a Transformers4Rec model in eager PyTorch inside a Merlin graph."""

import copy
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from merlin.dag import BaseOperator, ColumnSelector
from merlin.schema import ColumnSchema, Schema, Tags
from merlin.table import TensorTable
from merlin_t4r_ops.arguments import is_positive_int
from merlin_t4r_ops.errors import SchemaMismatchError, T4ROpsError
from merlin_t4r_ops.ops.artifacts import save_model
from merlin_t4r_ops.ops.collisions import calling_node, refuse_colliding_outputs
from merlin_t4r_ops.ops.cuda_graphs import (
    DEFAULT_BUCKETS, CudaGraphBuckets, check_buckets, example_request, log_load)
from merlin_t4r_ops.ops.device import make_current, resolve_device
from merlin_t4r_ops.ops.export_folders import (
    replacing_earlier_exports, saved_by_an_earlier_operator)
from merlin_t4r_ops.ops.inputs import input_specs, to_model_inputs
from merlin_t4r_ops.ops.masking import (
    mask_scores, reserved_item_ids, seen_items, seen_matrix, top_k_unmasked,
)
from merlin_t4r_ops.ops.model_block import check_columns_against_model, embedding_rows
from merlin_t4r_ops.ops.shared_model import shared_model
from merlin_t4r_ops.ops.skeleton import holds_any
from merlin_t4r_ops.sequence import resolve_sequence_length
from merlin_t4r_ops.wrappers import unwrap_model

__all__ = ["PredictT4RPyTorch"]

TOP_K_IDS = "item_ids"
TOP_K_SCORES = "item_id_scores"
# With exclude_seen, a CUDA graph also reads each session's most recent seen ids (_SEEN, at
# least SEEN_IN_GRAPH of them) and also writes the masked scores (_SCORES), on which a longer
# session's older items are masked after the replay.
_SEEN, _SCORES = "__seen__", "__scores__"
SEEN_IN_GRAPH = 128


def _without_top_k(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the operator runs it: returning the full score matrix.

    With T4R's ``model.top_k`` set, ``model(batch)`` returns ``(scores, ids)`` of its own
    top-k, too late to mask anything. A shallow copy with ``top_k=None`` shares every
    module and weight, and leaves the caller's model as it was.
    """
    if not getattr(model, "top_k", None):
        return model
    serving = copy.copy(model)
    serving.top_k = None
    return serving


def _next_item_task(model: torch.nn.Module):
    from transformers4rec.torch.model.prediction_task import NextItemPredictionTask

    tasks = [task for task in getattr(model, "prediction_tasks", [])
             if isinstance(task, NextItemPredictionTask)]
    return tasks[0] if tasks else None


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
        ``top_k``. With ``top_k``, T4R's own top-k schema (``item_id_scores`` and
        ``item_ids``, as ``model.output_schema`` gives it with ``model.top_k`` set) is
        recognised: its ``item_ids`` dtype is kept, and ``top_k`` columns are declared.
    top_k : int, optional
        For next-item prediction: return the ``top_k`` best items as ``item_ids`` (the
        encoded ids the model scores) and ``item_id_scores`` (float32), each
        ``[batch, top_k]``, instead of the full score matrix. Default ``model.top_k``
        (T4R's way to ask for a top-k at inference); a value given here takes precedence
        over it. The ids' dtype: ``output_schema``'s if given; with ``model.top_k``
        adopted, T4R's (its ``model.output_schema``, the item-id column's dtype, as
        ``model(batch)`` returns them); with this ``top_k``, int32 (half the bytes). Ids that stand for no item never appear: the padding id, and for an
        item-id column made by NVTabular's ``Categorify`` its null and out-of-vocabulary
        ids, as its schema says, or the graph when the ``Ensemble`` is built (the column
        a ``TransformWorkflow`` hands over, the vocabulary of a ``DecodeItemIds`` of this
        top-k). A ``top_k`` larger than the ids left is refused here.
    exclude_seen : bool, default False
        With ``top_k``: also leave out of each row's top-k every item of that row's
        session as the request sent it, including the older items that cropping to the
        model's width drops. A row with fewer than ``top_k`` items left ends with id
        ``-1`` (no item has it) scored ``-inf``.
    output_prefix : str, default ""
        Prepended to every output column name (``"cart_"`` gives ``cart_item_ids``), so
        that several models can answer in one ensemble. A graph where two operators'
        outputs meet under one name is refused when it is built.
    max_sequence_length : int, optional
        Width the session lists are padded or cropped to (most recent items kept); default
        the model's own, found as training finds it
        (:func:`merlin_t4r_ops.sequence.resolve_sequence_length`).
    device : str or torch.device, optional
        Where the model runs. Default: the device of the Triton model instance (a GPU
        instance gets its own GPU), else the CPU.
    cuda_graph_buckets : sequence of int, optional
        On CUDA, the batch sizes whose forward (with masking and top-k; with
        ``exclude_seen``, each session's 128 most recent items, or the model's width if
        larger, masked in the graph too) is captured as CUDA graphs at load; a request is
        padded up to the next bucket and replayed, larger ones run eagerly (see
        :mod:`merlin_t4r_ops.ops.cuda_graphs`). Default 1, 2, 4, ..., 256; ``None`` or
        ``()`` runs every request eagerly. Ignored on the CPU.
    decode_in_graph : bool, default True
        Where the executor runs this top-k in the lean chain (workflow >> this operator >>
        ``DecodeItemIds``, see :mod:`merlin_t4r_ops.runtime.chain`) and the shop's item ids
        are signed integers, look the raw ids up on the model's device, right after the
        top-k (inside the captured CUDA graph): the ``DecodeItemIds`` after it then has
        nothing left to do. False: ``DecodeItemIds`` decodes on the host, as in any other
        graph. String ids are always decoded on the host, with one ``take``.

    Notes
    -----
    Calls are safe from several threads (``Ensemble.transform`` behind a threaded web
    server): T4R keeps per-call tensors on its modules, so the forward pass, the masking
    and the top-k of one call run under a lock of the model's, which every operator over
    the same model shares: one call at a time. Those operators share the model's artifacts
    too: an export writes them once, and a loaded ensemble loads them once, into one module
    that all of them run (each with its own CUDA graphs).

    Examples
    --------
    >>> pipeline = (workflow.input_schema.column_names
    ...             >> TransformWorkflow(workflow)
    ...             >> PredictT4RPyTorch(model, top_k=20, exclude_seen=True))
    >>> Ensemble(pipeline, workflow.input_schema).export("model_repository")
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_schema: Optional[Schema] = None,
        output_schema: Optional[Schema] = None,
        *,
        top_k: Optional[int] = None,
        exclude_seen: bool = False,
        output_prefix: str = "",
        max_sequence_length: Optional[int] = None,
        device=None,
        cuda_graph_buckets: Optional[Sequence[int]] = DEFAULT_BUCKETS,
        decode_in_graph: bool = True,
    ):
        super().__init__()
        model = unwrap_model(model)
        if top_k is None and getattr(model, "top_k", None) is not None:
            # Adopting T4R's top-k: answer as T4R does, in its schema's item_ids dtype.
            top_k = model.top_k
            output_schema = model.output_schema if output_schema is None else output_schema
        if top_k is not None and not is_positive_int(top_k):
            raise T4ROpsError(f"top_k must be a positive int or None, got {top_k!r}")
        top_k = None if top_k is None else int(top_k)
        if not isinstance(output_prefix, str):
            raise T4ROpsError(f"output_prefix must be a str, got {output_prefix!r}")
        self.model = _without_top_k(model)
        # One lock, one artifact folder and one load for every operator over this model.
        self._shared = shared_model(model)
        # Copies, so that building the op never changes the caller's schemas.
        self._input_schema = Schema(list(
            (input_schema if input_schema is not None else self.model.input_schema)
        ))
        self.top_k = top_k
        self.exclude_seen = bool(exclude_seen)
        self.output_prefix = output_prefix
        self._task_names = list(self.model.output_schema.column_names)
        check_columns_against_model(self._input_schema, self.model, "the operator's input schema")
        self._embedding_rows = embedding_rows(self.model)
        self.reserved_item_ids = self._reserved_item_ids()
        self._output_schema = self._derive_output_schema(output_schema)
        self.max_sequence_length = resolve_sequence_length(
            self.model, self._input_schema, requested=max_sequence_length,
            required_for="the operator pads every request to one width",
        )
        self.requested_device = None if device is None else str(device)
        self._specs = input_specs(self._input_schema, self._embedding_rows)
        self._artifact_dir = self._shared.folder
        self.cuda_graph_buckets = check_buckets(cuda_graph_buckets)
        self.decode_in_graph = bool(decode_in_graph)
        self._decoder = None  # an ItemVocabulary once decode_with accepts one

    # -- graph contract ------------------------------------------------------------------
    def _is_next_item(self) -> bool:
        task_columns = list(self.model.output_schema)
        return self._item_id_column() is not None and len(task_columns) == 1 and (
            task_columns[0].shape.dims is not None
            and len(task_columns[0].shape.dims) == 2
            and task_columns[0].shape.dims[1].max not in (None, 1)
        )

    def _catalogue(self) -> int:
        """How many item ids the next-item head scores (its score matrix's width)."""
        return int(self.model.output_schema.first.shape.dims[1].max)

    def _reserved_item_ids(self, column: Optional[ColumnSchema] = None) -> tuple:
        """The reserved ids that ``column`` (default the model's own item-id column) says."""
        item_column = self._item_id_column()
        task = _next_item_task(self.model)
        if item_column is None or task is None:
            return ()
        column = self._input_schema[item_column] if column is None else column
        return reserved_item_ids(column, getattr(task, "padding_idx", 0))

    def _reserve_also(self, ids) -> None:
        """Add ``ids`` to the reserved ids, and check again that ``top_k`` fits."""
        reserved = tuple(sorted(set(self.reserved_item_ids) | {int(i) for i in ids}))
        if reserved == self.reserved_item_ids:
            return
        self.reserved_item_ids = reserved
        # A captured CUDA graph reads the cached reserved tensor: both are made again.
        self.__dict__.pop("_reserved_cache", None)
        self.__dict__.pop("_graphs", None)
        if self.top_k is not None:
            self._check_top_k_fits()

    def _derive_output_schema(self, given: Optional[Schema]) -> Schema:
        prefix = self.output_prefix
        if self.top_k is None:
            if self.exclude_seen:
                raise T4ROpsError("exclude_seen=True needs top_k: it removes items from a top-k")
            columns = list(given) if given is not None else [
                ColumnSchema(col.name, dtype=np.float32, dims=self._score_dims(col))
                for col in self.model.output_schema
            ]
            unknown = [col.name for col in columns if col.name not in self._task_names]
            if unknown:
                raise T4ROpsError(
                    f"output_schema names {unknown}, which the model does not output; its "
                    f"outputs are {self._task_names}"
                )
            self._task_names = [col.name for col in columns]  # the order declared
            return Schema([col.with_name(prefix + col.name) for col in columns])
        if not self._is_next_item():
            raise T4ROpsError(
                "top_k applies to next-item prediction only; this model's outputs are "
                f"{self._task_names}"
            )
        self._check_top_k_fits()
        if self.exclude_seen and not self.reserved_item_ids:
            # The seen ids are padded with a reserved id (masked anyway) in a CUDA graph.
            raise T4ROpsError(
                "exclude_seen=True needs the model's padding id: it takes it from T4R's "
                "NextItemPredictionTask, and this model has none"
            )
        id_dtype = self._top_k_id_dtype(given)
        return Schema([
            ColumnSchema(prefix + TOP_K_IDS, dtype=id_dtype, dims=(None, self.top_k)),
            ColumnSchema(prefix + TOP_K_SCORES, dtype=np.float32, dims=(None, self.top_k)),
        ])

    def _check_top_k_fits(self) -> None:
        catalogue = self._catalogue()
        reserved = [i for i in self.reserved_item_ids if 0 <= i < catalogue]
        if self.top_k > catalogue - len(reserved):
            raise T4ROpsError(
                f"top_k={self.top_k} is more than the model can recommend: it scores "
                f"{catalogue} item ids, and {len(reserved)} of them are reserved {reserved}, "
                f"which leaves {catalogue - len(reserved)}"
            )

    def _top_k_id_dtype(self, given: Optional[Schema]):
        if given is not None:
            if TOP_K_IDS not in given.column_names:
                raise T4ROpsError(
                    f"with top_k, output_schema must be T4R's top-k schema ({TOP_K_IDS!r} "
                    f"and {TOP_K_SCORES!r}), got {given.column_names}"
                )
            return given[TOP_K_IDS].dtype.without_shape
        # int32 ids halve the id bytes of every response; any embedding table fits int32.
        if self._catalogue() < 2**31:
            return np.int32
        return self._input_schema[self._item_id_column()].dtype.without_shape

    @staticmethod
    def _score_dims(column: ColumnSchema):
        dims = column.shape.dims
        if dims is not None and len(dims) == 2 and dims[1].max not in (None, 1):
            return (None, int(dims[1].max))
        return (None,)

    def _item_id_column(self) -> Optional[str]:
        # Asked on every request: found once per input schema.
        schema, name = self.__dict__.get("_item_id_of_schema") or (None, None)
        if schema is not self._input_schema:
            names = self._input_schema.select_by_tag(Tags.ITEM_ID).column_names
            name = names[0] if names else None
            self._item_id_of_schema = (self._input_schema, name)
        return name

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
        upstream = Schema([available[name] for name in self._input_schema.column_names])
        check_columns_against_model(upstream, self.model, "the graph (its parent's output schema)")
        return upstream

    def compute_output_schema(
        self, input_schema: Schema, col_selector: ColumnSelector, prev_output_schema=None
    ) -> Schema:
        """The score columns (or ``item_ids``/``item_id_scores`` with ``top_k``)."""
        return self._output_schema

    def validate_schemas(
        self, parents_schema, deps_schema, input_schema, output_schema, strict_dtypes=False
    ):
        """Reserve the ids the graph's Categorify reserves; refuse colliding outputs.

        The model's own schema may not say which ids Categorify reserved (a
        ``merlin_standard_lib`` schema loses its properties on T4R's conversion); the graph
        does: the item-id column as a ``TransformWorkflow`` hands it over carries them, and a
        ``DecodeItemIds`` of this top-k holds the vocabulary itself.
        """
        item_column = self._item_id_column()
        if item_column is not None and item_column in input_schema.column_names:
            self._reserve_also(self._reserved_item_ids(input_schema[item_column]))
        node = calling_node(self)
        if node is not None:
            refuse_colliding_outputs(node, self._output_schema.column_names)
            self._reserve_for_decoders(node)

    def _reserve_for_decoders(self, node) -> None:
        """Reserve every id the vocabulary of a ``DecodeItemIds`` of this top-k has no item
        for, after checking that it covers exactly the item embedding table's rows."""
        from merlin_t4r_ops.ops.decode import DecodeItemIds

        ids_column = self.output_prefix + TOP_K_IDS
        rows = self._embedding_rows.get(self._item_id_column())
        for child in node.children:
            if not (isinstance(child.op, DecodeItemIds) and child.op.ids_column == ids_column):
                continue
            vocabulary = child.op.vocabulary
            encoded = vocabulary.first_id + len(vocabulary.raw_ids)
            if rows is not None and encoded != rows:
                raise SchemaMismatchError(
                    f"DecodeItemIds decodes {ids_column!r} with the vocabulary of "
                    f"{vocabulary.column!r}, which encodes ids 0 to {encoded - 1} ({encoded} "
                    f"ids), and the model's item embedding table has {rows} rows: the model "
                    "was not trained on this workflow"
                )
            self._reserve_also(range(vocabulary.first_id))

    # -- artifacts: the model never goes into ensemble.pkl ---------------------------------
    def __getstate__(self):
        # ensemble.pkl holds no model and no tensor: not the weights (the eval cache holds
        # the model too), and not a request's data that a cache of this op may keep.
        kept_out = (torch.nn.Module, torch.Tensor, np.ndarray)
        # The operators over one model pickle one SharedModel (pickle keeps shared objects
        # shared), so that they load one model again.
        state = {name: None if holds_any(value, kept_out) else value
                 for name, value in self.__dict__.items()}
        state.pop("_graphs", None)  # CUDA graphs: captured again at load
        state.pop("_lookup_cache", None)
        state["_decoder"] = None  # the lean chain hands the vocabulary over at load
        return state

    def save_artifacts(self, artifact_path=None) -> None:
        """Write the model's weights, structure and checksums under ``artifact_path``.

        Replaces the folders an earlier export of this package left there, and nothing else.
        Of several operators over one model in the exported ensemble, the first writes
        their one folder and the others nothing.
        """
        if artifact_path is None:
            raise T4ROpsError("save_artifacts needs artifact_path, got None")
        if saved_by_an_earlier_operator(self):
            return
        with replacing_earlier_exports(artifact_path, self._artifact_dir) as folder:
            save_model(self.model, folder)
        self._shared.saved()

    def load_artifacts(self, artifact_path=None) -> None:
        """Verify and load the model saved by :meth:`save_artifacts`, on the instance's device.

        Operators over one model, loaded from one ``ensemble.pkl``, load it once and run the
        same module.
        """
        if not artifact_path:
            # merlin.dag.Graph calls load_artifacts("") while it is built in-process,
            # where the op still holds the user's model.
            if getattr(self, "model", None) is None:
                raise T4ROpsError("load_artifacts needs the export's artifact_path, got none")
            return
        device = resolve_device(self.requested_device)
        make_current(device)  # before anything touches CUDA, or GPU 0 gets a context too
        self.model = self._shared.load(artifact_path, device)
        self._capture_graphs()

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
        inputs = to_model_inputs(
            table, self._specs, self.max_sequence_length, torch.device("cpu"))
        # T4R keeps per-call tensors on its modules (the item sequence, the masking
        # schema), and a CUDA graph replays from static buffers: one call at a time.
        with self._shared.lock, torch.inference_mode():
            outputs = self._run(inputs, table)
        return {name: value.cpu().numpy() for name, value in outputs.items()}

    def _run(self, inputs: Dict[str, torch.Tensor], table) -> Dict[str, torch.Tensor]:
        """Replay the captured graph of the request's bucket, or run eagerly."""
        graphs = self._graph_runner()
        if graphs is not None and graphs.bucket_for(len(next(iter(inputs.values())))):
            if self.exclude_seen:
                return self._replay_excluding_seen(graphs, inputs, table)
            return graphs(inputs)
        self._ensure_eval()
        device = self.device
        seen = seen_items(table, self._item_id_column(), device) if self.exclude_seen else None
        return self._device_outputs({k: v.to(device) for k, v in inputs.items()}, seen)

    def _replay_excluding_seen(self, replay, inputs, table) -> Dict[str, torch.Tensor]:
        """Replay with each session's recent items masked in the graph, and the rest after.

        ``replay(inputs, outputs=names)`` is a :class:`CudaGraphBuckets` over
        :meth:`_captured_top_k`. Sessions longer than the graph's seen matrix are rare and
        cost an eager mask and top-k on the masked scores that the graph wrote.
        """
        recent, older = seen_matrix(
            table, self._item_id_column(), self._seen_width, self.reserved_item_ids[0])
        inputs = {**inputs, _SEEN: torch.from_numpy(recent)}
        if older is None:
            return replay(inputs, outputs=self._output_schema.column_names)
        masked = replay(inputs, outputs=[_SCORES])[_SCORES]
        older = tuple(torch.from_numpy(part).to(masked.device) for part in older)
        return self._top_k_outputs(masked, older)  # reserved ids again: already -inf

    @property
    def _seen_width(self) -> int:
        """How many of a session's most recent items a CUDA graph masks itself."""
        return max(SEEN_IN_GRAPH, self.max_sequence_length)

    def _scores(self, inputs: Dict[str, torch.Tensor]):
        """The model's forward: one score tensor per task, in ``_task_names`` order."""
        scores = self.model(inputs, training=False, testing=False)
        if isinstance(scores, dict):
            return [scores[name] for name in self._task_names]
        return [scores]

    def _device_outputs(self, inputs: Dict[str, torch.Tensor], seen=None):
        """Forward and, with ``top_k``, masking and top-k, all on the model's device.

        With ``seen=None`` everything in here is what a CUDA graph captures: no host
        synchronisation.
        """
        scores = self._scores(inputs)
        if self.top_k is not None:
            return self._top_k_outputs(scores[0], seen)
        outputs = {}
        for name, value in zip(self._output_schema.column_names, scores):
            value = value.float()
            if len(self._output_schema[name].shape.dims) == 1:
                value = value.reshape(-1)
            outputs[name] = value
        return outputs

    def _top_k_outputs(self, scores: torch.Tensor, seen=None) -> Dict[str, torch.Tensor]:
        """Mask reserved (and seen) ids on the scores' device, then take the top-k."""
        return self._top_k_of(self._masked(scores, seen))

    def _masked(self, scores: torch.Tensor, seen=None, seen_recent=None) -> torch.Tensor:
        """Float scores with reserved and seen ids at ``-inf`` (the forms of
        :func:`~merlin_t4r_ops.ops.masking.mask_scores`)."""
        return mask_scores(scores.float(), self._reserved_on(scores.device), seen, seen_recent)

    def _top_k_of(self, masked: torch.Tensor) -> Dict[str, torch.Tensor]:
        ids, values = top_k_unmasked(masked, self.top_k)
        ids_name, scores_name = self._output_schema.column_names
        if self.__dict__.get("_decoder") is not None:  # the shop's ids, looked up here
            return {ids_name: torch.take(self._lookup_on(ids.device), ids.long() + 1),
                    scores_name: values}
        id_dtype = torch.from_numpy(np.zeros(0, self._output_schema[ids_name].dtype.to_numpy))
        return {ids_name: ids.to(id_dtype.dtype), scores_name: values}

    def decode_with(self, vocabulary) -> bool:
        """Answer the shop's raw ids from now on, looked up in ``vocabulary`` on the device.

        Called by the lean chain for the ``DecodeItemIds`` that follows this top-k. Accepts
        (returns True) only with ``decode_in_graph``, signed integer raw ids and a vocabulary
        that covers the item embedding table's rows exactly; the CUDA
        graphs captured so far are captured again with the lookup inside.
        """
        if not (getattr(self, "decode_in_graph", True) and self.top_k is not None
                and vocabulary.decodes_on_device):
            return False
        # The device lookup has no range check (an id past the table would be a device-side
        # assert): only a vocabulary known to cover the item table's rows decodes there.
        rows = self._embedding_rows.get(self._item_id_column())
        if rows != vocabulary.first_id + len(vocabulary.raw_ids):
            return False
        self._decoder = vocabulary
        self.__dict__.pop("_lookup_cache", None)
        if self.__dict__.get("_graphs") is not None:
            self._capture_graphs()
        return True

    def decoding_copy(self, vocabulary) -> Optional["PredictT4RPyTorch"]:
        """A shallow copy of this operator, the model shared, that answers raw ids; or None.

        The copy decodes with ``vocabulary`` (see :meth:`decode_with`), so this operator
        keeps answering encoded ids to the graph it belongs to. The copy takes the CUDA
        graphs over; this operator captures its own again only if it runs.
        """
        # Under the model's lock: capturing runs the shared model, which another thread
        # (an executor over the same ensemble) may be calling.
        with self._shared.lock:
            twin = type(self).__new__(type(self))  # not copy.copy: __getstate__ drops the model
            twin.__dict__.update(self.__dict__)
            # Handed over, not shared: the twin frees them before capturing its own, so
            # two sets of graph pools never hold the GPU at once.
            handed = self.__dict__.get("_graphs") is not None
            if handed:
                del self.__dict__["_graphs"]
            if twin.decode_with(vocabulary):
                return twin
            if handed:  # refused before any capture: they are ours again
                self._graphs = twin._graphs
            return None

    def _lookup_on(self, device: torch.device) -> torch.Tensor:
        """The decoder's encoded-to-raw table on ``device``, made once (as ``_reserved_on``)."""
        cache = self.__dict__.get("_lookup_cache") or {}
        if device not in cache:
            cache[device] = self._decoder.device_lookup(device)
            self._lookup_cache = cache
        return cache[device]

    def _captured_top_k(self, inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """What a graph captures with ``exclude_seen``: the forward, the reserved ids and
        the recent seen ids (``inputs[_SEEN]``) masked, the top-k; and the masked scores."""
        inputs = dict(inputs)
        recent = inputs.pop(_SEEN)
        masked = self._masked(self._scores(inputs)[0], seen_recent=recent)
        return {**self._top_k_of(masked), _SCORES: masked}

    def _reserved_on(self, device: torch.device) -> torch.Tensor:
        """The reserved ids as a tensor on ``device``, made once (a graph cannot copy them in)."""
        cache = self.__dict__.get("_reserved_cache") or {}
        if device not in cache:
            cache[device] = torch.tensor(self.reserved_item_ids, dtype=torch.int64, device=device)
            self._reserved_cache = cache
        return cache[device]

    # -- CUDA graphs ---------------------------------------------------------------------
    def _capture_graphs(self) -> None:
        """Capture the forward, masking and top-k per batch bucket on CUDA; log what runs how."""
        self._graphs = None
        buckets = getattr(self, "cuda_graph_buckets", ())
        device = self.device
        if not buckets or device.type != "cuda":
            if buckets:
                log_load(f"PredictT4RPyTorch: model on {device}, no CUDA graphs; every batch "
                         "runs eagerly")
            return
        self._ensure_eval()
        example = example_request(self._specs, self.max_sequence_length)
        function = self._device_outputs
        if self.exclude_seen:  # a row of padding ids: reserved, masked anyway
            example[_SEEN] = torch.full((1, self._seen_width), self.reserved_item_ids[0])
            function = self._captured_top_k
        self._graphs = CudaGraphBuckets(function, example, buckets, device)
        log_load(f"PredictT4RPyTorch: {self._graphs.summary()}", warning=bool(self._graphs.failed))

    def _graph_runner(self) -> Optional[CudaGraphBuckets]:
        """The captured graphs; captured on first use in process, or again after a move."""
        graphs = self.__dict__.get("_graphs", False)
        if graphs is False or (graphs is not None and graphs.device != self.device):
            self._capture_graphs()
        return self._graphs

    def transform(self, col_selector: ColumnSelector, transformable):
        """Run the model on a TensorTable or DataFrame; returns the same kind of object."""
        table = transformable
        if not isinstance(table, TensorTable):
            table = TensorTable.from_df(transformable)
        output = TensorTable(self.predict(table))
        return output if isinstance(transformable, TensorTable) else output.to_df()
