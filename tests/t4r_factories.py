"""Small real T4R models and session data for the serving tests."""

import numpy as np
import pandas as pd
import torch

import transformers4rec.torch as tr
from transformers4rec.config.transformer import BertConfig
from merlin.schema import ColumnSchema, Schema, Tags

ITEMS = 100
CATEGORIES = 12
SEQ_LEN = 8


def session_schema(items: int = ITEMS, categories: int = CATEGORIES, seq_len: int = SEQ_LEN):
    """Schema of session features as an NVTabular workflow would produce them."""
    def list_col(name, dtype, tags, domain=None):
        properties = {"value_count": {"min": 1, "max": seq_len}}
        if domain is not None:
            properties["domain"] = {"min": 0, "max": domain, "name": name}
        return ColumnSchema(name, dtype=dtype, tags=tags, properties=properties,
                            is_list=True, is_ragged=True)

    return Schema([
        list_col("item_id-list", np.int64,
                 [Tags.CATEGORICAL, Tags.ITEM_ID, Tags.ITEM, Tags.LIST], items - 1),
        list_col("category-list", np.int64, [Tags.CATEGORICAL, Tags.LIST], categories - 1),
        list_col("price-list", np.float32, [Tags.CONTINUOUS, Tags.LIST]),
    ])


def _body(schema, transformer_config, masking, seq_len=SEQ_LEN, d_model=32):
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=seq_len, continuous_projection=d_model,
        aggregation="concat", masking=masking,
    )
    return tr.SequentialBlock(inputs, tr.MLPBlock([d_model]), tr.TransformerBlock(
        transformer_config, masking=inputs.masking))


def next_item_model(kind: str = "xlnet-causal", schema=None, seed: int = 0, d_model: int = 32):
    """A next-item model: ``xlnet-causal``, ``gpt2`` (causal) or ``xlnet-mlm`` / ``bert`` (masked)."""
    torch.manual_seed(seed)
    schema = schema or session_schema()
    seq_len = schema["item_id-list"].value_count.max
    masking = "mlm" if kind in ("xlnet-mlm", "bert") else "causal"
    config_cls = {"xlnet-causal": tr.XLNetConfig, "xlnet-mlm": tr.XLNetConfig,
                  "gpt2": tr.GPT2Config, "bert": BertConfig}[kind]
    config = config_cls.build(d_model=d_model, n_head=2, n_layer=1, total_seq_length=seq_len)
    body = _body(schema, config, masking, seq_len, d_model)
    head = tr.Head(body, tr.NextItemPredictionTask(weight_tying=True), inputs=body.inputs)
    return tr.Model(head, max_sequence_length=seq_len).eval()


def binary_model(schema=None, seed: int = 0, d_model: int = 32):
    """A session-level binary classifier over an XLNet body."""
    torch.manual_seed(seed)
    schema = schema or session_schema()
    seq_len = schema["item_id-list"].value_count.max
    config = tr.XLNetConfig.build(d_model=d_model, n_head=2, n_layer=1, total_seq_length=seq_len)
    body = _body(schema, config, "causal", seq_len, d_model)
    task = tr.BinaryClassificationTask("click", summary_type="last")
    head = tr.Head(body, task, inputs=body.inputs)
    return tr.Model(head, max_sequence_length=seq_len).eval()


def random_sessions(n: int, rng: np.random.Generator, min_len=1, max_len=SEQ_LEN * 2,
                    items=ITEMS, categories=CATEGORIES) -> pd.DataFrame:
    """Sessions of random lengths (some longer than the model's), ids in range."""
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return pd.DataFrame({
        "item_id-list": [rng.integers(1, items, size=k).astype(np.int64) for k in lengths],
        "category-list": [rng.integers(1, categories, size=k).astype(np.int64) for k in lengths],
        "price-list": [rng.random(k).astype(np.float32) for k in lengths],
    })


def sessions_some_longer_than(n: int, rng: np.random.Generator, length: int) -> pd.DataFrame:
    """``n`` sessions: the even rows (row 0 too) longer than ``length`` (by 1 to 20), the odd
    ones short."""
    long = random_sessions(n, rng, min_len=length + 1, max_len=length + 20)
    short = random_sessions(n, rng, max_len=SEQ_LEN)
    return pd.concat([short.iloc[i:i + 1] if i % 2 else long.iloc[i:i + 1] for i in range(n)],
                     ignore_index=True)


def reference_inputs(df: pd.DataFrame, seq_len: int = SEQ_LEN):
    """Padded model inputs built the slow, obvious way: keep the last items, pad right with 0."""
    out = {}
    for name in df.columns:
        rows = []
        for session in df[name]:
            recent = list(session)[-seq_len:]
            rows.append(recent + [0] * (seq_len - len(recent)))
        dtype = torch.float32 if name == "price-list" else torch.int64
        out[name] = torch.tensor(np.array(rows), dtype=dtype)
    return out


def eager_scores(model, df: pd.DataFrame, seq_len: int = SEQ_LEN) -> np.ndarray:
    """What ``model(batch)`` gives in-process for these sessions."""
    with torch.inference_mode():
        return model(reference_inputs(df, seq_len), training=False, testing=False).numpy()


def raw_sessions(n: int, rng: np.random.Generator, max_len=SEQ_LEN * 2,
                 items: int = 400) -> pd.DataFrame:
    """Sessions in the shop's own ids: sparse, large item ids and string-free categories."""
    df = random_sessions(n, rng, max_len=max_len, items=items)
    df["item_id-list"] = df["item_id-list"].map(lambda ids: ids * 7919 + 100_000)
    df["category-list"] = df["category-list"].map(lambda ids: ids * 13 + 500)
    return df


