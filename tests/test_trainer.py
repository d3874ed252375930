"""CPU tests of merlin_t4r_ops.training.Trainer: strategy rules, exact metrics, DDP over gloo."""

import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import (  # noqa: E402
    ITEM_COL,
    MAX_LEN,
    TOP_KS,
    make_args,
    make_model,
    make_schema,
    write_sessions,
)

from conftest import LAUNCH_VARS  # noqa: E402
from merlin_t4r_ops.errors import StrategyError  # noqa: E402
from merlin_t4r_ops.training import Trainer  # noqa: E402
from merlin_t4r_ops.training.state import DistributedState  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "trainer_scripts", "ddp_next_item.py")
PREDICT_SCRIPT = os.path.join(HERE, "trainer_scripts", "ddp_predict.py")
BIG_CATALOGUE = 50_000
pytestmark = pytest.mark.usefixtures("no_launcher_env")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions")
    # 3 train partitions over 2 ranks: by partitions 171 vs 85 rows, 11 vs 6 batches, which
    # f663f0b refused under DDP; balanced by rows, 128 rows and 8 batches per rank.
    train, train_sessions = write_sessions(str(root / "train"), 256, 3, seed=0)
    # 3 eval partitions of 34/33/33 rows: 50 rows per rank.
    evals, eval_sessions = write_sessions(str(root / "eval"), 100, 3, seed=1)
    return {"train": train, "eval": evals, "train_sessions": train_sessions,
            "eval_sessions": eval_sessions, "schema": make_schema()}


def _trainer(data, out, model=None, strategy="single", **arg_overrides):
    model = model if model is not None else make_model(data["schema"])
    return Trainer(
        model=model,
        args=make_args(str(out), **arg_overrides),
        strategy=strategy,
        schema=data["schema"],
        train_dataset_or_path=data["train"],
        eval_dataset_or_path=data["eval"],
        compute_metrics=True,
    )


def _direct_metrics(model, sessions):
    """NDCG@k / Recall@k per session from one forward pass over all sessions (no T4R metrics)."""
    padded = torch.zeros(len(sessions), MAX_LEN, dtype=torch.long)
    for i, s in enumerate(sessions):
        padded[i, : len(s)] = torch.tensor(s)
    model.eval()
    with torch.no_grad():
        out = model({ITEM_COL: padded}, testing=True)
    scores, labels = out["predictions"], out["labels"]
    assert labels.shape[0] == len(sessions)  # eval masks exactly the last item of each session
    rank = 1 + (scores > scores.gather(1, labels[:, None])).sum(1).double()
    per = {}
    for k in TOP_KS:
        hit = rank <= k
        per[f"ndcg_at_{k}"] = torch.where(hit, 1.0 / torch.log2(rank + 1), torch.zeros_like(rank))
        per[f"recall_at_{k}"] = hit.double()
    return per


def test_dp_on_cpu_raises_strategy_error(data, tmp_path):
    expected = r"strategy='dp' needs one process that sees two or more CUDA GPUs, found 0"
    with pytest.raises(StrategyError, match=expected):
        _trainer(data, tmp_path, strategy="dp")


def test_ddp_without_launcher_raises_strategy_error(data, tmp_path):
    with pytest.raises(StrategyError, match=r"strategy='ddp' expects to be launched by torchrun"):
        _trainer(data, tmp_path, strategy="ddp")


