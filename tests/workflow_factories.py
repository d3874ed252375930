"""Sessions with session-level scalar features, and a workflow that builds sessions from events.

* A model whose inputs mix the session's lists with one value per session (a device, a
  user's age): the request carries scalar columns beside the list columns.
* A ``Groupby`` that takes raw event rows, one per click, and builds the sessions and their
  session-level features, with a label that training reads and serving drops
  (``Workflow.remove_inputs``), and the session id passed through to the answer.
"""

import numpy as np
import pandas as pd
import torch
from merlin.schema import ColumnSchema, Schema, Tags

import t4r_factories as factories

DEVICES = 5
SESSION_ID = "session_id"
REQUEST_ID = "request_id"
LABEL = "purchase"
SCALARS = ["device", "user_age"]
LISTS = ["item_id-list", "category-list", "price-list"]


def scalar_schema() -> Schema:
    """The session lists of ``t4r_factories`` plus a device id and an age per session."""
    device = ColumnSchema("device", dtype=np.int64, tags=[Tags.CATEGORICAL, Tags.CONTEXT],
                          properties={"domain": {"min": 0, "max": DEVICES - 1, "name": "device"}})
    age = ColumnSchema("user_age", dtype=np.float32, tags=[Tags.CONTINUOUS, Tags.CONTEXT])
    return Schema([*factories.session_schema(), device, age])


def with_request_id(answer, input_schema):
    """The graph ``answer`` with the request's ``request_id`` column beside its outputs."""
    request_id = ColumnSchema(REQUEST_ID, dtype=np.int64)
    return answer + [REQUEST_ID], input_schema + Schema([request_id])


def scalar_sessions(n: int, rng: np.random.Generator) -> pd.DataFrame:
    """Sessions with a device id and an age each, and a request id that the model ignores."""
    df = factories.random_sessions(n, rng)
    df[REQUEST_ID] = rng.permutation(n).astype(np.int64) + 5_000
    df["device"] = rng.integers(0, DEVICES, size=n).astype(np.int64)
    df["user_age"] = rng.uniform(0.0, 1.0, size=n).astype(np.float32)
    return df


def eager_scores(model, df: pd.DataFrame) -> np.ndarray:
    """``model(batch)`` in-process, for sessions with list and scalar columns."""
    inputs = factories.reference_inputs(df[[c for c in df.columns if c in LISTS]])
    for name in SCALARS:
        if name in df.columns:
            inputs[name] = torch.as_tensor(df[name].to_numpy())
    with torch.inference_mode():
        return model(inputs, training=False, testing=False).numpy()


def events(n_sessions: int, rng: np.random.Generator) -> pd.DataFrame:
    """One row per click, shuffled: session id, raw shop ids, price, time, device, age, label.

    The device and the age repeat on every event of a session.
    """
    sessions = factories.raw_sessions(n_sessions, rng)
    session_ids = rng.permutation(n_sessions) * 11 + 70_000
    devices = rng.choice([3001, 3002, 3003, 3004], size=n_sessions)
    ages = rng.uniform(0.0, 1.0, size=n_sessions)
    rows = []
    for index, session in enumerate(sessions.itertuples(index=False)):
        start = int(rng.integers(1_700_000_000, 1_800_000_000))
        for position, (item, category, price) in enumerate(zip(*session)):
            rows.append((session_ids[index], item, category, price, start + 60 * position,
                         devices[index], ages[index], float(rng.random() < 0.1)))
    frame = pd.DataFrame(rows, columns=[SESSION_ID, "item_id", "category", "price",
                                        "timestamp", "device", "user_age", LABEL])
    frame = frame.astype({SESSION_ID: np.int64, "item_id": np.int64, "category": np.int64,
                          "price": np.float32, "timestamp": np.int64, "device": np.int64,
                          "user_age": np.float32, LABEL: np.float32})
    return frame.sample(frac=1.0, random_state=int(rng.integers(1 << 31))).reset_index(drop=True)


def fit_event_workflow(directory, rng: np.random.Generator, n_sessions: int = 200):
    """Events -> ``Groupby`` -> Categorify-d lists and session-level features, plus the label.

    Returns (workflow, model over the session features, raw events). The workflow still
    takes the label, as a training workflow does: serve it after ``remove_inputs([LABEL])``.
    """
    import nvtabular as nvt
    from merlin.io import Dataset

    grouped = [SESSION_ID, "item_id", "category", "price", "timestamp", "device", "user_age",
               LABEL] >> nvt.ops.Groupby(
        groupby_cols=[SESSION_ID], sort_cols=["timestamp"],
        aggs={"item_id": ["list"], "category": ["list"], "price": ["list"],
              "device": ["first"], "user_age": ["first"], LABEL: ["max"]},
        name_sep="-",
    )
    categorify = dict(out_path=str(directory))  # not ./categories in the working directory
    items = (grouped["item_id-list"] >> nvt.ops.Categorify(**categorify)
             >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.ITEM, Tags.CATEGORICAL, Tags.LIST]))
    categories = (grouped["category-list"] >> nvt.ops.Categorify(**categorify)
                  >> nvt.ops.AddTags([Tags.CATEGORICAL, Tags.LIST]))
    prices = grouped["price-list"] >> nvt.ops.AddTags([Tags.CONTINUOUS, Tags.LIST])
    device = (grouped["device-first"] >> nvt.ops.Rename(name="device")
              >> nvt.ops.Categorify(**categorify) >> nvt.ops.AddTags([Tags.CATEGORICAL]))
    age = (grouped["user_age-first"] >> nvt.ops.Rename(name="user_age")
           >> nvt.ops.AddTags([Tags.CONTINUOUS]))
    label = (grouped[f"{LABEL}-max"] >> nvt.ops.Rename(name=LABEL)
             >> nvt.ops.AddTags([Tags.TARGET, Tags.BINARY_CLASSIFICATION]))
    workflow = nvt.Workflow(grouped[SESSION_ID] + items + categories + prices + device + age
                            + label)
    raw = events(n_sessions, rng)
    workflow.fit(Dataset(raw, npartitions=1))
    features = workflow.output_schema.select_by_name(LISTS + SCALARS)
    for name in LISTS:
        features[name] = features[name].with_properties(
            {"value_count": {"min": 1, "max": factories.SEQ_LEN}})
    return workflow, factories.next_item_model("xlnet-causal", schema=features, seed=7), raw


def event_ensemble(workflow, model, top_k: int):
    """events >> TransformWorkflow >> PredictT4RPyTorch, with the session id beside the answer.

    ``workflow`` must no longer take the label (``remove_inputs``).
    """
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import PredictT4RPyTorch

    sessions = workflow.input_schema.column_names >> TransformWorkflow(workflow)
    answer = (sessions >> PredictT4RPyTorch(model, top_k=top_k)) + sessions[SESSION_ID]
    return Ensemble(answer, workflow.input_schema)
