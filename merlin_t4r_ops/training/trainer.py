"""A Transformers4Rec ``Trainer`` that follows :func:`resolve_strategy` and is exact under DDP.

``transformers4rec.torch.Trainer`` (23.12) trains with DataParallel or DDP
through Hugging Face, but

* gives the Merlin dataloader the *local* rank as its global rank, so two nodes
  read the same shards, and Merlin 23.08's loader never reorders partitions or
  moves them between ranks, and gives ranks as many rows as their partitions
  happen to hold;
* evaluates with the unwrapped model, i.e. on one GPU under DataParallel;
* under DataParallel averages the replicas' mean losses, which is inexact when
  a batch does not split evenly and NaN when one replica has no target;
* under DDP gathers losses and labels but not predictions, and does collectives
  per eval batch (a hang or shape error when ranks' batches differ);
* crops long sessions with ``pad_batch``, which keeps the *oldest* items, where
  serving keeps the most recent, and pads nothing when
  ``args.max_sequence_length`` is unset (ragged batches that DataParallel
  splits wrongly);
* reports a loss that is a mean of per-batch means (each batch weighted by the
  nominal batch size, then truncated to the local example count), and ranking
  metrics that rely on torchmetrics' implicit all-gather of every per-example
  row in ``compute()``.

:class:`Trainer` keeps T4R's training path and its return values; it replaces
the dataloader construction (the same
:class:`~merlin_t4r_ops.training.data.ShardedLoader` as ``fit``), the loss under
DataParallel (:mod:`~merlin_t4r_ops.training.data_parallel`), the evaluation
loop, the saving/logging guards, and under DDP Hugging Face's
``find_unused_parameters=True`` (seeds, data order and unused parameters follow
:mod:`~merlin_t4r_ops.training.policy`, as ``fit`` does).
"""

import contextlib
import itertools
import os
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from transformers.optimization import AdamW as HuggingFaceAdamW
from transformers.trainer_pt_utils import find_batch_size
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput
from transformers.training_args import ParallelMode
from transformers.utils import is_torch_tpu_available
from transformers4rec.config.trainer import T4RecTrainingArguments
from transformers4rec.torch import Trainer as T4RTrainer
from transformers4rec.torch.model.prediction_task import NextItemPredictionTask
from transformers4rec.torch.utils.torch_utils import nested_detach

from merlin_t4r_ops.errors import MissingSchemaError, StrategyError
from merlin_t4r_ops.sequence import resolve_sequence_length
from merlin_t4r_ops.training.data import (
    DP_NEEDS_WIDTH,
    ShardedLoader,
    as_dataset,
    batches_of,
    model_columns,
)
from merlin_t4r_ops.training.data_parallel import (
    batch_loss,
    data_parallel,
    forward_batch,
    loss_sum_and_count,
    rank_loss,
)
from merlin_t4r_ops.training.hf_adamw import multi_tensor
from merlin_t4r_ops.training.loop_args import loop_view
from merlin_t4r_ops.training.loss_filter import LoggedLossFilter
from merlin_t4r_ops.training.metrics import MetricAccumulator, prediction_tasks
from merlin_t4r_ops.training.policy import data_order_seed, settle_unused_parameters
from merlin_t4r_ops.training.predictions import check_top_k, gather_to_main, select_top_k
from merlin_t4r_ops.training.resume import (
    load_optimizer_and_scheduler,
    load_rng_state,
    place_loader,
    resolve_checkpoint,
    save_rng_state,
)
from merlin_t4r_ops.training.state import DistributedState, resolve_strategy, unwrap_model
from merlin_t4r_ops.training.step import cuda_graph_options, takes_cuda_graphs
from merlin_t4r_ops.training.unused import restore_requires_grad

__all__ = ["Trainer"]

# T4R's checks before it builds a loader, with its messages, which its callers match:
# split -> (ValueError message when no dataset is given, or None; name in the schema assertion).
_T4R_LOADER_CHECKS = {
    "train": (None, "Train"),
    "eval": ("Trainer: evaluation requires an eval_dataset.", "Eval"),
    "test": ("Trainer: test requires an test_dataset.", "Test"),
}


