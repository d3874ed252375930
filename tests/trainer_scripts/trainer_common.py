"""Tiny next-item fixtures shared by the trainer tests and the scripts they launch.

Kept free of pytest so a ``torchrun``-launched script can import it as well.
"""

import os

import numpy as np
import pandas as pd
import torch
from merlin.schema import ColumnSchema, Schema, Tags

ITEM_COL = "item_id-list"
N_ITEMS = 50
MAX_LEN = 12
TOP_KS = [5, 10]


def make_schema(n_items=N_ITEMS, max_len=MAX_LEN):
    """One ragged list column of item ids, tagged the way T4R expects for next-item."""
    col = ColumnSchema(
        ITEM_COL,
        dtype="int64",
        is_list=True,
        is_ragged=True,
        tags=[Tags.ITEM_ID, Tags.ITEM, Tags.ID, Tags.CATEGORICAL, Tags.LIST],
        properties={
            "domain": {"min": 0, "max": n_items, "name": ITEM_COL},
            "value_count": {"min": 2, "max": max_len},
        },
    )
    return Schema([col])


def write_sessions(path, n_sessions, n_partitions, seed=0, n_items=N_ITEMS, max_len=MAX_LEN):
    """Write ``n_sessions`` synthetic sessions as ``n_partitions`` parquet files.

    Item ids start at 1 (0 is T4R's padding id). Sessions follow a noisy
    "next id = previous id + 1" pattern so a model can learn something. Returns
    the list of file paths (one Merlin partition each).
    """
    rng = np.random.default_rng(seed)
    sessions, seen = [], set()
    while len(sessions) < n_sessions:
        length = int(rng.integers(2, max_len + 1))
        start = int(rng.integers(1, n_items))
        seq = [(start + i - 1) % (n_items - 1) + 1 for i in range(length)]
        noise = rng.random(length) < 0.2
        seq = [int(rng.integers(1, n_items)) if n else s for s, n in zip(seq, noise)]
        # Unique sessions let tests check shards by content.
        if tuple(seq) not in seen:
            seen.add(tuple(seq))
            sessions.append(seq)
    os.makedirs(path, exist_ok=True)
    files = []
    for p, chunk in enumerate(np.array_split(np.arange(n_sessions), n_partitions)):
        df = pd.DataFrame({ITEM_COL: [sessions[i] for i in chunk]})
        f = os.path.join(path, f"part_{p:02d}.parquet")
        df.to_parquet(f, index=False)
        files.append(f)
    return files, sessions


def make_model(schema, arch="xlnet", d_model=16, seed=0):
    """A tiny XLNet (or GPT2) next-item model with NDCG@k and Recall@k metrics."""
    import transformers4rec.torch as tr
    from transformers4rec.torch.ranking_metric import NDCGAt, RecallAt

    torch.manual_seed(seed)
    masking = "clm" if arch == "gpt2" else "mlm"
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema,
        max_sequence_length=MAX_LEN,
        masking=masking,
        d_output=d_model,
        aggregation="concat",
        embedding_dim_default=d_model,
    )
    if arch == "gpt2":
        build = tr.GPT2Config.build
    else:
        build = tr.XLNetConfig.build
    config = build(d_model=d_model, n_head=2, n_layer=1, total_seq_length=MAX_LEN)
    metrics = [
        NDCGAt(top_ks=TOP_KS, labels_onehot=True),
        RecallAt(top_ks=TOP_KS, labels_onehot=True),
    ]
    task = tr.NextItemPredictionTask(weight_tying=True, metrics=metrics)
    return config.to_torch_model(inputs, task)


def make_args(output_dir, **overrides):
    """Training arguments small enough for two CPU cores."""
    from transformers4rec.config.trainer import T4RecTrainingArguments

    kwargs = dict(
        output_dir=output_dir,
        max_sequence_length=MAX_LEN,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        num_train_epochs=1,
        learning_rate=5e-3,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        dataloader_drop_last=False,
        seed=0,
        predict_top_k=max(TOP_KS),
        no_cuda=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return T4RecTrainingArguments(**kwargs)