def string_item_ids(raw: pd.DataFrame) -> pd.DataFrame:
    """The same sessions with the shop's item ids as strings (``"sku-<id>"``)."""
    raw = raw.copy()
    raw["item_id-list"] = raw["item_id-list"].map(
        lambda ids: np.array([f"sku-{i}" for i in ids], dtype=object))
    return raw


def fit_session_workflow(directory, rng: np.random.Generator, n: int = 300,
                         string_ids: bool = False, items: int = 400):
    """Fit Categorify on raw session ids; returns (workflow, model over its output, raw data).

    With ``string_ids`` the raw item ids are strings, else int64 ids up to the millions;
    ``items - 1`` distinct items at most.
    """
    import nvtabular as nvt
    from merlin.io import Dataset

    raw = raw_sessions(n, rng, items=items)
    if string_ids:
        raw = string_item_ids(raw)
    categorify = dict(out_path=str(directory))  # not ./categories in the working directory
    items = (["item_id-list"] >> nvt.ops.Categorify(**categorify)
             >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.ITEM, Tags.CATEGORICAL, Tags.LIST]))
    categories = (["category-list"] >> nvt.ops.Categorify(**categorify)
                  >> nvt.ops.AddTags([Tags.CATEGORICAL, Tags.LIST]))
    prices = ["price-list"] >> nvt.ops.AddTags([Tags.CONTINUOUS, Tags.LIST])
    workflow = nvt.Workflow(items + categories + prices)
    workflow.fit(Dataset(raw))
    workflow.save(str(directory))
    schema = workflow.output_schema
    for name in schema.column_names:
        schema[name] = schema[name].with_properties({"value_count": {"min": 1, "max": SEQ_LEN}})
    return workflow, next_item_model("xlnet-causal", schema=schema, seed=5), raw


def workflow_ensemble(workflow, model, top_k=None):
    """raw sessions >> TransformWorkflow(workflow) >> PredictT4RPyTorch(model)."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import PredictT4RPyTorch

    pipeline = (workflow.input_schema.column_names >> TransformWorkflow(workflow)
                >> PredictT4RPyTorch(model, top_k=top_k))
    return Ensemble(pipeline, workflow.input_schema)


def decode_ensemble(workflow, top_k: int):
    """``item_ids`` (encoded, int32) and ``item_id_scores`` >> DecodeItemIds(workflow)."""
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import DecodeItemIds

    schema = Schema([ColumnSchema("item_ids", dtype=np.int32, dims=(None, top_k)),
                     ColumnSchema("item_id_scores", dtype=np.float32, dims=(None, top_k))])
    return Ensemble(schema.column_names >> DecodeItemIds(workflow), schema)


def seen_and_plain_ensemble(workflow, model, top_k, decode=False):
    """Raw sessions >> the workflow >> two top-k's of ``model``, side by side.

    ``item_ids``/``item_id_scores`` leave out the session's own items (``exclude_seen``);
    ``all_item_ids``/``all_item_id_scores`` leave out only the reserved ids. With ``decode``
    each top-k goes on through ``DecodeItemIds(workflow)``: the shop's raw ids come out.
    """
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch

    encoded = workflow.input_schema.column_names >> TransformWorkflow(workflow)
    unseen = encoded >> PredictT4RPyTorch(model, top_k=top_k, exclude_seen=True)
    everything = encoded >> PredictT4RPyTorch(model, top_k=top_k, output_prefix="all_")
    if decode:
        unseen = unseen >> DecodeItemIds(workflow)
        everything = everything >> DecodeItemIds(workflow, ids_column="all_item_ids")
    return Ensemble(unseen + everything, workflow.input_schema)


def two_top_ks_ensemble(model, top_ks=(20, 5), **op_kwargs):
    """Sessions >> two top-k's of one model object, side by side: the first as
    ``a_item_ids``/``a_item_id_scores``, the second with prefix ``b_``; ``op_kwargs`` go to
    both operators."""
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import PredictT4RPyTorch

    columns = model.input_schema.column_names
    first, second = (columns >> PredictT4RPyTorch(model, top_k=k, output_prefix=prefix,
                                                  **op_kwargs)
                     for k, prefix in zip(top_ks, ("a_", "b_")))
    return Ensemble(first + second, model.input_schema)


def reference_top_k(scores, k: int, reserved=(0,), sessions=None):
    """Top-k built the slow, obvious way: reserved ids and (with ``sessions``) every item
    of each row's whole session set to -inf, one by one, then ``torch.topk``.

    Returns ``(ids, scores)`` as numpy arrays.
    """
    scores = torch.as_tensor(np.array(scores, dtype=np.float32)).clone()
    for row in range(scores.shape[0]):
        for item in reserved:
            scores[row, item] = float("-inf")
        for item in ([] if sessions is None else sessions[row]):
            scores[row, int(item)] = float("-inf")
    top = torch.topk(scores, k)
    return top.indices.numpy(), top.values.numpy()


def load_exported(ensemble_path):
    """Load an exported ensemble the way Merlin's executor model does in ``initialize``."""
    from merlin.dag import postorder_iter_nodes
    from merlin.systems.dag import Ensemble

    ensemble = Ensemble.load(str(ensemble_path))
    for node in postorder_iter_nodes(ensemble.graph.output_node, flatten_subgraphs=True):
        node.op.load_artifacts(str(ensemble_path))
    return ensemble
