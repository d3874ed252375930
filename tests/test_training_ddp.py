"""Two real DDP processes over gloo on 127.0.0.1, launched by torch.distributed.run.

Checks what DDP promises and what ``fit`` adds on top: identical weights on all
ranks, equality with single-process training on the same global batches,
disjoint shards that cover the dataset and are balanced by rows, exact eval
metrics equal on every rank, and resuming from rank 0's checkpoint when each
rank has its own disk. A run that hangs is killed and fails its test.
"""

import collections
import csv
import os
import shutil
import sys

import pytest
import torch

import t4r_training_factories as factories
from torchrun_launch import torchrun as launch
from merlin_t4r_ops.training import DistributedState, evaluate, load_checkpoint, make_loader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "training_scripts", "ddp_fit.py")
LOSS_SCRIPT = os.path.join(REPO, "tests", "training_scripts", "ddp_loss.py")
CPU = torch.device("cpu")


def torchrun(out, *script_args, script=SCRIPT, **launch_args):
    """:func:`torchrun_launch.torchrun` of ``script`` (``ddp_fit.py`` unless told)."""
    return launch(out, script, *script_args, **launch_args)


def lockstep_reference(task, train, epochs, batch_size, world=2):
    """Single process, same global batches: the mean loss over all targets of each global batch.

    Each rank's batch is its own forward pass (as on the ranks); the loss weighs every
    target of the global batch alike, whatever rank holds it.
    """
    model = factories.build_model(task, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loaders = [
        make_loader(train, model, DistributedState("ddp", r, r, world, CPU, "reference"),
                    batch_size=batch_size, shuffle=False)
        for r in range(world)
    ]
    assert len({len(loader) for loader in loaders}) == 1, "reference needs equal shards"
    model.train()
    for _ in range(epochs):
        for batches in zip(*loaders):
            optimizer.zero_grad()
            outputs = [model(x, targets=y, training=True) for x, y in batches]
            counts = [len(out["labels"]) for out in outputs]
            loss = sum(out["loss"] * n for out, n in zip(outputs, counts)) / sum(counts)
            loss.backward()
            optimizer.step()
    return model


def rows(path):
    """Multiset of the item sequences stored under ``path``."""
    import pandas as pd

    frame = pd.concat(
        pd.read_parquet(os.path.join(path, f)) for f in sorted(os.listdir(path)) if f.endswith(".parquet")
    )
    return collections.Counter(tuple(seq) for seq in frame["item_id-list"].map(list))


def assert_same_weights(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        if tol:
            torch.testing.assert_close(a[name], b[name], msg=name, **tol)
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_data")
    train = factories.write_sessions(str(root / "train"), 128, seed=0, n_files=2)
    # Three files of 20/20/21 rows: the two eval shards differ in size.
    valid = factories.write_sessions(str(root / "valid"), 61, seed=1, n_files=3)
    uneven = factories.write_sessions(str(root / "uneven"), 108, seed=2, sizes=[80, 28])
    return {"train": train, "valid": valid, "uneven": uneven, "root": root}


@pytest.mark.parametrize("task", ["binary", "next-item"])
def test_fit_ddp_matches_single_process_and_reduces_metrics_exactly(task, data):
    epochs, batch = 2, 16
    ranks, stdout = torchrun(
        data["root"] / f"out-{task}", "--task", task, "--train", data["train"],
        "--eval", data["valid"], "--epochs", epochs, "--batch-size", batch,
    )
    (info0, w0), (info1, w1) = ranks

    # torchrun environment -> "auto" picks DDP over gloo, one process per rank.
    assert [info0["strategy"], info1["strategy"]] == ["ddp", "ddp"]
    assert (info0["rank"], info1["rank"], info0["world_size"]) == (0, 1, 2)
    assert info0["backend"] == "gloo" and info0["device"] == "cpu"
    # Returned model is the plain T4R model with its trainability as given.
    assert info0["model_type"] == "Model" and all(info0["requires_grad"].values())

    # DDP keeps replicas identical; fit leaves the trained weights on every rank.
    assert_same_weights(w0, w1)
    reference = lockstep_reference(task, data["train"], epochs, batch)
    assert_same_weights(w0, reference.state_dict(), rtol=1e-4, atol=1e-5)

    assert_ddp_metrics_are_the_single_process_metrics(task, ranks, data["valid"], batch)
    assert info0["history"][-1]["train_samples"] == 128

    # Only the main process prints the per-epoch lines.
    assert stdout.count(f"epoch {epochs}/{epochs}") == 1


def assert_ddp_metrics_are_the_single_process_metrics(task, ranks, valid, batch):
    """Eval metrics: equal on both ranks and to a single-process eval of the same weights."""
    (info0, w0), (info1, _) = ranks
    h0, h1 = info0["history"], info1["history"]
    assert h0 == [dict(h, train_seconds=h0[i]["train_seconds"]) for i, h in enumerate(h1)]
    model = factories.build_model(task, seed=1)
    model.load_state_dict(w0)
    single = evaluate(model, valid, strategy="single", batch_size=batch)
    got = {k[len("eval_"):]: v for k, v in h0[-1].items() if k.startswith("eval_")}
    assert got.keys() == single.keys() and len(got) >= 4
    for name in single:
        assert got[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name


def test_ddp_task_metrics_are_reduced_by_torchmetrics_to_the_single_process_values(data):
    """AUROC, accuracy, MAE and RMSE that the tasks ask for, from their states on 2 ranks."""
    logs = data["root"] / "asked-metrics-logs"
    ranks, _ = torchrun(
        data["root"] / "out-asked-metrics", "--task", "asked-metrics", "--train", data["train"],
        "--eval", data["valid"], "--epochs", 1, "--batch-size", 16, "--log-dir", logs,
    )
    history = ranks[0][0]["history"][-1]
    assert {"eval_click/binary_classification_task/binary_auroc",
            "eval_rating/regression_task/mean_absolute_error"} <= set(history)
    assert_ddp_metrics_are_the_single_process_metrics("asked-metrics", ranks, data["valid"], 16)

    # fit's log: written by the main process alone, each step once, the global numbers.
    with open(logs / "log.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows if r["name"] == "train/loss"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    losses = [float(r["value"]) for r in rows if r["name"] == "train/loss"]
    assert sum(losses) / len(losses) == pytest.approx(history["train_loss"])
    logged = {r["name"][len("eval/"):]: float(r["value"])
              for r in rows if r["name"].startswith("eval/")}
    assert logged == {k[len("eval_"):]: pytest.approx(v) for k, v in history.items()
                      if k.startswith("eval_")}


def test_ddp_shards_are_disjoint_and_cover_the_dataset(data):
    ranks, _ = torchrun(
        data["root"] / "out-shards", "--task", "binary", "--train", data["uneven"], "--epochs", 0,
    )
    shards = [collections.Counter(tuple(s) for s in info["shard"]) for info, _ in ranks]
    # Files of 80 and 28 rows: balanced by rows, not by files.
    assert [sum(s.values()) for s in shards] == [54, 54]
    assert not (set(shards[0]) & set(shards[1]))
    assert shards[0] + shards[1] == rows(data["uneven"])


@pytest.fixture(scope="module")
def uneven_run(data):
    ckpt = data["root"] / "ckpt-uneven"
    ranks, _ = torchrun(
        data["root"] / "out-uneven", "--task", "binary", "--train", data["uneven"],
        "--epochs", 2, "--batch-size", 16, "--shuffle", "--checkpoint-dir", ckpt, timeout=180,
    )
    return ranks, ckpt


def test_ddp_uneven_files_train_without_repeats_and_checkpoint_once(uneven_run):
    ranks, ckpt = uneven_run
    (info0, w0), (info1, w1) = ranks
    assert_same_weights(w0, w1)
    # Files of 80 and 28 rows: 54 rows per rank, none repeated. By files (f663f0b) the
    # 28-row shard repeated its batches (16, 12, 16, 12, 16) to 5 steps: 152 samples.
    assert info0["history"][-1]["train_samples"] == 108
    saved = load_checkpoint(ckpt)
    assert saved["epoch"] == 2 and saved["world_size"] == 2 and len(saved["rng"]) == 2
    assert_same_weights(saved["model"], w0)
    # The checkpoint and fit's log (TensorBoard's runs/ where installed), no temporary file.
    assert {"last.pt", "log.csv"} <= set(os.listdir(ckpt)) <= {"last.pt", "log.csv", "runs"}


def test_ddp_resume_matches_uninterrupted_ddp_run(data, uneven_run):
    ranks, _ = uneven_run
    full = ranks[0][1]
    ckpt = data["root"] / "ckpt-resume"
    common = ["--task", "binary", "--train", data["uneven"], "--batch-size", 16, "--shuffle",
              "--checkpoint-dir", ckpt]
    torchrun(data["root"] / "out-first", *common, "--epochs", 1)
    ranks, _ = torchrun(data["root"] / "out-resumed", *common, "--epochs", 2, "--resume",
                        "--model-seed", 9)
    (info0, w0), (_, w1) = ranks
    assert_same_weights(w0, w1)
    assert_same_weights(w0, full, rtol=1e-5, atol=1e-6)
    assert [h["epoch"] for h in info0["history"]] == [1, 2]


@pytest.mark.parametrize("holder", [0, 1])
def test_ddp_resume_with_node_local_disks_follows_the_newest_checkpoint(data, uneven_run, holder):
    """Each rank its own checkpoint directory; only one holds last.pt (epoch 2).

    holder 0, f663f0b: rank 0 resumed at epoch 3, rank 1 started over at epoch 1, and the
    run hung. holder 1 is rank 0 restarted on another node than the one that wrote the
    file (torchrun's c10d rendezvous does not keep ranks on their nodes): before, both
    ranks silently started over and the two finished epochs were lost.
    """
    uninterrupted, ckpt = uneven_run
    local = data["root"] / f"node-local-{holder}"
    for rank in (0, 1):
        (local / str(rank)).mkdir(parents=True)
    shutil.copy(ckpt / "last.pt", local / str(holder) / "last.pt")
    ranks, _ = torchrun(
        data["root"] / f"out-node-local-{holder}", "--task", "binary", "--train",
        data["uneven"], "--batch-size", 16, "--shuffle", "--checkpoint-dir", local / "{rank}",
        "--epochs", 3, "--resume", "--model-seed", 9, timeout=120,
    )
    (info0, w0), (info1, w1) = ranks
    assert_same_weights(w0, w1)
    assert [h["epoch"] for h in info0["history"]] == [1, 2, 3]
    assert [h["epoch"] for h in info1["history"]] == [1, 2, 3]
    # Both ranks took epochs 1-2 from the holder's file.
    assert info0["history"][:2] == uninterrupted[0][0]["history"]
    assert info1["history"][:2] == uninterrupted[0][0]["history"]
    assert load_checkpoint(local / "0")["epoch"] == 3
    if holder == 0:
        assert os.listdir(local / "1") == []


@pytest.mark.parametrize("masking", ["clm", "mlm"])
def test_ddp_gradient_is_the_gradient_of_the_global_batch(masking, data):
    """Ranks of 16 and 32 sessions (unequal target counts), one SGD step with lr 1.

    Before: each rank's loss was the mean over its own targets, and DDP averaged the
    two, weighing a target of the 16-session rank twice as much as one of the other.
    MLM: every rank is seeded with ``seed`` (policy.py); before, rank r with ``seed + r``.
    """
    sys.path.insert(0, os.path.dirname(LOSS_SCRIPT))
    from ddp_loss import SEED, SPLITS
    from accelerate.utils import set_seed

    ranks, _ = torchrun(data["root"] / f"out-loss-{masking}", "--masking", masking,
                        script=LOSS_SCRIPT, timeout=180)
    (_, w0), (_, w1) = ranks
    assert_same_weights(w0, w1)

    model = factories.testing_model(masking)
    frame = factories.testing_frame()
    model.train()
    if masking == "clm":  # deterministic: one forward pass over the 48 sessions
        loss = model(factories.testing_batch(frame.iloc[:48]), training=True)["loss"]
    else:  # MLM masks each rank's rows from the same seed, as Hugging Face seeds every rank
        sums, count = 0, 0
        for start, stop in SPLITS:
            set_seed(SEED)
            batch = factories.testing_batch(frame.iloc[start:stop])
            model(batch, training=True)  # fit's unused-parameter probe draws its masks first
            out = model(batch, training=True)
            sums, count = sums + out["loss"] * len(out["labels"]), count + len(out["labels"])
        loss = sums / count
    loss.backward()
    with torch.no_grad():
        expected = {n: p - p.grad if p.grad is not None else p for n, p in model.named_parameters()}
    trained = {n: w0[n] for n in expected}
    assert_same_weights(trained, expected, rtol=1e-5, atol=1e-6)


def test_ddp_fit_resumed_mid_epoch_ends_on_the_uninterrupted_weights(data):
    """54 rows and 4 steps of 16 per rank and epoch, MLM, last.pt every 2 steps.

    Stopped after 7 of 8 steps, the run resumes from epoch 2, step 2; before, fit wrote
    epoch checkpoints only and resumed at the start of the epoch.
    """
    common = ["--task", "next-item", "--masking", "mlm", "--train", data["uneven"],
              "--batch-size", 16, "--shuffle", "--epochs", 2, "--save-steps", 2]
    full, _ = torchrun(data["root"] / "out-mid-full", *common, "--checkpoint-dir",
                       data["root"] / "ckpt-mid-full")
    ckpt = data["root"] / "ckpt-mid"
    torchrun(data["root"] / "out-mid-stopped", *common, "--checkpoint-dir", ckpt,
             "--stop-after", 7, results=False)
    saved = load_checkpoint(ckpt)
    assert (saved["epoch"], saved["step"]) == (1, 2)
    ranks, _ = torchrun(data["root"] / "out-mid-resumed", *common, "--checkpoint-dir", ckpt,
                        "--resume", "--model-seed", 9)
    (info0, w0), (_, w1) = ranks
    assert_same_weights(w0, w1)
    assert_same_weights(w0, full[0][1], rtol=1e-5, atol=1e-6)
    assert [h["train_samples"] for h in info0["history"]] == [108, 108]


def test_ddp_trainer_gradient_is_the_gradient_of_the_global_batch(data):
    """The Trainer's step on 2 gloo ranks of 24 sessions equals one process's on all 48 (CLM)."""
    ranks, _ = torchrun(data["root"] / "out-loss-trainer", "--masking", "clm", "--trainer",
                        script=LOSS_SCRIPT, timeout=180)
    (_, w0), (_, w1) = ranks
    assert_same_weights(w0, w1)
    model = factories.testing_model("clm")
    model.train()
    batch = factories.testing_batch(factories.testing_frame().iloc[:48])
    model(batch, training=True)["loss"].backward()
    with torch.no_grad():
        expected = {n: p - p.grad if p.grad is not None else p for n, p in model.named_parameters()}
    assert_same_weights({n: w0[n] for n in expected}, expected, rtol=1e-5, atol=1e-6)


def test_ddp_gradient_accumulation_equals_the_larger_batch(data):
    """Per rank 2 batches of 8 per step (the first under no_sync) step as one batch of 16."""
    common = ["--task", "binary", "--train", data["train"], "--epochs", 1]
    ranks16, _ = torchrun(data["root"] / "out-accumulate-1", *common, "--batch-size", 16)
    ranks8, _ = torchrun(data["root"] / "out-accumulate-2", *common, "--batch-size", 8,
                         "--accumulate", 2)
    assert_same_weights(ranks8[0][1], ranks8[1][1])
    assert_same_weights(ranks8[0][1], ranks16[0][1], rtol=1e-5, atol=1e-6)
    assert ranks8[0][0]["history"][0]["train_samples"] == 128
