"""T4R's tutorial pipeline on random event rows: the ETL, its schema.pbtxt, the XLNet model.

As T4R 23.12's ``examples/getting-started-session-based`` (01-ETL-with-NVTabular,
02-session-based-XLNet) does it: ``Categorify`` the event rows, then ``Groupby`` the
session with ``name_sep="-"``, ``ListSlice`` the lists, ``Rename(postfix="_seq")``, tag
them, ``ValueCount``; write ``schema.pbtxt``, read it back with ``merlin_standard_lib``,
``TabularSequenceFeatures.from_schema`` and ``XLNetConfig.to_torch_model``. No target is
tagged (the tutorials tag none).
"""

import numpy as np
import pandas as pd

SESSION = "session_id"
ITEM = "item_id-list_seq"
CATEGORY = "category-list_seq"
MAX_LEN = 20


def item_catalogue(n_items: int) -> np.ndarray:
    """The shop's raw item ids: sparse, large int64 ids."""
    return np.arange(n_items, dtype=np.int64) * 7919 + 100_003


def events(rng: np.random.Generator, n_sessions: int, items: np.ndarray,
           first_session: int = 0, max_len: int = MAX_LEN + 6) -> pd.DataFrame:
    """One row per click, shuffled: session id, raw item id, its category, a timestamp.

    Sessions hold 2 to ``max_len`` events, some longer than ``MAX_LEN`` (for ``ListSlice``).
    """
    rows = []
    for session in range(first_session, first_session + n_sessions):
        start = int(rng.integers(1_700_000_000, 1_800_000_000))
        for position in range(int(rng.integers(2, max_len + 1))):
            item = int(rng.choice(items))
            rows.append((session, item, item % 11 + 500, start + 60 * position))
    frame = pd.DataFrame(rows, columns=[SESSION, "item_id", "category", "timestamp"])
    return frame.sample(frac=1.0, random_state=int(rng.integers(1 << 31))).reset_index(drop=True)


def tutorial_workflow(out_path, minimum_length=None, with_count=False):
    """The tutorial's ETL: Categorify on events, Groupby, ListSlice, Rename, tags, ValueCount.

    With ``minimum_length`` the tutorial's ``Filter`` on ``item_id-count`` is kept (a session
    shorter than it has no row in the output, which a served request would lose); with
    ``with_count`` that count is an output too.
    """
    import nvtabular as nvt
    from merlin.schema import Tags

    categorified = ["item_id", "category"] >> nvt.ops.Categorify(out_path=str(out_path))
    grouped = ([SESSION, "timestamp"] + categorified) >> nvt.ops.Groupby(
        groupby_cols=[SESSION], sort_cols=["timestamp"], name_sep="-",
        aggs={"item_id": ["list", "count"], "category": ["list"], "timestamp": ["first"]})
    item = (grouped["item_id-list"] >> nvt.ops.ListSlice(-MAX_LEN)
            >> nvt.ops.Rename(postfix="_seq") >> nvt.ops.TagAsItemID())
    category = (grouped["category-list"] >> nvt.ops.ListSlice(-MAX_LEN)
                >> nvt.ops.Rename(postfix="_seq")
                >> nvt.ops.AddMetadata(tags=[Tags.CATEGORICAL, Tags.LIST]))
    selected = grouped[SESSION, "item_id-count"] + item + category
    if minimum_length is not None:
        selected = selected >> nvt.ops.Filter(
            f=lambda frame: frame["item_id-count"] >= minimum_length)
    lists = selected[ITEM, CATEGORY] >> nvt.ops.ValueCount()
    return nvt.Workflow(selected[[SESSION, "item_id-count"] if with_count else SESSION] + lists)


def write_schema_pbtxt(workflow, directory) -> str:
    """``schema.pbtxt`` of the workflow's output, as ``workflow.transform(...).to_parquet``
    writes it beside the data; returns its path."""
    from merlin.schema.io.tensorflow_metadata import TensorflowMetadata

    TensorflowMetadata.from_merlin_schema(workflow.output_schema).to_proto_text_file(
        str(directory), "schema.pbtxt")
    return f"{directory}/schema.pbtxt"


def standard_lib_schema(path: str):
    """The tutorials' way to read the schema: T4R's own ``merlin_standard_lib.Schema``."""
    from merlin_standard_lib import Schema

    return Schema().from_proto_text(path).select_by_name([ITEM, CATEGORY])


def xlnet_model(schema, d_model: int = 32, seed: int = 0):
    """02-session-based-XLNet's model: from_schema, XLNetConfig(mlm), to_torch_model."""
    import torch
    import transformers4rec.torch as tr

    torch.manual_seed(seed)
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=MAX_LEN, aggregation="concat", d_output=d_model,
        masking="mlm")
    config = tr.XLNetConfig.build(d_model=d_model, n_head=2, n_layer=1,
                                  total_seq_length=MAX_LEN)
    return config.to_torch_model(inputs, tr.NextItemPredictionTask(weight_tying=True))