def test_single_train_leaves_trained_unwrapped_weights_in_users_model(data, tmp_path):
    model = make_model(data["schema"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(data, tmp_path, model=model, strategy="auto")
    assert trainer.dist_state.strategy == "single"
    trainer.train()
    assert trainer.model is model and type(model).__name__ == "Model"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "training did not change any weight of the model object passed in"


def _compiling_trainer(data, out, monkeypatch, mode, drop_last):
    """Our Trainer with Hugging Face's ``torch_compile_mode``. Hugging Face passes the mode to
    accelerate in the process's environment; monkeypatch takes it away after the test."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", mode)
    return _trainer(data, out, torch_compile_mode=mode, dataloader_drop_last=drop_last)


def _compile_kwargs_on(trainer, device):
    """accelerate's ``torch.compile`` kwargs once ``trainer`` sets up its accelerator, as
    ``Trainer.__init__`` does, for one ``device`` (torch.compile is lazy: all on the CPU)."""
    trainer.dist_state = DistributedState("single", 0, 0, 1, torch.device(device), "stated")
    trainer.create_accelerator_and_postprocess()
    return trainer.accelerator.state.dynamo_plugin.to_kwargs()


@pytest.mark.parametrize("device,drop_last,mode,graphs", [
    ("cuda:0", True, "reduce-overhead", True),  # every batch one shape: fit's options
    ("cuda:0", False, "reduce-overhead", False),  # a short last batch: Hugging Face's mode
    ("cuda:0", True, "default", False),
    ("cpu", True, "reduce-overhead", False),
])
def test_torch_compile_reduce_overhead_skips_the_dynamic_graphs_as_fit_does(
        data, tmp_path, monkeypatch, device, drop_last, mode, graphs):
    # Hugging Face compiles through accelerate with the mode alone: CUDA graphs recorded anew
    # for each batch's count of non-padded positions ran this Trainer at 0.41-0.50 of the
    # cached loop's pace on an H100 (docs/benchmarks.md).
    trainer = _compiling_trainer(data, tmp_path, monkeypatch, mode, drop_last)
    kwargs = _compile_kwargs_on(trainer, device)
    if not graphs:
        assert "options" not in kwargs and kwargs.get("mode", "default") == mode
        return
    config = torch.compile(trainer.model, **kwargs).get_compiler_config()
    assert config["triton.cudagraphs"] is True
    assert config["triton.cudagraph_skip_dynamic_graphs"] is True


def test_torch_compile_reduce_overhead_is_set_back_where_cuda_graphs_cannot_run(
        data, tmp_path, monkeypatch):
    # accelerate keeps its compile plugin on the process's shared state: the next Trainer of
    # the same arguments finds it as the last one left it.
    trainer = _compiling_trainer(data, tmp_path, monkeypatch, "reduce-overhead", True)
    _compile_kwargs_on(trainer, "cuda:0")
    kwargs = _compile_kwargs_on(trainer, "cpu")
    assert kwargs["mode"] == "reduce-overhead" and "options" not in kwargs


@pytest.mark.parametrize("arch,batch_size", [("xlnet", 16), ("xlnet", 33), ("gpt2", 33)])
def test_eval_metrics_are_exact_not_mean_of_batch_means(data, tmp_path, arch, batch_size):
    model = make_model(data["schema"], arch=arch, seed=3)
    # 100 sessions: batches 16 x 6 + 4, or 33 x 3 + 1 (a one-row batch, which T4R's RecallAt
    # cannot take on its own).
    trainer = _trainer(data, tmp_path, model=model, per_device_eval_batch_size=batch_size)
    metrics = trainer.evaluate()

    per = _direct_metrics(model, data["eval_sessions"])
    differs = 0
    for name, values in per.items():
        exact = values.mean().item()
        batch_means = [chunk.mean().item() for chunk in values.split(batch_size)]
        mean_of_means = float(np.mean(batch_means))
        assert metrics[f"eval_/next-item/{name}"] == pytest.approx(exact, abs=1e-6), name
        differs += abs(mean_of_means - exact) > 1e-3
    assert differs, "test data should make mean-of-batch-means differ from the exact mean"


def test_evaluate_takes_every_form_of_eval_dataset(data, tmp_path):
    # A directory as os.PathLike, or a merlin.io.Dataset, passed to evaluate() is what is
    # evaluated, not silently replaced by eval_dataset_or_path.
    from merlin.io import Dataset

    trainer = _trainer(data, tmp_path, model=make_model(data["schema"], seed=3))
    train_dir = os.path.dirname(data["train"][0])
    expected = trainer.evaluate(train_dir)["eval_/loss"]
    assert expected != pytest.approx(trainer.evaluate()["eval_/loss"], rel=1e-6)
    for form in (pathlib.Path(train_dir), Dataset(data["train"], engine="parquet")):
        loss = trainer.evaluate(form)["eval_/loss"]
        assert loss == pytest.approx(expected, rel=1e-6), type(form).__name__


def test_eval_matches_transformers4rec_single_process(data, tmp_path):
    # Same metric names and values as T4R where T4R is right (one process).
    from transformers4rec.torch import Trainer as T4RTrainer

    model = make_model(data["schema"], seed=4)
    ours = _trainer(data, tmp_path, model=model).evaluate()
    theirs = T4RTrainer(
        model=model, args=make_args(str(tmp_path)), schema=data["schema"],
        eval_dataset_or_path=data["eval"], compute_metrics=True,
    ).evaluate()
    names = [k for k in theirs if k.startswith("eval_/next-item/")]
    assert names and set(names) <= set(ours)
    for k in names:
        assert ours[k] == pytest.approx(theirs[k], abs=1e-6), k


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(train, evals, out, timeout=600, script=SCRIPT, script_args=None):
    """Two ranks as two simulated *nodes* (LOCAL_RANK 0 on both, RANK 0 and 1), gloo.

    ``script`` runs with ``script_args``, by default ``--train TRAIN --eval EVAL --out OUT``.
    Returns the launchers' return codes and the tail of their logs.
    """
    if script_args is None:
        script_args = ["--train", *train, "--eval", *evals, "--out", str(out)]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
            "--master_addr=127.0.0.1", f"--master_port={port}",
            script, *script_args,
        ]
        log = open(out / f"launcher{node}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = "\n".join((out / f"launcher{n}.log").read_text()[-4000:] for n in range(2))
    return [p.returncode for p, _ in procs], logs


@pytest.fixture(scope="module")
def ddp_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_out")
    codes, logs = _launch_two_nodes(data["train"], data["eval"], out)
    assert codes == [0, 0], logs
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return reports, weights


def test_ddp_ranks_are_global_and_shards_disjoint_and_complete(ddp_run, data):
    reports, _ = ddp_run
    assert [r["strategy"] for r in reports] == ["ddp", "ddp"]
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"]) for r in reports] == [("0", "0"), ("1", "0")]
    for key, every in (("train_shard", "train_sessions"), ("eval_shard", "eval_sessions")):
        a, b = ({tuple(s) for s in r[key]} for r in reports)
        assert not a & b, f"{key}: ranks share sessions"
        assert a | b == {tuple(s) for s in data[every]}, f"{key}: ranks do not cover the data"
    assert [len(r["train_shard"]) for r in reports] == [128, 128]
    assert [len(r["eval_shard"]) for r in reports] == [50, 50]
    assert [r["global_step"] for r in reports] == [8, 8]


def test_local_process_zero_is_local_rank_0_and_world_zero_alone_saves(ddp_run):
    """Hugging Face's meanings: one progress bar per node, one process that saves."""
    reports, _ = ddp_run
    assert [r["process_zero"] for r in reports] == [
        {"local": True, "world": True, "should_save": True},
        {"local": True, "world": False, "should_save": False},  # node 1's LOCAL_RANK 0
    ]


def test_ddp_trainer_settles_unused_parameters_as_fit_does(ddp_run):
    """``ddp_find_unused_parameters`` unset: one probe batch, the parameters no rank uses
    (XLNet's ``mask_emb``, ...) frozen while training, plain DDP (training/policy.py).

    Before, Hugging Face passed ``find_unused_parameters=True`` for any non-``PreTrainedModel``:
    DDP searched the autograd graph for unused parameters after every forward pass.
    """
    reports, _ = ddp_run
    assert [r["find_unused_parameters"] for r in reports] == [False, False]
    assert all(r["all_trainable_after"] for r in reports)


def test_ddp_weights_identical_and_in_users_model(ddp_run, data):
    reports, (w0, w1) = ddp_run
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    init = make_model(data["schema"]).state_dict()
    assert any(not torch.equal(w0[k], init[k]) for k in w0), "DDP training changed no weight"
    assert all(r["model_is_users"] and r["model_type"] == "Model" for r in reports)


def test_ddp_eval_metrics_equal_on_ranks_and_to_single_process(ddp_run, data, tmp_path):
    reports, (w0, _) = ddp_run
    m0, m1 = reports[0]["metrics"], reports[1]["metrics"]
    assert m0 == m1  # bitwise: one all_reduce of the same sums
    assert {f"eval_/next-item/{m}_{k}" for m in ("ndcg_at", "recall_at") for k in TOP_KS} <= set(m0)
    # Predictions of both ranks are gathered on rank 0 only: 100 sessions, top-10 ids, scores.
    assert [r["pred_shapes"] for r in reports] == [[[100, 10], [100, 10]], None]

    model = make_model(data["schema"])
    model.load_state_dict(w0)
    single = _trainer(data, tmp_path, model=model).evaluate()
    for k, v in m0.items():
        assert not math.isnan(v)
        assert single[k] == pytest.approx(v, abs=1e-6), k


@pytest.fixture(scope="module")
def ddp_predict_run(tmp_path_factory):
    """2 gloo ranks, a 50,000-item catalogue, 100 sessions per rank: evaluate(), predict()."""
    root = tmp_path_factory.mktemp("ddp_predict")
    evals, _ = write_sessions(str(root / "eval"), 200, 2, seed=2, n_items=BIG_CATALOGUE)
    out = root / "out"
    out.mkdir()
    codes, logs = _launch_two_nodes(
        None, None, out, script=PREDICT_SCRIPT,
        script_args=["--eval", *evals, "--out", str(out), "--items", str(BIG_CATALOGUE)],
    )
    assert codes == [0, 0], logs
    return evals, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_predict_gathers_top_k_on_rank_0_only(ddp_predict_run, tmp_path):
    evals, (rank0, rank1) = ddp_predict_run
    assert rank1["phases"]["predict_top_k"]["predictions"] is None
    gathered = rank0["phases"]["predict_top_k"]["predictions"]
    assert gathered["shapes"] == [[200, 100], [200, 100]]
    # Unshuffled, rank r holds the r-th contiguous half of the rows, and rank 0 concatenates
    # the ranks in rank order: the same rows in the same order as one process predicting all.
    schema = make_schema(n_items=BIG_CATALOGUE)
    single = Trainer(model=make_model(schema), args=make_args(str(tmp_path), predict_top_k=100),
                     strategy="single", schema=schema).predict(evals)
    np.testing.assert_array_equal(np.array(gathered["ids"]), single.predictions[0])
    np.testing.assert_allclose(np.array(gathered["scores"]), single.predictions[1], rtol=1e-5)


def test_ddp_evaluate_and_predict_do_not_hold_every_ranks_scores(ddp_predict_run):
    _, reports = ddp_predict_run
    evaluations = [r["phases"]["evaluate"]["metrics"] for r in reports]
    assert evaluations[0] == evaluations[1] and "eval_/loss" in evaluations[0]
    # One rank's 100 x 50,001 float32 scores are 20 MB. Gathering them (as pickled objects,
    # which tracemalloc sees) costs every rank at least twice that; top-k costs 100 KB.
    own_scores = 100 * reports[0]["full_scores_bytes"]
    for report in reports:
        for phase in ("evaluate", "predict_top_k"):
            peak = report["phases"][phase]["traced_peak"]
            assert peak < own_scores / 4, (report["rank"], phase, peak, own_scores)
