"""Pieces both examples share: synthetic shop events, the NVTabular ETL and serving.

The ETL is two workflows, the way a Merlin user splits offline and online work:

1. ``sessionize``: raw events -> one row per session (``Groupby`` sorted by time,
   ``ListSlice`` to the most recent items, ``Filter`` of too-short sessions). It runs only
   offline, so it never goes into the model repository.
2. ``encode``: grouped raw sessions (list columns of shop ids) -> Categorify-d lists with
   the tags T4R reads. It is fitted once, on the training sessions, and the SAME fitted
   workflow is what Triton runs in front of the model, so training and serving share one
   vocabulary and a client sends sessions exactly as its shop stores them.

Fitting ``Categorify`` after the groupby (on list columns) rather than before it is what
makes step 2 servable: a Categorify fitted on the event-level ``item_id`` column could
not be applied to an ``item_id-list`` request column without copying its statistics.
"""

import time
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import pandas as pd

from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

ITEM = "item_id-list"
CATEGORY = "category-list"
FEATURES = [ITEM, CATEGORY]


def generate_events(
    n_sessions: int, n_items: int = 1000, n_categories: int = 20, seed: int = 0
) -> pd.DataFrame:
    """Seeded synthetic click events of a shop, one row per event, in random row order.

    Item ids are large and sparse, popularity is Zipf-skewed, and each item has a
    "usual next item", which a session follows 70 % of the time: a sequence model can
    beat a popularity ranking on this data. Purchases are more likely on items of the
    first quarter of categories, which gives the binary example something to learn.

    Parameters
    ----------
    n_sessions : int
    n_items, n_categories : int
        Catalogue size.
    seed : int

    Returns
    -------
    pandas.DataFrame
        ``session_id``, ``item_id``, ``category``, ``timestamp`` (int64 seconds) and
        ``purchase`` (float32 0/1).
    """
    rng = np.random.default_rng(seed)
    item_ids = np.unique(rng.integers(10_000_000, 10_000_000_000, size=2 * n_items + 16))
    item_ids = rng.permutation(item_ids)[:n_items]  # sparse, and unrelated to popularity
    item_category = rng.integers(0, n_categories, size=n_items)
    category_ids = 5_000 + 37 * np.arange(n_categories)
    popularity = 1.0 / np.arange(1, n_items + 1) ** 0.9
    popularity /= popularity.sum()
    # Uniform successors: the sequential signal is spread over the whole catalogue,
    # so knowing the last item beats knowing the bestsellers.
    successor = rng.permutation(n_items)
    premium = item_category < max(1, n_categories // 4)

    lengths = np.minimum(rng.geometric(0.15, size=n_sessions), 40)
    starts = np.sort(rng.integers(1_700_000_000, 1_700_000_000 + 30 * 86_400, size=n_sessions))
    rows = []
    for session, (length, start) in enumerate(zip(lengths, starts)):
        current = rng.choice(n_items, p=popularity)
        clock = start
        for _ in range(length):
            rows.append((session, current, clock))
            clock += int(rng.integers(5, 300))
            follow = rng.random() < 0.7
            current = successor[current] if follow else rng.choice(n_items, p=popularity)
    session, item, timestamp = map(np.array, zip(*rows))
    purchase = rng.random(len(item)) < np.where(premium[item], 0.25, 0.02)
    events = pd.DataFrame({
        "session_id": session.astype(np.int64),
        "item_id": item_ids[item].astype(np.int64),
        "category": category_ids[item_category[item]].astype(np.int64),
        "timestamp": timestamp.astype(np.int64),
        "purchase": purchase.astype(np.float32),
    })
    # Shuffled, so the Groupby's sort by timestamp is what orders each session.
    return events.sample(frac=1.0, random_state=seed).reset_index(drop=True)


def sessionize_workflow(max_length: int, min_length: int):
    """Events -> sessions: time-sorted lists of the last ``max_length`` items, short ones out."""
    import nvtabular as nvt

    columns = ["session_id", "item_id", "category", "timestamp", "purchase"]
    grouped = columns >> nvt.ops.Groupby(
        groupby_cols=["session_id"],
        sort_cols=["timestamp"],
        aggs={"item_id": ["list", "count"], "category": ["list"], "timestamp": ["first"],
              "purchase": ["max"]},
        name_sep="-",
    )
    # ListSlice(-N, pad=True) does not pad in 23.08; nothing needs it to, since the
    # training loader and PredictT4RPyTorch pad to the model's length themselves.
    lists = grouped[FEATURES] >> nvt.ops.ListSlice(-max_length)
    label = grouped["purchase-max"] >> nvt.ops.Rename(name="purchase")
    kept = grouped["session_id", "timestamp-first", "item_id-count"] + lists + label
    return nvt.Workflow(kept >> nvt.ops.Filter(f=lambda df: df["item_id-count"] >= min_length))


def encode_workflow(out_path, target: str = None):
    """Grouped raw sessions -> Categorify-d, tagged lists (and ``target``, tagged as one).

    ``out_path`` holds the fitted vocabularies (``categories/unique.<column>.parquet``).
    """
    import nvtabular as nvt
    from merlin.schema import Tags

    categorify = dict(out_path=str(out_path))
    items = (
        [ITEM] >> nvt.ops.Categorify(**categorify)
        >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.ITEM, Tags.ID, Tags.CATEGORICAL, Tags.LIST])
    )
    categories = [CATEGORY] >> nvt.ops.Categorify(**categorify) >> nvt.ops.AddTags(
        [Tags.CATEGORICAL, Tags.LIST]
    )
    # ValueCount records the lists' lengths seen in fit, which T4R and Triton read.
    lists = (items + categories) >> nvt.ops.ValueCount()
    if target is not None:
        lists = lists + ([target] >> nvt.ops.AddTags([Tags.TARGET, Tags.BINARY_CLASSIFICATION]))
    return nvt.Workflow(lists)


