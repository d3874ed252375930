"""Session -> will it convert? A binary classifier trained with ``fit`` and served on Triton.

Same synthetic events and ETL as ``session_based.py``; the label is whether the session had
a purchase (the ``Groupby``'s ``purchase-max``). The served workflow is the fitted encoder
with the label input removed (``Workflow.remove_inputs``), so clients send only sessions.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TARGET = "purchase"
OUTPUT = f"{TARGET}/binary_classification_task"
METRICS = {name: f"{OUTPUT}/binary_{name}" for name in ("accuracy", "precision", "recall")}


def build_model(schema, max_length: int, d_model: int = 32):
    """An XLNet body summarised by its last position, then a sigmoid."""
    import transformers4rec.torch as tr

    inputs = tr.TabularSequenceFeatures.from_schema(
        schema.select_by_name(common.FEATURES), max_sequence_length=max_length,
        aggregation="concat", d_output=d_model, masking="clm",
    )
    config = tr.XLNetConfig.build(d_model=d_model, n_head=2, n_layer=1,
                                  total_seq_length=max_length)
    body = tr.SequentialBlock(inputs, tr.MLPBlock([d_model]),
                              tr.TransformerBlock(config, masking=inputs.masking))
    task = tr.BinaryClassificationTask(TARGET, summary_type="last")
    return tr.Model(tr.Head(body, task, inputs=inputs), max_sequence_length=max_length)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-length", type=int, default=20)
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-dir", type=Path,
                        default=Path("example_output/binary_classification"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Run the example; return eval metrics and Triton vs in-process scores."""
    import nvtabular as nvt
    import torch

    from merlin_t4r_ops.training import fit

    args = parse_args(argv)
    started = time.perf_counter()
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    events = common.generate_events(args.sessions, n_items=args.items, seed=args.seed)
    etl = common.run_etl(events, output_dir, max_length=args.max_length, min_length=2,
                         eval_fraction=args.eval_fraction, target=TARGET)
    positive = float(etl["train_raw"][TARGET].mean())
    print(f"ETL: {len(etl['train_raw'])} training sessions, {positive:.1%} with a purchase")

    torch.manual_seed(args.seed)
    model = build_model(etl["workflow"].output_schema, args.max_length)
    history = fit(model, str(etl["train_dir"]), eval_data=str(etl["eval_dir"]),
                  epochs=args.epochs, strategy="auto", batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, progress=not args.no_progress)
    metrics = common.final_metrics(history, METRICS)
    print("held-out " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

    # Loaded fresh from disk, as a serving job would: remove_inputs changes the workflow
    # in place, and the label is not something a live request carries.
    serving_workflow = nvt.Workflow.load(str(output_dir / "workflow")).remove_inputs([TARGET])
    requests = etl["eval_raw"][common.FEATURES].head(args.requests)
    answer = common.serve_and_compare(serving_workflow, model, output_dir / "model_repository",
                                      requests)
    served = answer["served"][OUTPUT].to_numpy()
    local = answer["local"][OUTPUT].to_numpy()
    agreement = {"max_abs_score_diff": float(np.abs(served - local).max()),
                 "scores_close": bool(np.allclose(served, local, rtol=1e-5, atol=1e-6))}
    for i, (s, l) in enumerate(zip(served, local)):
        print(f"session {i}: triton={s:.6f}  in-process={l:.6f}  "
              f"label={etl['eval_raw'][TARGET].iloc[i]:.0f}")
    seconds = time.perf_counter() - started
    print(f"Triton vs in-process: {agreement}; done in {seconds:.1f} s", flush=True)
    return {"metrics": metrics, "history": history, "served": served, "local": local,
            "agreement": agreement, "seconds": seconds}


if __name__ == "__main__":
    results = main()
    finite = all(math.isfinite(v) for v in results["metrics"].values())
    sys.exit(0 if finite and results["agreement"]["scores_close"] else 1)
