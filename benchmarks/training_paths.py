"""The training paths that ``benchmarks/training.py`` compares, on one model and one data set.

Every path trains the same T4R model (T4R's README model: continuous projection,
``MLPBlock``, XLNet with 2 layers, causal next-item, weight tying) on the same copies of
T4R's packaged ``tabular_sequence_testing_data``, one epoch at most, with ``drop_last``
so that every step holds ``batch_size`` rows. A :class:`StepClock`, called after each
optimizer step through torch's global optimizer hook, times the steps after the warm-up
and stops the path at its time limit: the Hugging Face trainers through a callback
(``should_training_stop``), ``fit`` by an exception out of the step (its loaders close
their passes), the bare loops by looking at the clock.
"""

import contextlib
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

MAX_SEQUENCE_LENGTH = 20
N_HEAD = 4


class TimeUp(Exception):
    """Raised out of ``fit``'s optimizer step when the path's time is up."""


class Unsupported(Exception):
    """This checkout or machine cannot run the path; the message says why."""


class StepClock:
    """Counts one run's optimizer steps, times those after the warm-up, says when to stop.

    The window opens after ``warmup_steps`` steps and closes at the last step; the GPU is
    synchronised when it opens and when the time limit closes it, never in between, so
    the clock adds no host sync to the paths that avoid one. A run that ends by itself
    closes the window at its last step's host time (the GPU may trail it by a few steps).

    Parameters
    ----------
    rows_per_step : int
    warmup_steps : int
    time_limit : float
        Seconds of timed steps after which the run is stopped.
    max_steps : int, optional
        Stop after this many steps in all (the profiler's runs).
    on_step : callable, optional
        Called after each step (``torch.profiler``'s ``step``).
    """

    def __init__(self, rows_per_step, warmup_steps, time_limit, max_steps=None, on_step=None):
        self.rows_per_step, self.warmup_steps = rows_per_step, warmup_steps
        self.time_limit, self.max_steps, self.on_step = time_limit, max_steps, on_step
        self.steps, self.start, self.end, self.done = 0, None, None, False
        self.raise_when_done = False

    @property
    def timed_steps(self) -> int:
        return max(0, self.steps - self.warmup_steps) if self.end is not None else 0

    @property
    def seconds(self) -> Optional[float]:
        return None if self.end is None else self.end - self.start

    @property
    def samples_per_s(self) -> Optional[float]:
        if not self.timed_steps:
            return None
        return self.timed_steps * self.rows_per_step / self.seconds

    def tick(self) -> None:
        self.steps += 1
        if self.on_step is not None:
            self.on_step()
        if self.steps == self.warmup_steps:
            _synchronize()
            self.start = time.perf_counter()
            return
        if self.start is None:
            return
        self.end = time.perf_counter()
        over_time = self.end - self.start >= self.time_limit
        if over_time or (self.max_steps is not None and self.steps >= self.max_steps):
            _synchronize()
            self.end, self.done = time.perf_counter(), True
        if self.done and self.raise_when_done:
            raise TimeUp()

    @contextlib.contextmanager
    def hooked(self, raise_when_done: bool = False):
        """Tick after every optimizer step taken inside the block."""
        self.raise_when_done = raise_when_done
        handle = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: self.tick()
        )
        try:
            yield self
        except TimeUp:
            pass
        finally:
            handle.remove()


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---- the data and the model -----------------------------------------------------------------


def t4r_schema():
    """T4R's own (``merlin_standard_lib``) schema of ``tabular_sequence_testing_data``."""
    from transformers4rec.data import tabular_sequence_testing_data

    return tabular_sequence_testing_data.schema


def write_copies(folder: str, copies: int, n_files: int = 8) -> List[str]:
    """``copies`` copies of T4R's testing data in ``n_files`` parquet files + ``schema.pbtxt``."""
    import pandas as pd
    from merlin.schema.io.tensorflow_metadata import TensorflowMetadata
    from transformers4rec.data import tabular_sequence_testing_data

    from merlin_t4r_ops.sequence import core_schema

    os.makedirs(folder, exist_ok=True)
    frame = pd.read_parquet(tabular_sequence_testing_data.path)
    frame = pd.concat([frame] * copies, ignore_index=True)
    files = []
    for part in range(n_files):
        path = os.path.join(folder, f"part_{part:02d}.parquet")
        frame.iloc[part::n_files].to_parquet(path, index=False)
        files.append(path)
    TensorflowMetadata.from_merlin_schema(core_schema(t4r_schema())).to_proto_text_file(folder)
    return files


