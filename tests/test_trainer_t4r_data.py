"""The project's Trainer and loaders on the test data that T4R's wheel ships.

T4R's ``music_streaming`` data carries its targets (``click``, ``play_percentage``,
``like``, tagged TARGET) beside the features, and a model built with
``TabularSequenceFeatures.from_schema`` lists them in its input schema, as T4R's own
``test_trainer.py`` builds it. Each session holds 20 items, so a width of 20 crops
nothing and both trainers see the same rows.
"""

import numpy as np
import pandas as pd
import pytest
import torch
import torchmetrics as tm
import transformers4rec.torch as tr
from merlin.schema import Tags
from transformers4rec.config import trainer as tconfig
from transformers4rec.config import transformer as tconf
from transformers4rec.torch import Trainer as T4RTrainer

from merlin_t4r_ops.training import Trainer, make_loader, resolve_strategy

pytestmark = pytest.mark.usefixtures("no_launcher_env")
MUSIC = tr.data.music_streaming_testing_data
WIDTH = 20


def music_model(task, schema=MUSIC.merlin_schema):
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=WIDTH, d_output=64, masking="mlm"
    )
    return tconf.XLNetConfig.build(64, 4, 2, WIDTH).to_torch_model(inputs, task)


def music_args(output_dir):
    return tconfig.T4RecTrainingArguments(
        output_dir=str(output_dir), max_steps=5, per_device_eval_batch_size=8,
        data_loader_engine="merlin_dataloader", max_sequence_length=WIDTH, report_to=[],
        no_cuda=True,
    )


def batches(model, schema=MUSIC.merlin_schema):
    return list(make_loader(MUSIC.path, model, resolve_strategy("single"), batch_size=250,
                            schema=schema, device_batches=False))


def test_the_task_target_is_the_batch_target_and_no_target_is_a_feature():
    model = music_model(tr.BinaryClassificationTask("click", summary_type="mean"))
    loaded = batches(model)
    targets = np.concatenate([y.numpy() for _, y in loaded])
    np.testing.assert_array_equal(targets, pd.read_parquet(MUSIC.path)["click"].to_numpy())
    features = set(loaded[0][0])
    assert not features & {"click", "play_percentage", "like"}
    assert {"item_id", "item_category", "user_id"} <= features


def test_a_feature_that_the_data_tags_as_target_stays_a_feature():
    model = music_model(tr.NextItemPredictionTask(weight_tying=True))
    data_schema = MUSIC.merlin_schema.copy()
    data_schema["item_recency"] = data_schema["item_recency"].with_tags(Tags.TARGET)
    x, y = batches(model, data_schema)[0]
    assert x["item_recency"].shape == (250, WIDTH)
    assert y is None


@pytest.mark.parametrize("schema", [MUSIC.schema, MUSIC.merlin_schema], ids=["msl", "core"])
def test_binary_classification_evaluates_as_t4r_does(schema, tmp_path):
    model = music_model(tr.BinaryClassificationTask("click", summary_type="mean"), schema)
    common = dict(model=model, schema=schema, eval_dataset_or_path=MUSIC.path,
                  compute_metrics=True)
    ours = Trainer(args=music_args(tmp_path / "ours"), strategy="single", **common)
    theirs = T4RTrainer(args=music_args(tmp_path / "theirs"), **common)
    our_metrics, their_metrics = ours.evaluate(), theirs.evaluate()
    metric_names = [k for k in their_metrics if k.startswith("eval_/")]
    assert "eval_/click/binary_classification_task/binary_accuracy" in metric_names
    for name in metric_names:
        assert our_metrics[name] == pytest.approx(their_metrics[name], rel=1e-5), name


def _binary_auroc_accuracy():
    return tr.BinaryClassificationTask("click", summary_type="mean", metrics=(
        tm.AUROC(task="binary"), tm.Accuracy(task="binary")))


def _regression_mae_rmse():
    return tr.RegressionTask("play_percentage", summary_type="mean", metrics=(
        tm.MeanAbsoluteError(), tm.MeanSquaredError(squared=False)))


