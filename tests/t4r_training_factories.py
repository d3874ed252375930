"""Tiny synthetic session data and T4R models shared by the training tests and benchmark.

Data is written as parquet with a Merlin ``schema.pbtxt`` next to it, the way
an NVTabular workflow would leave it, so ``merlin.io.Dataset(path)`` picks the
schema up. Models are small (d_model 16-32, 1-2 layers) so a CPU test trains in
seconds; dropout is 0 so runs are deterministic given the seed.
"""

import os

import numpy as np
import pandas as pd
import transformers4rec.torch as tr
from merlin.io import Dataset
from merlin.schema import ColumnSchema, Schema, Tags
from merlin.schema.io.tensorflow_metadata import TensorflowMetadata

N_ITEMS = 50
N_CATEGORIES = 8
MAX_LEN = 10


def session_schema(n_items=N_ITEMS):
    """Merlin schema of the synthetic sessions (item-id list, category list, two targets)."""
    list_props = {"value_count": {"min": 2, "max": MAX_LEN}}
    return Schema(
        [
            ColumnSchema(
                "item_id-list",
                dtype="int64",
                tags=[Tags.ITEM_ID, Tags.ITEM, Tags.ID, Tags.CATEGORICAL, Tags.LIST],
                is_list=True,
                is_ragged=True,
                properties={
                    "domain": {"min": 0, "max": n_items - 1, "name": "item_id"},
                    **list_props,
                },
            ),
            ColumnSchema(
                "category-list",
                dtype="int64",
                tags=[Tags.CATEGORICAL, Tags.LIST],
                is_list=True,
                is_ragged=True,
                properties={
                    "domain": {"min": 0, "max": N_CATEGORIES - 1, "name": "category"},
                    **list_props,
                },
            ),
            ColumnSchema("click", dtype="float32", tags=[Tags.TARGET, Tags.BINARY_CLASSIFICATION]),
            ColumnSchema("rating", dtype="float32", tags=[Tags.TARGET, Tags.REGRESSION]),
        ]
    )


def session_frame(n_rows, seed=0, n_items=N_ITEMS):
    """``n_rows`` random sessions; the click target depends on the items so it is learnable."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, MAX_LEN + 1, size=n_rows)
    items = [rng.integers(1, n_items, size=n).tolist() for n in lengths]
    cats = [[i % (N_CATEGORIES - 1) + 1 for i in seq] for seq in items]
    click = np.array([float(seq[-1] % 2 == 0) for seq in items], dtype=np.float32)
    rating = np.array([np.mean(seq) / n_items for seq in items], dtype=np.float32)
    return pd.DataFrame(
        {"item_id-list": items, "category-list": cats, "click": click, "rating": rating}
    )


def write_sessions(path, n_rows, seed=0, n_files=2, sizes=None, n_items=N_ITEMS):
    """Write ``n_rows`` sessions as ``n_files`` parquet files plus ``schema.pbtxt`` under ``path``.

    ``sizes`` (rows per file, summing to ``n_rows``) makes files of unequal size,
    hence unequal DDP shards.

    Returns
    -------
    str
        ``path``
    """
    os.makedirs(path, exist_ok=True)
    df = session_frame(n_rows, seed, n_items)
    if sizes is not None:
        assert sum(sizes) == n_rows, (sizes, n_rows)
        parts = np.split(np.arange(n_rows), np.cumsum(sizes)[:-1])
    else:
        parts = np.array_split(np.arange(n_rows), n_files)
    for i, part in enumerate(parts):
        df.iloc[part].reset_index(drop=True).to_parquet(
            os.path.join(path, f"part_{i}.parquet"), row_group_size=max(1, len(part) // 2)
        )
    TensorflowMetadata.from_merlin_schema(session_schema(n_items)).to_proto_text_file(path)
    return path


def dataset(path):
    """``merlin.io.Dataset`` over the parquet files written by :func:`write_sessions`."""
    return Dataset(os.path.join(path, "*.parquet"), engine="parquet", schema=session_schema())


def build_model(task="binary", d_model=16, n_layer=1, masking=None, schema=None, seed=0):
    """A tiny XLNet T4R model for ``task`` in {"binary", "regression", "next-item", "multi",
    "asked-metrics"}.

    Causal masking and dropout 0, so the forward pass is deterministic. ``"multi"`` has the
    three tasks on one head, like T4R's ``test_trainer_with_multiple_tasks``.
    """
    import torch
    import torchmetrics as tm

    torch.manual_seed(seed)
    schema = schema or session_schema()
    features = schema.select_by_name(["item_id-list", "category-list", "click", "rating"])
    masking = masking or "clm"
    inputs = tr.TabularSequenceFeatures.from_schema(
        features.select_by_tag(Tags.CATEGORICAL),
        max_sequence_length=MAX_LEN,
        continuous_projection=None,
        aggregation="concat",
        d_output=d_model,
        masking=masking,
    )
    config = tr.XLNetConfig.build(
        d_model=d_model, n_head=2, n_layer=n_layer, total_seq_length=MAX_LEN, dropout=0.0
    )
    if task == "binary":
        head_task = tr.BinaryClassificationTask("click", summary_type="mean")
    elif task == "regression":
        head_task = tr.RegressionTask("rating", summary_type="mean")
    elif task == "next-item":
        head_task = tr.NextItemPredictionTask(weight_tying=True)
    elif task == "multi":
        head_task = [
            tr.NextItemPredictionTask(weight_tying=True),
            tr.BinaryClassificationTask("click", summary_type="mean"),
            tr.RegressionTask("rating", summary_type="mean"),
        ]
    elif task == "asked-metrics":
        # Metrics that the tasks ask for, beyond T4R's defaults.
        head_task = [
            tr.BinaryClassificationTask("click", summary_type="mean", metrics=(
                tm.AUROC(task="binary"), tm.Accuracy(task="binary"))),
            tr.RegressionTask("rating", summary_type="mean", metrics=(
                tm.MeanAbsoluteError(), tm.MeanSquaredError(squared=False))),
        ]
    else:
        raise ValueError(
            f"task must be 'binary', 'regression', 'next-item', 'multi' or 'asked-metrics', "
            f"got {task!r}"
        )
    if isinstance(head_task, list):
        # to_torch_model(inputs, *tasks) fails in T4R 23.12 ("multiple values for task_blocks").
        body = tr.SequentialBlock(inputs, tr.TransformerBlock(config, masking=inputs.masking))
        return tr.Head(body, head_task).to_model(max_sequence_length=MAX_LEN)
    return config.to_torch_model(inputs, head_task, max_sequence_length=MAX_LEN)


# ---- T4R's packaged test data (transformers4rec.data.tabular_sequence_testing_data) ----------

TESTING_MAX_LEN = 20


def testing_schema():
    """The item-id and category lists of T4R's ``tabular_sequence_testing_data`` schema."""
    from transformers4rec.data import tabular_sequence_testing_data

    return tabular_sequence_testing_data.schema.select_by_name(["item_id/list", "category/list"])