class Trainer(T4RTrainer):
    """``transformers4rec.torch.Trainer`` with ``strategy`` and exact distributed evaluation.

    Parameters
    ----------
    model : transformers4rec.torch.Model
        Unwrapped; after :meth:`train` this same object holds the trained
        weights (no DataParallel/DDP wrapper), ready to export.
    args : T4RecTrainingArguments
    strategy : {"auto", "ddp", "dp", "single"}
        Resolved by :func:`resolve_strategy`: ``"auto"`` gives DDP under
        torchrun, DataParallel when one process sees several GPUs, else one
        device. ``"single"`` on a multi-GPU host keeps Hugging Face from
        wrapping in DataParallel.
    **kwargs
        Everything else ``transformers4rec.torch.Trainer`` accepts
        (``schema``, ``train_dataset_or_path``, ``eval_dataset_or_path``,
        ``compute_metrics``, ...).

    Raises
    ------
    StrategyError
        The strategy cannot run here, or ``args`` disagree with it.

    Notes
    -----
    Evaluation metrics (every ranking metric configured on the model's tasks,
    and the loss) are means over all evaluated examples of all ranks; every
    rank returns the same numbers. ``evaluate()`` reports ``eval_/loss`` with or
    without ``compute_metrics``, as T4R does.

    ``predict()`` returns T4R's types, order and shapes (see
    :mod:`~merlin_t4r_ops.training.predictions`). Intended differences: under
    DDP only rank 0 receives predictions (all ranks' rows, in rank order; the
    other ranks get a ``PredictionOutput`` whose ``predictions`` is ``None``), because every rank holding every rank's rows
    multiplies memory by the world size, while T4R returns each rank's own
    rows; and ``evaluation_loop`` returns no predictions or labels for
    evaluation, which Hugging Face's ``evaluate()`` discards anyway.
    """

    def __init__(
        self,
        model,
        args: T4RecTrainingArguments,
        *,
        strategy: str = "auto",
        callbacks=None,
        **kwargs,
    ):
        if not isinstance(args, T4RecTrainingArguments):
            raise StrategyError(f"args must be a T4RecTrainingArguments, got {type(args).__name__}")
        self.dist_state = resolve_strategy(strategy)
        _align_args(args, self.dist_state)
        # T4R's default `callbacks=[]` is one shared list that incremental logging appends to.
        self._loaders = weakref.WeakSet()  # closed when train() returns, see train()
        self._resume_from = None  # the checkpoint train() resumes from, while it runs
        self._frozen = {}  # parameters frozen for DDP while train() runs, see _wrap_model
        self._loss_filter = None  # Hugging Face's NaN/Inf loss filter, see training_step
        super().__init__(model=model, args=args, callbacks=list(callbacks or []), **kwargs)

    # ---- data -----------------------------------------------------------------------------

    def _merlin_loader(self, path, batch_size: int, split: str) -> ShardedLoader:
        # Every data_loader_engine ("pyarrow" too) reads through the ShardedLoader: T4R's
        # pyarrow dataset would crop sessions to their oldest items, not the most recent
        # ones that the operator serves.
        no_data, loader_name = _T4R_LOADER_CHECKS[split]
        if path is None and no_data:
            raise ValueError(no_data)
        if self.schema is None:
            raise MissingSchemaError(
                f"schema is required to generate {loader_name} Dataloader; pass schema=..."
            )
        if path is None:
            raise ValueError(f"a {split} dataset path (or Merlin Dataset) is required; got None")
        width = resolve_sequence_length(
            unwrap_model(self.model), requested=self.args.max_sequence_length,
            required_for=DP_NEEDS_WIDTH if self.dist_state.strategy == "dp" else None,
        )
        inputs, targets = model_columns(self.model)
        loader = ShardedLoader(
            as_dataset(path, self.schema),
            self.dist_state,
            batch_size,
            inputs,
            targets,
            max_sequence_length=width,  # cropped and padded as the operator serves
            shuffle=split == "train",
            seed=data_order_seed(self.args.seed, self.args.data_seed),
            drop_last=self.args.dataloader_drop_last,
            # Every optimizer step is a collective: ranks need equal batch counts.
            equal_shards=split == "train",
            # Hugging Face's own loader options, read as its DataLoader reads them.
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            # Made on the GPU only where the step runs there (not under no_cuda on a GPU host).
            device_batches=None if self.args.device == self.dist_state.device else False,
        )
        self._loaders.add(loader)
        return loader

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """T4R's ``train``, resumable mid-epoch and at epoch boundaries.

        With ``resume_from_checkpoint`` the Trainer's own train loader starts at the
        checkpoint's epoch and batch (:mod:`~merlin_t4r_ops.training.resume`) instead of
        Hugging Face skipping batches through accelerate, which needs a torch
        ``DataLoader``. When it returns, the passes left open (``max_steps`` stops
        mid-epoch) end their reading threads.
        """
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        placeable = self.train_dataloader is None and not self.args.ignore_data_skip
        if checkpoint is not None and placeable:
            self._resume_from = checkpoint  # the loader is placed; Hugging Face skips nothing
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resume_from = None
            restore_requires_grad(unwrap_model(self.model), self._frozen)
            self._frozen = {}
            for loader in list(self._loaders):
                loader.close()

    def _inner_training_loop(self, batch_size=None, args=None, *rest, **kwargs):
        """Hugging Face's loop, over ``args`` with two flags of its own (:func:`loop_view`).

        What the loop writes (fractional ``logging_steps`` made step counts) lands in the
        user's ``args``, which checkpoints save, and trackers record the user's flags. The
        loop reads ``ignore_data_skip`` on when :meth:`train` placed the loader at the
        checkpoint, and ``logging_nan_inf_filter`` off when :meth:`training_step` applies
        that filter on the device (:mod:`~merlin_t4r_ops.training.loss_filter`): not for a
        subclass that replaces ``training_step``, which keeps Hugging Face's check, nor on a
        TPU, where Hugging Face skips it.
        """
        on_device = (args.logging_nan_inf_filter
                     and not is_torch_tpu_available()  # where Hugging Face skips its check
                     and type(self).training_step is Trainer.training_step)
        loop_args = loop_view(
            args,
            ignore_data_skip=args.ignore_data_skip or self._resume_from is not None,
            logging_nan_inf_filter=args.logging_nan_inf_filter and not on_device,
        )
        self._loss_filter = LoggedLossFilter() if on_device else None
        try:
            return super()._inner_training_loop(batch_size, loop_args, *rest, **kwargs)
        finally:
            self._loss_filter = None

    def training_step(self, model, inputs):
        """Hugging Face's step, returning the loss its NaN/Inf filter would add, without a sync.

        Hugging Face reads every step's loss on the host to drop a NaN or Inf one, which
        keeps the next batch's loading from overlapping the GPU's backward.
        """
        loss = super().training_step(model, inputs)
        if self._loss_filter is None:
            return loss
        return self._loss_filter(loss, self.state.global_step - self._globalstep_last_logged)

    def create_optimizer(self):
        """Hugging Face's optimizer; its default ``adamw_hf`` (T4R's too) stepped as one
        launch per tensor list (:class:`~merlin_t4r_ops.training.hf_adamw.MultiTensorAdamW`,
        the same values). An optimizer passed in ``optimizers=`` is kept as given."""
        created_here = self.optimizer is None
        optimizer = super().create_optimizer()
        if created_here and type(optimizer) is HuggingFaceAdamW:
            self.optimizer = optimizer = multi_tensor(optimizer)
        return optimizer

    def create_accelerator_and_postprocess(self):
        """Hugging Face's; ``torch_compile_mode="reduce-overhead"`` compiles as
        ``fit(compile=True)`` does where
        :func:`~merlin_t4r_ops.training.step.takes_cuda_graphs`: CUDA graphs, except for the
        graphs whose shapes change from batch to batch
        (:func:`~merlin_t4r_ops.training.step.cuda_graph_options`). With the mode alone,
        recorded anew for every batch, they ran this Trainer at 0.41-0.50 of the cached
        loop's pace on an H100 (docs/benchmarks.md)."""
        super().create_accelerator_and_postprocess()
        if self.args.torch_compile_mode != "reduce-overhead":
            return
        # accelerate compiles the model it prepares with this plugin's kwargs; torch takes
        # options or a mode, not both. The plugin outlives this Trainer on accelerate's
        # shared state (a second Trainer of the same args keeps it): set both ways.
        plugin = self.accelerator.state.dynamo_plugin
        if takes_cuda_graphs(self.dist_state, self.args.dataloader_drop_last):
            plugin.mode, plugin.options = None, cuda_graph_options()
        else:
            plugin.mode, plugin.options = "reduce-overhead", None

    def _maybe_log_save_evaluate(self, tr_loss, *args, **kwargs):
        if self.control.should_log and self._loss_filter is not None:
            self._loss_filter.reset()  # Hugging Face logs tr_loss and zeroes it
        return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def get_train_dataloader(self):
        """Train loader: shuffled and balanced by rows every epoch; user-given loaders as is."""
        if self.train_dataloader is not None:
            return self.train_dataloader
        # train_batch_size is per_device_train_batch_size x GPUs under DataParallel (HF's meaning).
        loader = self._merlin_loader(self.train_dataset_or_path, self.args.train_batch_size, "train")
        if self._resume_from is not None:
            place_loader(loader, self._resume_from, self.args.gradient_accumulation_steps)
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        """Eval loader sharded by global rank, every row once (ranks may differ by a batch).

        ``eval_dataset`` (path, ``os.PathLike``, list of them or
        ``merlin.io.Dataset``) replaces ``eval_dataset_or_path`` when given.
        """
        if self.eval_dataloader is not None:
            return self.eval_dataloader
        path = eval_dataset if eval_dataset is not None else self.eval_dataset_or_path
        return self._merlin_loader(path, self.args.eval_batch_size, "eval")

    def get_test_dataloader(self, test_dataset=None):
        """Test loader sharded by global rank."""
        if self.test_dataloader is not None:
            return self.test_dataloader
        path = test_dataset if test_dataset is not None else self.test_dataset_or_path
        return self._merlin_loader(path, self.args.eval_batch_size, "test")

    def num_examples(self, dataloader) -> int:
        """Batches times batch size, as T4R estimates it (for Hugging Face's logs)."""
        return len(dataloader) * dataloader.batch_size

    # ---- training and evaluation steps ---------------------------------------------------

    def _prepare_input(self, data):
        """Hugging Face's, with tensors copied to a GPU ``non_blocking``: from the loader's
        pinned memory the copy then overlaps the GPU's work (DeepSpeed's dtype casts stay its
        own). A copy to the CPU blocks, as Hugging Face's does: the step reads it at once."""
        if isinstance(data, torch.Tensor) and not self.is_deepspeed_enabled:
            return data.to(self.args.device, non_blocking=self.args.device.type == "cuda")
        return super()._prepare_input(data)

    def _wrap_model(self, model, training=True, dataloader=None):
        """Hugging Face's wrapping, except DataParallel replicas return exact loss sums, and
        under DDP unused parameters are settled as ``fit`` settles them.

        With ``args.ddp_find_unused_parameters`` None (Hugging Face would pass True for a
        T4R model) one probe batch finds the parameters no rank uses; they are frozen
        while :meth:`train` runs and DDP gets ``find_unused_parameters=False`` unless the
        ranks disagree (:mod:`~merlin_t4r_ops.training.policy`).
        """
        if self.dist_state.strategy == "dp":
            return model if isinstance(model, torch.nn.DataParallel) else data_parallel(
                unwrap_model(model)
            )
        asked = self.args.ddp_find_unused_parameters
        if not (training and self.dist_state.is_distributed and asked is None):
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        find_unused, frozen = settle_unused_parameters(
            unwrap_model(model), self._probe_loader(), self.dist_state, None)
        self._frozen.update(frozen)
        self.args.ddp_find_unused_parameters = find_unused
        try:
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        finally:
            self.args.ddp_find_unused_parameters = asked

    def _probe_loader(self):
        """The train data at its first epoch's start, apart from the loader that trains."""
        if self.train_dataloader is not None:
            return self.train_dataloader
        return self._merlin_loader(self.train_dataset_or_path, self.args.train_batch_size, "train")

    def compute_loss(self, model, inputs, return_outputs=False):
        """T4R's ``compute_loss``, exact under DataParallel and DDP (:func:`rank_loss`).

        Under DDP the loss backpropagated on a rank is its share of the global batch's
        loss; Hugging Face logs the mean over ranks, which is that loss.
        """
        features, targets = inputs
        outputs = forward_batch(model, features, targets, training=True)
        if "loss" not in outputs:
            raise ValueError(
                "The model did not return a loss from the inputs, only the following keys: "
                f"{','.join(outputs.keys())}"
            )
        loss = rank_loss(outputs, unwrap_model(model), self.dist_state)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self,
        model,
        inputs,
        prediction_loss_only: bool,
        ignore_keys: Optional[List[str]] = None,
        training: bool = False,
        testing: bool = True,
    ):
        """T4R's ``prediction_step``, with the batch's exact loss under DataParallel.

        Returns
        -------
        tuple
            ``(loss, predictions, labels, loss_statistics)`` like T4R's, except
            the last item (always ``None`` in T4R): when ``testing``, a dict
            with the batch's ``loss_sum`` and ``n_targets`` (``[1, tasks]``), from
            which evaluation weights batches by their targets.
        """
        features, targets = self._prepare_inputs(inputs)
        with torch.no_grad(), self._evaluation_autocast():
            outputs = forward_batch(model, features, targets, training=training, testing=testing)
        if not testing:
            return None, (None if prediction_loss_only else nested_detach(outputs)), None, None
        loss_sum, n_targets = loss_sum_and_count(outputs, unwrap_model(model))
        # In ReplicaLoss's [replicas, tasks] layout, which MetricAccumulator.update sums.
        stats = {"loss_sum": loss_sum.detach().reshape(1, -1),
                 "n_targets": n_targets.detach().reshape(1, -1)}
        loss = batch_loss(outputs).detach()
        if prediction_loss_only:
            return loss, None, None, stats
        return loss, nested_detach(outputs["predictions"]), nested_detach(outputs["labels"]), stats

    def _evaluation_autocast(self):
        """Autocast to ``args``' half precision on CUDA (bfloat16 under ``bf16``).

        Hugging Face 4.30 sets ``use_cuda_amp`` only with sharded DDP; otherwise training
        autocasts through accelerate's patched ``forward``, which evaluation never prepares,
        so evaluation decides here from the arguments themselves.
        """
        if not (self.args.bf16 or self.args.fp16) or self.args.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16 if self.args.bf16 else torch.float16)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: Optional[bool] = None,
        ignore_keys: Optional[List[str]] = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Evaluate (exact metrics over all ranks) or predict (top-k, gathered to rank 0).

        ``evaluate()`` always reports ``{prefix}_/loss``, the mean over all
        targets, and with ``compute_metrics`` every metric of the model's
        tasks, identical on every rank. Its predictions are not kept: Hugging
        Face's ``evaluate()`` discards them. ``predict()`` returns what T4R's
        returns (see :mod:`~merlin_t4r_ops.training.predictions`); under DDP
        rank 0 receives every rank's rows in rank order and the other ranks
        get ``predictions=None``. There is no collective per batch, so ranks
        may hold different numbers of batches.
        """
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        testing = description != "Prediction"
        core = unwrap_model(self.model)
        model = self._wrap_model(core, training=False, dataloader=dataloader)
        model.eval()
        self.callback_handler.eval_dataloader = dataloader

        with_metrics = testing and bool(self.compute_metrics)
        keep_predictions = not testing and not prediction_loss_only
        next_items = [n for n, t in prediction_tasks(core) if isinstance(t, NextItemPredictionTask)]
        if keep_predictions and next_items:
            check_top_k(self.args.predict_top_k, core.top_k)
        acc = MetricAccumulator(core, self.dist_state)
        predictions, n_rows = [], 0
        max_steps = self.args.eval_steps_on_train_set if metric_key_prefix == "train" else 0
        with batches_of(dataloader) as batches:
            for step, inputs in enumerate(itertools.islice(batches, max_steps or None)):
                n_rows += find_batch_size(inputs) or 0
                _, preds, labels, stats = self.prediction_step(
                    model, inputs, not (with_metrics or keep_predictions), ignore_keys, testing=testing
                )
                if testing:
                    # As T4R's loop: task metrics every compute_metrics_each_n_steps batches.
                    every_n = step % self.args.compute_metrics_each_n_steps == 0
                    batch_metrics = acc.update({**stats, "predictions": preds, "labels": labels},
                                               with_metrics=with_metrics and every_n)
                    if preds is not None:
                        self._log_batch(core, preds, labels, next_items, metric_key_prefix,
                                        batch_metrics)
                elif keep_predictions:
                    top_k = select_top_k(preds, next_items, self.args.predict_top_k, core.top_k)
                    predictions.append(send_to_device(top_k, "cpu"))
                self.control = self.callback_handler.on_prediction_step(
                    self.args, self.state, self.control
                )

        metrics = {}
        if testing:
            computed = acc.compute(with_metrics)  # a collective under DDP: every rank reaches it
            metrics = {f"{metric_key_prefix}_/{k}": v for k, v in computed.items()}
        return EvalLoopOutput(
            # Same condition on every rank: the gather is a collective.
            predictions=gather_to_main(predictions, self.dist_state) if keep_predictions else None,
            label_ids=None,
            metrics=metrics,
            num_samples=self._global_sum(n_rows),
        )

    def _log_batch(self, core, preds, labels, next_items, metric_key_prefix,
                   batch_metrics) -> None:
        """T4R's ``args.log_predictions``: a batch's top-k to ``log_predictions_callback``.

        As T4R's loop does: only with a top-k (``predict_top_k``, or a model
        whose output is already its top-k), with this rank's labels of the
        next-item task and ``batch_metrics``, the batch's
        ``model.calculate_metrics`` (``None`` between every
        ``compute_metrics_each_n_steps`` batches).
        """
        if not (self.args.log_predictions and self.log_predictions_callback and next_items):
            return
        top_k = select_top_k(preds, next_items, self.args.predict_top_k, core.top_k)
        next_item = top_k[next_items[0]] if isinstance(top_k, dict) else top_k
        if not isinstance(next_item, tuple):  # full scores: T4R logs nothing
            return
        ids, scores = next_item
        labels = labels[next_items[0]] if isinstance(labels, dict) else labels
        self._maybe_log_predictions(labels, ids, scores, batch_metrics, metric_key_prefix)

    def _global_sum(self, n: int) -> int:
        if not self.dist_state.is_distributed:
            return int(n)
        total = torch.tensor([n], dtype=torch.float64, device=self.dist_state.device)
        dist.all_reduce(total)
        return int(total.item())

    # ---- saving / logging -----------------------------------------------------------------

    def _save_checkpoint(self, model, trial, metrics=None):
        """Hugging Face's checkpoint, with RNG states that load with ``weights_only=True``."""
        super()._save_checkpoint(model, trial, metrics=metrics)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        save_rng_state(os.path.join(self._get_output_dir(trial=trial), folder), self.args)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Hugging Face's, with the optimizer state mapped to this process's device."""
        if checkpoint is not None:
            load_optimizer_and_scheduler(self, checkpoint, self.dist_state.device)

    def _load_rng_state(self, checkpoint):
        """Read the RNG states :meth:`_save_checkpoint` wrote, with ``weights_only=True``."""
        if checkpoint is not None:
            load_rng_state(checkpoint, self.args)

    def _save_model_and_checkpoint(self, save_model_class=False):
        # T4R writes the pickled model class from every rank into the same directory.
        super()._save_model_and_checkpoint(
            save_model_class=save_model_class and self.dist_state.is_main_process
        )
        self.dist_state.barrier()


# ---- helpers ----------------------------------------------------------------------------------


def _align_args(args: T4RecTrainingArguments, state: DistributedState) -> None:
    """Check ``args`` agree with ``state``; on a multi-GPU host make "single" really single."""
    mode = args.parallel_mode
    if state.strategy == "ddp":
        if mode != ParallelMode.DISTRIBUTED or args.world_size != state.world_size:
            raise StrategyError(
                f"strategy resolved to 'ddp' with world_size={state.world_size}, but the training "
                f"arguments see parallel_mode={mode.value!r}, world_size={args.world_size}; "
                "build the T4RecTrainingArguments inside the torchrun-launched process"
            )
    elif mode == ParallelMode.DISTRIBUTED:
        raise StrategyError(
            f"strategy resolved to {state.strategy!r}, but the training arguments see a "
            f"distributed launch (world_size={args.world_size}); use strategy='ddp' or 'auto' "
            "under torchrun"
        )
    elif state.strategy == "dp":
        if args.n_gpu < 2:
            raise StrategyError(
                f"strategy='dp' needs the training arguments to use >= 2 GPUs, found "
                f"n_gpu={args.n_gpu} (no_cuda={args.no_cuda})"
            )
    elif args.n_gpu > 1:
        # Hugging Face wraps in DataParallel whenever n_gpu > 1.
        args._n_gpu = 1