def build_model(d_model: int, n_layer: int = 2, seed: int = 0):
    """T4R's README next-item model over every feature of the testing data."""
    import transformers4rec.torch as tr

    torch.manual_seed(seed)
    inputs = tr.TabularSequenceFeatures.from_schema(
        t4r_schema(), max_sequence_length=MAX_SEQUENCE_LENGTH, continuous_projection=d_model,
        aggregation="concat", masking="causal",
    )
    config = tr.XLNetConfig.build(d_model=d_model, n_head=N_HEAD, n_layer=n_layer,
                                  total_seq_length=MAX_SEQUENCE_LENGTH)
    body = tr.SequentialBlock(inputs, tr.MLPBlock([d_model]),
                              tr.TransformerBlock(config, masking=inputs.masking))
    head = tr.Head(body, tr.NextItemPredictionTask(weight_tying=True), inputs=inputs)
    return tr.Model(head)


@dataclass
class Setting:
    """What every path shares in one benchmark run."""

    files: List[str]
    batch_size: int
    d_model: int
    device: torch.device
    scratch: str
    lr: float = 1e-3
    num_workers: Optional[int] = None
    cached: Dict[int, list] = field(default_factory=dict)

    def model(self):
        return build_model(self.d_model)


# ---- the paths --------------------------------------------------------------------------------