def testing_frame():
    """T4R's ``tabular_sequence_testing_data`` (1,000 sessions) as a pandas frame."""
    from transformers4rec.data import tabular_sequence_testing_data

    return pd.read_parquet(tabular_sequence_testing_data.path)


def testing_dataset(frame, npartitions=4):
    """``frame`` as a ``merlin.io.Dataset`` of ``npartitions`` with T4R's schema."""
    import dask.dataframe as dd

    from merlin_t4r_ops.sequence import core_schema

    frame = dd.from_pandas(frame, npartitions=npartitions)
    return Dataset(frame, schema=core_schema(testing_schema()))


def testing_batch(frame):
    """``frame``'s item-id and category lists cropped and padded to ``TESTING_MAX_LEN``."""
    import torch

    from merlin_t4r_ops.sequence import crop_and_pad

    batch = {}
    for name in testing_schema().column_names:
        lists = frame[name].map(list)
        values = torch.tensor([v for row in lists for v in row], dtype=torch.int64)
        batch[name] = crop_and_pad(values, torch.tensor(lists.map(len).tolist()), TESTING_MAX_LEN)
    return batch


def testing_model(masking="clm", d_model=16, seed=0):
    """A tiny XLNet next-item model over :func:`testing_schema`, dropout 0."""
    import torch

    torch.manual_seed(seed)
    inputs = tr.TabularSequenceFeatures.from_schema(
        testing_schema(), max_sequence_length=TESTING_MAX_LEN, masking=masking, d_output=d_model,
        aggregation="concat",
    )
    config = tr.XLNetConfig.build(
        d_model=d_model, n_head=2, n_layer=1, total_seq_length=TESTING_MAX_LEN, dropout=0.0
    )
    return config.to_torch_model(inputs, tr.NextItemPredictionTask(weight_tying=True))


def cpu_and_cuda():
    """``pytest.mark.parametrize`` values: the CPU always, CUDA (marked gpu) where one is."""
    import pytest
    import torch

    return [pytest.param(torch.device("cpu"), id="cpu"),
            pytest.param(torch.device("cuda:0"), id="cuda", marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU, found none")])]
