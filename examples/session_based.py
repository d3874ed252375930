"""Session-based next-item recommendation, end to end, on data this script generates.

Synthetic shop events -> NVTabular ETL (sessionize, Categorify) -> an XLNet next-item model
trained with :func:`merlin_t4r_ops.training.fit` -> an exported Merlin Systems ensemble
(``TransformWorkflow >> PredictT4RPyTorch >> DecodeItemIds``) -> a real ``tritonserver`` -> raw
sessions in, each session's top-20 items out, in the shop's own item ids and without the
items already in the session: the client decodes nothing.

Run ``python examples/session_based.py --help`` for the size flags.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

K = 20
METRICS = {f"ndcg@{K}": f"next-item/ndcg_at_{K}", f"recall@{K}": f"next-item/recall_at_{K}"}


def build_model(schema, max_length: int, d_model: int = 64, n_layer: int = 2):
    """An XLNet next-item model with causal masking over item and category embeddings."""
    import transformers4rec.torch as tr
    from transformers4rec.torch.ranking_metric import NDCGAt, RecallAt

    inputs = tr.TabularSequenceFeatures.from_schema(
        schema.select_by_name(common.FEATURES), max_sequence_length=max_length,
        aggregation="concat", d_output=d_model, masking="clm",
    )
    config = tr.XLNetConfig.build(d_model=d_model, n_head=4, n_layer=n_layer,
                                  total_seq_length=max_length)
    body = tr.SequentialBlock(inputs, tr.MLPBlock([d_model]),
                              tr.TransformerBlock(config, masking=inputs.masking))
    task = tr.NextItemPredictionTask(
        weight_tying=True,
        metrics=[NDCGAt(top_ks=[K], labels_onehot=True), RecallAt(top_ks=[K], labels_onehot=True)],
    )
    return tr.Model(tr.Head(body, task, inputs=inputs), max_sequence_length=max_length)


def popularity_baseline(train_raw: pd.DataFrame, eval_raw: pd.DataFrame) -> dict:
    """Recall@K of always recommending the K most frequent training items (a yardstick)."""
    counts = pd.Series(np.concatenate(train_raw[common.ITEM].to_list())).value_counts()
    top = set(counts.index[:K])
    last = [session[-1] for session in eval_raw[common.ITEM]]
    return {f"recall@{K}": float(np.mean([item in top for item in last]))}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000, help="synthetic sessions")
    parser.add_argument("--items", type=int, default=1000, help="catalogue size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=20, help="most recent items kept")
    parser.add_argument("--min-length", type=int, default=2, help="shorter sessions dropped")
    parser.add_argument("--eval-fraction", type=float, default=0.2,
                        help="share of the latest sessions held out")
    parser.add_argument("--requests", type=int, default=8, help="held-out sessions sent to Triton")
    parser.add_argument("--output-dir", type=Path, default=Path("example_output/session_based"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the training bar")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Run the example; return metrics, the served recommendations and the Triton comparison."""
    from merlin_t4r_ops.training import fit

    args = parse_args(argv)
    started = time.perf_counter()
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)

    events = common.generate_events(args.sessions, n_items=args.items, seed=args.seed)
    etl = common.run_etl(events, output_dir, max_length=args.max_length,
                         min_length=args.min_length, eval_fraction=args.eval_fraction)
    print(f"ETL: {len(events)} events -> {len(etl['train_raw'])} training and "
          f"{len(etl['eval_raw'])} held-out sessions", flush=True)

    import torch

    torch.manual_seed(args.seed)
    model = build_model(etl["workflow"].output_schema, args.max_length, args.d_model)
    history = fit(model, str(etl["train_dir"]), eval_data=str(etl["eval_dir"]),
                  epochs=args.epochs, strategy="auto", batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, progress=not args.no_progress,
                  log_dir=str(output_dir / "logs"))
    # fit's log.csv (per-step loss, learning rate, eval metrics) as a loss curve, where
    # matplotlib is installed.
    curve = common.plot_loss(output_dir / "logs" / "log.csv", output_dir / "loss.png")
    print(f"loss curve: {curve}" if curve else "loss curve: install matplotlib to draw "
          f"{output_dir / 'logs' / 'log.csv'}", flush=True)
    metrics = common.final_metrics(history, METRICS)
    baseline = popularity_baseline(etl["train_raw"], etl["eval_raw"])
    print(f"held-out NDCG@{K}={metrics[f'ndcg@{K}']:.4f}  Recall@{K}={metrics[f'recall@{K}']:.4f}"
          f"  (popularity Recall@{K}={baseline[f'recall@{K}']:.4f})", flush=True)

    # Requests are sessions as the shop stores them: lists of RAW ids, already grouped.
    # The server answers in raw ids too, without the items already in the session.
    requests = etl["eval_raw"][common.FEATURES].head(args.requests)
    answer = common.serve_and_compare(etl["workflow"], model, output_dir / "model_repository",
                                      requests, top_k=K)
    served, local = answer["served"], answer["local"]
    ids, scores = common.stacked(served, "item_ids"), common.stacked(served, "item_id_scores")
    agreement = {
        "ids_equal": bool(np.array_equal(ids, common.stacked(local, "item_ids"))),
        "max_abs_score_diff": float(np.abs(scores - common.stacked(local, "item_id_scores")).max()),
        "scores_close": bool(np.allclose(scores, common.stacked(local, "item_id_scores"),
                                         rtol=1e-5, atol=1e-6)),
    }
    recommendations = ids.tolist()
    for session, top in zip(requests[common.ITEM], recommendations):
        print(f"session {list(session)[-3:]} (last 3 items) -> top-{K}: {top}")
    print(f"Triton vs in-process: {agreement}; server ready in {answer['server_seconds']:.1f} s")
    seconds = time.perf_counter() - started
    print(f"done in {seconds:.1f} s", flush=True)
    return {
        "metrics": metrics,
        "popularity_baseline": baseline,
        "history": history,
        "requests": requests,
        "recommendations": recommendations,
        "agreement": agreement,
        "served": served,
        "local": local,
        "raw_item_ids": set(events["item_id"].tolist()),
        "seconds": seconds,
    }


if __name__ == "__main__":
    results = main()
    finite = all(math.isfinite(v) for v in results["metrics"].values())
    print(json.dumps({"metrics": results["metrics"], "agreement": results["agreement"]}))
    sys.exit(0 if finite and results["agreement"]["ids_equal"]
             and results["agreement"]["scores_close"] else 1)