TASKS = {
    "next-item": lambda: [tr.NextItemPredictionTask(weight_tying=True, metrics=[
        tr.ranking_metric.NDCGAt(top_ks=[2, 5], labels_onehot=True),
        tr.ranking_metric.RecallAt(top_ks=[2, 5], labels_onehot=True)])],
    "binary-auroc": lambda: [_binary_auroc_accuracy()],
    "regression-mae-rmse": lambda: [_regression_mae_rmse()],
    "multi-task": lambda: [_binary_auroc_accuracy(), _regression_mae_rmse()],
}


@pytest.mark.parametrize("task", list(TASKS))
def test_task_metrics_are_the_tasks_own_with_t4rs_keys_and_values(task, tmp_path):
    """What the task asks for (AUROC, MAE, RMSE, ...), as T4R's Trainer reports it.

    The loss is left out of the values: ours is the exact mean over all targets,
    T4R's the mean of per-batch means (the last batch of 100 rows holds 4).
    """
    torch.manual_seed(0)
    inputs = tr.TabularSequenceFeatures.from_schema(
        MUSIC.merlin_schema, max_sequence_length=WIDTH, d_output=64, masking="mlm")
    # A Head of several tasks, as to_torch_model builds one from a single task.
    config = tconf.XLNetConfig.build(64, 4, 2, WIDTH)
    transformer = tr.TransformerBlock(config, masking=inputs.masking)
    model = tr.Head(tr.SequentialBlock(inputs, transformer), TASKS[task]()).to_model()
    common = dict(model=model, schema=MUSIC.merlin_schema, eval_dataset_or_path=MUSIC.path,
                  compute_metrics=True)
    ours = Trainer(args=music_args(tmp_path / "ours"), strategy="single", **common).evaluate()
    theirs = T4RTrainer(args=music_args(tmp_path / "theirs"), **common).evaluate()
    assert ours.keys() == theirs.keys()
    asked = {"next-item": "ndcg_at_5", "binary-auroc": "binary_auroc",
             "regression-mae-rmse": "mean_squared_error", "multi-task": "mean_absolute_error"}
    assert any(k.endswith(asked[task]) for k in ours), sorted(ours)
    for name, value in theirs.items():
        if name.startswith("eval_/") and name != "eval_/loss":
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


# ---- T4R's errors before a loader is built ----------------------------------------------------


@pytest.mark.parametrize("trainer_class", [Trainer, T4RTrainer], ids=["ours", "t4r"])
@pytest.mark.parametrize("split", ["train", "eval", "test"])
def test_a_loader_without_schema_fails_with_t4rs_assertion(split, trainer_class, tmp_path):
    model = music_model(tr.NextItemPredictionTask(weight_tying=True))
    datasets = {f"{name}_dataset_or_path": MUSIC.path for name in ("train", "eval", "test")}
    trainer = trainer_class(model=model, args=music_args(tmp_path), **datasets)
    with pytest.raises(AssertionError, match=f"schema is required to generate "
                                             f"{split.title()} Dataloader"):
        getattr(trainer, f"get_{split}_dataloader")()


@pytest.mark.parametrize("trainer_class", [Trainer, T4RTrainer], ids=["ours", "t4r"])
def test_a_test_loader_without_data_fails_with_t4rs_value_error(trainer_class, tmp_path):
    model = music_model(tr.NextItemPredictionTask(weight_tying=True))
    trainer = trainer_class(model=model, args=music_args(tmp_path), schema=MUSIC.schema)
    with pytest.raises(ValueError, match="Trainer: test requires an test_dataset."):
        trainer.get_test_dataloader()


def test_a_trainer_that_steps_on_the_cpu_of_a_gpu_host_gets_its_batches_on_the_host(tmp_path):
    """``no_cuda=True`` on a GPU host: the resolved state names the GPU, Hugging Face steps on
    the CPU. The loader must not make the batches on the GPU (the state's device is set here
    as such a host resolves it; nothing touches CUDA before a batch is read)."""
    from merlin_t4r_ops.training import DistributedState

    model = music_model(tr.BinaryClassificationTask("click", summary_type="mean"))
    trainer = Trainer(args=music_args(tmp_path), strategy="single", model=model,
                      schema=MUSIC.merlin_schema, train_dataset_or_path=MUSIC.path)
    trainer.dist_state = DistributedState("single", 0, 0, 1, torch.device("cuda:0"), "GPU host")
    assert trainer.args.device == torch.device("cpu")
    assert trainer.get_train_dataloader().device_batches is False