def one_partition(df: pd.DataFrame):
    """A Dataset of ONE partition: NVTabular 23.08 fails writing list columns from several."""
    from merlin.io import Dataset

    return Dataset(df, npartitions=1)


# The ETL runs NVTabular on pandas by design (no cuDF here): its "CPU mode" warnings say nothing.
@cpu_datasets_quiet()
def run_etl(events: pd.DataFrame, output_dir: Path, *, max_length: int, min_length: int,
            eval_fraction: float, target: str = None) -> Dict:
    """Sessionize, split by time, fit the encoder on training sessions, write parquet.

    Returns
    -------
    dict
        ``workflow`` (fitted encoder, saved under ``output_dir/workflow``), ``train_dir``,
        ``eval_dir`` (parquet + schema.pbtxt), ``train_raw``/``eval_raw`` (grouped raw
        sessions) and ``categories`` (the vocabulary folder).
    """
    sessions = sessionize_workflow(max_length, min_length)
    grouped = sessions.fit_transform(one_partition(events)).to_ddf().compute()
    sessions.save(str(output_dir / "workflow_sessionize"))
    # Hold out the LAST sessions in time: the model is judged on the future, as deployed.
    grouped = grouped.sort_values("timestamp-first", kind="stable").reset_index(drop=True)
    n_eval = max(1, int(round(len(grouped) * eval_fraction)))
    train_raw, eval_raw = grouped.iloc[:-n_eval], grouped.iloc[-n_eval:]
    columns = FEATURES + ([target] if target else [])
    train_raw = train_raw[columns].reset_index(drop=True)
    eval_raw = eval_raw[columns].reset_index(drop=True)

    workflow = encode_workflow(output_dir, target)
    workflow.fit(one_partition(train_raw))
    workflow.save(str(output_dir / "workflow"))
    paths = {}
    for split, frame in (("train", train_raw), ("eval", eval_raw)):
        paths[split] = output_dir / "data" / split
        workflow.transform(one_partition(frame)).to_parquet(
            str(paths[split]), out_files_per_proc=1
        )
    return {"workflow": workflow, "train_dir": paths["train"], "eval_dir": paths["eval"],
            "train_raw": train_raw, "eval_raw": eval_raw,
            "categories": output_dir / "categories"}


def build_ensemble(workflow, model, top_k: int = None):
    """``raw sessions >> TransformWorkflow(workflow) >> PredictT4RPyTorch(model)``, and with
    ``top_k`` ``>> DecodeItemIds(workflow)``: the shop's own ids of the best items that are
    not in the session (Categorify's reserved ids never come back)."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch

    model.eval().cpu()
    pipeline = workflow.input_schema.column_names >> TransformWorkflow(workflow)
    if top_k is None:
        pipeline = pipeline >> PredictT4RPyTorch(model)
    else:
        pipeline = (pipeline >> PredictT4RPyTorch(model, top_k=top_k, exclude_seen=True)
                    >> DecodeItemIds(workflow))
    return Ensemble(pipeline, workflow.input_schema)


def serve_and_compare(workflow, model, repository: Path, requests: pd.DataFrame,
                      top_k: int = None) -> Dict:
    """Export the ensemble, send ``requests`` (raw sessions) to a real tritonserver, and run
    the same ensemble in-process for comparison.

    Returns
    -------
    dict
        ``served`` and ``local`` DataFrames and ``server_seconds`` (start to ready).
    """
    from merlin_t4r_ops.serving import triton_server
    from merlin_t4r_ops.serving.client import infer_dataframe

    requests = requests.reset_index(drop=True)
    ensemble = build_ensemble(workflow, model, top_k)
    # Before export: exporting swaps the graph's workflow op for its Triton-runtime twin,
    # which the in-process runtime cannot run.
    with cpu_datasets_quiet():  # the in-process TransformWorkflow runs on pandas, as intended
        local = ensemble.transform(requests)
    ensemble.export(str(repository))
    start = time.perf_counter()
    with triton_server(repository) as server:
        ready = time.perf_counter() - start
        served = infer_dataframe(server.client(), requests)
    return {"served": served, "local": local, "server_seconds": ready}


def stacked(frame: pd.DataFrame, column: str) -> np.ndarray:
    """A DataFrame column of equal-length arrays (or scalars) as one numpy array."""
    values = frame[column].to_list()
    return np.stack([np.asarray(v) for v in values])


def final_metrics(history: Sequence[dict], names: Dict[str, str]) -> Dict[str, float]:
    """``{short name: value}`` of the last epoch's eval metrics (``names``: short -> key)."""
    last = history[-1]
    return {short: float(last[f"eval_{key}"]) for short, key in names.items()}


def plot_loss(log_csv: Path, png: Path):
    """Plot the per-step training loss of ``fit``'s ``log.csv`` into ``png``.

    Optional, like matplotlib here: returns ``None`` (and draws nothing) where
    matplotlib is not installed, else ``png``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    log = pd.read_csv(log_csv)
    loss = log[log["name"] == "train/loss"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(loss["step"], loss["value"])
    ax.set(xlabel="optimizer step", ylabel="training loss", title="fit: training loss")
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return png