def _stop_when_done(clock):
    from transformers import TrainerCallback

    class StopWhenDone(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = clock.done

    return StopWhenDone()


@contextlib.contextmanager
def process_settings_kept():
    """The process's compile settings as they were before a path ran.

    A ``TrainingArguments`` with ``torch_compile`` leaves them behind: the
    ``ACCELERATE_DYNAMO_*`` variables, which every later Trainer's accelerate reads (it then
    compiles too), and TF32 matmuls. Paths run one after another in one process.
    """
    variables = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_DYNAMO_")}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
            del os.environ[name]
        os.environ.update(variables)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _training_args(setting: Setting, **overrides):
    from transformers4rec.config.trainer import T4RecTrainingArguments

    return T4RecTrainingArguments(**overrides,
        output_dir=setting.scratch, per_device_train_batch_size=setting.batch_size,
        num_train_epochs=1, max_sequence_length=MAX_SEQUENCE_LENGTH,
        data_loader_engine="merlin_dataloader", report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_drop_last=True, learning_rate=setting.lr,
        no_cuda=setting.device.type != "cuda", disable_tqdm=True, seed=0,
        dataloader_num_workers=setting.num_workers or 0,
    )


def _t4r_trainer(setting: Setting, clock: StepClock = None):
    from transformers4rec.torch import Trainer as T4RTrainer

    callbacks = [] if clock is None else [_stop_when_done(clock)]
    return _quiet(T4RTrainer(model=setting.model(), args=_training_args(setting),
                             schema=t4r_schema(), train_dataset_or_path=setting.files,
                             callbacks=callbacks))


def _quiet(trainer):
    """Without Hugging Face's printing of the logs (``disable_tqdm`` prints a dict a run)."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


@contextlib.contextmanager
def _t4r_loader(trainer):
    """T4R's own train loader, whose reading thread is stopped at the end (T4R leaves it)."""
    loader = trainer.get_train_dataloader()
    try:
        yield loader
    finally:
        loader.dataset.stop()


def run_t4r_trainer(setting: Setting, clock: StepClock) -> None:
    """``transformers4rec.torch.Trainer.train()``, T4R's Merlin loader and Hugging Face's loop."""
    trainer = _t4r_trainer(setting, clock)
    with _t4r_loader(trainer) as loader, clock.hooked():
        trainer.train_dataloader = loader  # T4R's Trainer reads a loader given to it
        trainer.train()


def _our_trainer(setting: Setting, clock: StepClock, model=None, **args_overrides):
    """Our ``Trainer`` (strategy single) on ``setting``'s files, stopped by ``clock``."""
    from merlin_t4r_ops.training import Trainer

    return _quiet(Trainer(model=model if model is not None else setting.model(),
                          args=_training_args(setting, **args_overrides),
                          strategy="single", schema=t4r_schema(),
                          train_dataset_or_path=setting.files,
                          callbacks=[_stop_when_done(clock)]))


def _our_trainer_runner(**args_overrides) -> Callable[[Setting, StepClock], None]:
    def run(setting: Setting, clock: StepClock) -> None:
        """``merlin_t4r_ops.training.Trainer.train()`` (strategy single)."""
        trainer = _our_trainer(setting, clock, **args_overrides)
        with clock.hooked():
            trainer.train()

    return run


run_our_trainer = _our_trainer_runner()


def run_our_trainer_compile_mode_alone(setting: Setting, clock: StepClock) -> None:
    """``trainer-compile`` as Hugging Face 4.30 asks accelerate to compile: mode
    ``"reduce-overhead"`` alone, CUDA graphs recorded for every shape."""
    trainer = _our_trainer(setting, clock, torch_compile=True,
                           torch_compile_mode="reduce-overhead")
    plugin = trainer.accelerator.state.dynamo_plugin
    plugin.mode, plugin.options = "reduce-overhead", None
    with clock.hooked():
        trainer.train()


class _CachedEpoch:
    """An epoch of ``fit``'s batches already on the device, cycled: a train loader that
    costs the Trainer's loop nothing, so ``trainer-cached`` is Hugging Face's loop alone."""

    def __init__(self, batches: list, steps: int, batch_size: int):
        self.batches, self.steps, self.batch_size = batches, steps, batch_size

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return (self.batches[step % len(self.batches)] for step in range(self.steps))


def train_on_cached_batches(setting: Setting, clock: StepClock, steps: int):
    """Our ``Trainer.train()`` (its defaults) over ``steps`` batches already on the device;
    returns the trainer, its model and the batches."""
    model = setting.model()
    trainer = _our_trainer(setting, clock, model)
    batches = _cached_batches(setting, model)
    trainer.train_dataloader = _CachedEpoch(batches, steps, setting.batch_size)
    with clock.hooked():
        trainer.train()
    return trainer, model, batches


def run_our_trainer_cached(setting: Setting, clock: StepClock) -> None:
    """Our ``Trainer.train()`` over batches already on the device (its defaults otherwise)."""
    train_on_cached_batches(setting, clock, _epoch_rows(setting) // setting.batch_size)


def _fit_runner(**options) -> Callable[[Setting, StepClock], None]:
    def run(setting: Setting, clock: StepClock) -> None:
        from merlin_t4r_ops.training import fit

        kwargs = dict(options)
        accepted = inspect.signature(fit).parameters
        for name in kwargs:
            if name not in accepted:
                raise Unsupported(f"fit has no {name}= option in this checkout")
        if isinstance(kwargs.get("amp"), str) and accepted["amp"].annotation is bool:
            raise Unsupported(f"fit's amp= takes a bool in this checkout, not {kwargs['amp']!r}")
        if kwargs.get("amp") in (True, "fp16") and setting.device.type != "cuda":
            raise Unsupported("fp16 autocast with GradScaler needs CUDA")
        if setting.num_workers is not None and "num_workers" in accepted:
            kwargs.setdefault("num_workers", setting.num_workers)
        model = setting.model()
        with clock.hooked(raise_when_done=True):
            fit(model, setting.files, epochs=1, batch_size=setting.batch_size, lr=setting.lr,
                strategy="single", seed=0, drop_last=True, progress=False, **kwargs)

    return run


def _bare_step(model, optimizer, x, y) -> None:
    """T4R's own training step: no loss read back, no host sync."""
    loss = model(x, targets=y, training=True)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_t4r_loader(setting: Setting, clock: StepClock) -> None:
    """A bare loop over T4R's own Merlin loader: the loader's pace with the model's step."""
    from merlin_t4r_ops.training.data import to_device

    model = setting.model().to(setting.device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=setting.lr)
    with _t4r_loader(_t4r_trainer(setting)) as loader, clock.hooked():
        for x, y in loader:
            _bare_step(model, optimizer, to_device(x, setting.device), to_device(y, setting.device))
            if clock.done:
                break


def _cached_batches(setting: Setting, model, limit: int = 64) -> list:
    """Up to ``limit`` of ``fit``'s own batches, already on the device (kept for every round)."""
    from merlin_t4r_ops.training import make_loader, resolve_strategy
    from merlin_t4r_ops.training.data import batches_of, to_device

    if setting.batch_size not in setting.cached:
        loader = make_loader(setting.files, model, resolve_strategy("single"),
                             batch_size=setting.batch_size, drop_last=True)
        batches = []
        with batches_of(loader) as passing:
            for x, y in passing:
                batches.append((to_device(x, setting.device), to_device(y, setting.device)))
                if len(batches) == limit:
                    break
        setting.cached[setting.batch_size] = batches
    return setting.cached[setting.batch_size]


def _adam(fused: bool):
    def make(params, lr):
        return torch.optim.Adam(params, lr=lr, **({"fused": True} if fused else {}))
    return make


def _hugging_face_adamw(params, lr):
    """``optim="adamw_hf"``'s class, T4R's default (weight_decay 0): a loop per parameter."""
    from transformers.optimization import AdamW

    return AdamW(params, lr=lr, no_deprecation_warning=True)


def _trainer_adamw(params, lr):
    """What our Trainer steps for ``optim="adamw_hf"``: the same AdamW, one launch per list."""
    from merlin_t4r_ops.training.hf_adamw import MultiTensorAdamW

    return MultiTensorAdamW(params, lr=lr, no_deprecation_warning=True)


def _cached_runner(make_optimizer, max_grad_norm: float = 0.0
                   ) -> Callable[[Setting, StepClock], None]:
    def run(setting: Setting, clock: StepClock) -> None:
        model = setting.model().to(setting.device).train()
        batches = _cached_batches(setting, model)
        steps = _epoch_rows(setting) // setting.batch_size  # one epoch, as the loader paths
        optimizer = make_optimizer(model.parameters(), setting.lr)
        if max_grad_norm:  # clip between backward and step, as Hugging Face's loop does
            def clip(*_):
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.register_step_pre_hook(clip)
        with clock.hooked():
            for step in range(steps):
                _bare_step(model, optimizer, *batches[step % len(batches)])
                if clock.done:
                    break

    return run


def _epoch_rows(setting: Setting) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in setting.files)


PATHS: Dict[str, Callable[[Setting, StepClock], None]] = {
    "t4r-trainer": run_t4r_trainer,
    "trainer": run_our_trainer,
    # Hugging Face's default logging_nan_inf_filter reads each step's loss: a host sync a step.
    "trainer-no-nan-filter": _our_trainer_runner(logging_nan_inf_filter=False),
    # Hugging Face 4.30's default optim, "adamw_hf", steps each parameter in a Python loop
    # (7 kernels a parameter); torch's fused AdamW steps them all in one launch.
    "trainer-fused": _our_trainer_runner(optim="adamw_torch_fused"),
    "trainer-fused-no-nan-filter": _our_trainer_runner(optim="adamw_torch_fused",
                                                       logging_nan_inf_filter=False),
    # ... and no gradient clipping (Hugging Face's max_grad_norm=1.0) alone.
    "trainer-fused-no-clip": _our_trainer_runner(optim="adamw_torch_fused", max_grad_norm=0.0),
    # ... and no gradient clipping (Hugging Face's max_grad_norm=1.0): fit's computation.
    "trainer-as-fit": _our_trainer_runner(optim="adamw_torch_fused", logging_nan_inf_filter=False,
                                          max_grad_norm=0.0),
    # Our Trainer with Hugging Face's torch_compile (accelerate compiles the model it
    # prepares) in mode "reduce-overhead": CUDA graphs except for the graphs whose shapes
    # change per batch, as fit(compile=True) (Trainer.create_accelerator_and_postprocess).
    "trainer-compile": _our_trainer_runner(torch_compile=True,
                                           torch_compile_mode="reduce-overhead"),
    # ... with the mode alone, CUDA graphs for every graph, as Hugging Face 4.30 asks it.
    "trainer-compile-mode-alone": run_our_trainer_compile_mode_alone,
    # Our Trainer, its defaults, over batches already on the device: its loop alone.
    "trainer-cached": run_our_trainer_cached,
    "fit": _fit_runner(),
    "fit-fp16": _fit_runner(amp=True),
    "fit-bf16": _fit_runner(amp="bf16"),
    "t4r-loader": run_t4r_loader,
    "cached": _cached_runner(_adam(fused=False)),
    # optional, not in the default set
    "fit-compile": _fit_runner(compile=True),
    "fit-bf16-compile": _fit_runner(amp="bf16", compile=True),
    "cached-fused": _cached_runner(_adam(fused=True)),
    # The model's own pace with the Trainer's default step: adamw_hf and max_grad_norm=1.0,
    # stepped as our Trainer steps it, and as Hugging Face's class does (T4R's Trainer).
    "cached-trainer-step": _cached_runner(_trainer_adamw, max_grad_norm=1.0),
    "cached-hf-step": _cached_runner(_hugging_face_adamw, max_grad_norm=1.0),
}
DEFAULT_PATHS = ["t4r-trainer", "trainer", "fit", "fit-fp16", "fit-bf16", "t4r-loader", "cached"]


def workers_path(workers: int) -> Callable[[Setting, StepClock], None]:
    """``fit`` fp32 with ``num_workers=workers`` (for ``--workers-sweep``)."""
    return _fit_runner(num_workers=workers)
