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
    return list(make_loader(MUSIC.path, model, resolve_strategy("single"), batch_size=250, schema=schema))


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
