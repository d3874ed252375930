"""Serving latency of a T4R next-item model: eager and CUDA graphs, in process and on Triton.

Paths, side by side on the same sessions (``--paths`` picks; the first four by default):

* ``eager``           in process: the operator's eager forward + top-k, from CPU tensors to
                      CPU outputs (copies included) -- today's floor;
* ``captured``        in process: the same replayed from the operator's CUDA-graph buckets
                      (copy in, replay, copy out), ``merlin_t4r_ops.ops.cuda_graphs``;
* ``triton``          tritonserver over gRPC on 127.0.0.1, top-k, eager operator (today);
* ``triton-captured`` the same with the operator's CUDA-graph buckets;
* ``local``, ``local-captured``  Merlin's in-process runtime (``ensemble.transform``): the
                      executor's own Python, without Triton and gRPC;
* ``triton-full``     Triton returning the full ``[batch, items]`` scores (eager);
* ``compiled``        in process: ``torch.compile(mode="reduce-overhead")`` of the same
                      forward + top-k, the alternative to our own buckets (compile time and
                      parity with eager are printed at its first call);
* ``triton-batched``  Triton with batching across requests: the top-k ensemble exported with
                      ``merlin_t4r_ops.runtime.BatchingTritonRuntime`` (eager operator);
* ``triton-batched-captured``  the same with the operator's CUDA-graph buckets;
* ``triton-decoded``, ``triton-decoded-captured``  ``triton`` and ``triton-captured`` with
                      the session's items masked too (``exclude_seen=True``) and
                      ``DecodeItemIds`` turning the ids into int64 raw ids through a Categorify
                      vocabulary of the whole catalogue: a complete endpoint. A table gives
                      their p50 against the plain top-k path.

After the grid, batch-1 requests from ``--batch1-concurrency`` clients (16 and 64 by default,
8 with ``--quick``) compare Triton today with batching across requests, and the gain in
rows/s is printed with the requests each ``execute`` call held (Triton's statistics).

The Triton paths are timed from a pandas DataFrame of sessions to numpy outputs: the
client's encoding (``dataframe_to_inputs``) and decoding (``as_numpy``) are part of the
cost. Each thread of a concurrency level has its own gRPC client. Every cell is bounded by a
request count and by a time budget, and split into ``--rounds`` that alternate between the
paths, so that load from elsewhere on the machine falls on all of them alike. The benchmark
process uses the same number of torch threads as each Triton stub (``stub_threads``).

On CUDA two more tables say where the time goes: per bucket, the GPU time of forward + top-k
(CUDA events around back-to-back graph replays) against the captured and eager paths in
process; and per Triton path, the server's own statistics (queue, compute input, infer,
output) against what the client saw.

Usage::

    python benchmarks/serving.py --output-dir results/          # the full grid
    python benchmarks/serving.py --quick --output-dir /tmp/sb   # small smoke run
    python benchmarks/serving.py --device cuda --instances 2    # two Triton GPU instances
    python benchmarks/serving.py --paths triton,triton-decoded  # masking + decoding vs top-k
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]  # the tests' factories

BATCHED, BATCHED_CAPTURED = "triton-batched", "triton-batched-captured"
PATHS = ("eager", "captured", "triton", "triton-captured",
         "local", "local-captured", "triton-full", "compiled", BATCHED, BATCHED_CAPTURED,
         "triton-decoded", "triton-decoded-captured")
DEFAULT_PATHS = "eager,captured,triton,triton-captured,triton-batched"
# Which exported ensemble each Triton or local path uses.
ENSEMBLE_OF = {"triton": "top", "triton-captured": "top_captured", "triton-full": "full",
               "local": "top", "local-captured": "top_captured",
               BATCHED: "batched", BATCHED_CAPTURED: "batched_captured",
               "triton-decoded": "decoded", "triton-decoded-captured": "decoded_captured"}
# Each masked-and-decoded path and the plain top-k path it is compared with.
DECODED_VS_PLAIN = {"triton-decoded": "triton", "triton-decoded-captured": "triton-captured"}
# Batch-1 requests from many clients: the floor, Triton today and batching across requests
# (in-process CUDA-graph replays share static buffers, so "captured" stays out).
CONCURRENT_PATHS = ("eager", "triton", "triton-captured", BATCHED, BATCHED_CAPTURED)


def add_model_args(p):
    """The model's and the top-k's arguments (``build_model`` reads them)."""
    p.add_argument("--model", choices=("xlnet", "gpt2"), default="xlnet")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=20)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--top-k", type=int, default=20)


def parse_args(argv=None):
    """Command-line options; ``--quick`` shrinks every size for a smoke run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--session-len", type=int, default=None,
                   help="longest session sent, in items (default --seq-len; beyond max(128, --seq-len), a "
                        "captured exclude_seen masks the older items after the replay)")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--concurrency", default="1")
    p.add_argument("--paths", default=DEFAULT_PATHS, help=f"comma-separated, of {PATHS}")
    p.add_argument("--no-bucket-table", dest="bucket_table", action="store_false",
                   help="skip the per-bucket GPU-time table (CUDA)")
    p.add_argument("--buckets", default="1,2,4,8,16,32,64,128,256",
                   help="the operator's CUDA-graph buckets (captured paths)")
    p.add_argument("--requests", type=int, default=200, help="most requests per cell")
    p.add_argument("--seconds", type=float, default=4.0, help="most seconds per cell")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per thread")
    p.add_argument("--rounds", type=int, default=4, help="alternations of the paths per cell")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here (default: what each Triton stub gets)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--instances", type=int, default=None,
                   help="optional: executor instances per GPU (default: as Merlin exports)")
    p.add_argument("--batch1-concurrency", default=None,
                   help="clients sending batch-1 requests (default 16,64; 8 with --quick)")
    p.add_argument("--batch-delay-us", type=int, default=0,
                   help="max_queue_delay_microseconds of the triton-batched models")
    p.add_argument("--quick", action="store_true", help="1k items, 32 requests, 1 s, 2 rounds per cell")
    p.add_argument("--output-dir", default=None, help="write serving.md and serving.json here")
    args = p.parse_args(argv)
    if args.quick:
        args.items, args.requests, args.seconds, args.warmup, args.rounds = 1_000, 32, 1.0, 2, 2
    args.session_len = args.seq_len if args.session_len is None else args.session_len
    if args.session_len < 1:
        p.error(f"--session-len must be at least 1, got {args.session_len}")
    args.batch1_concurrency = args.batch1_concurrency or ("8" if args.quick else "16,64")
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        p.error(f"--paths: unknown {unknown}; choose from {PATHS}")
    args.buckets = tuple(int(b) for b in args.buckets.split(",") if b)
    return args


def build_model(args, device, workflow):
    """An untrained causal next-item model (``args.model``) over items, categories and prices.

    Its item column is the one ``workflow``'s Categorify made, as a real model's is: the
    operator then reserves Categorify's ids, which ``DecodeItemIds`` refuses to decode.
    """
    import torch
    import transformers4rec.torch as tr
    from merlin.schema import Schema

    import t4r_factories as factories

    torch.manual_seed(0)
    schema = factories.session_schema(items=args.items, categories=100, seq_len=args.seq_len)
    items = schema["item_id-list"]
    encoded = workflow.output_schema["item_id-list"]
    schema = Schema([items.with_properties({**encoded.properties, "value_count":
                                            items.properties["value_count"]})
                     if column.name == items.name else column for column in schema])
    config_cls = {"xlnet": tr.XLNetConfig, "gpt2": tr.GPT2Config}[args.model]
    config = config_cls.build(d_model=args.d_model, n_head=4, n_layer=args.n_layer,
                              total_seq_length=args.seq_len)
    body = factories._body(schema, config, "causal", args.seq_len, args.d_model)
    head = tr.Head(body, tr.NextItemPredictionTask(weight_tying=True), inputs=body.inputs)
    return tr.Model(head, max_sequence_length=args.seq_len).eval().to(device)


def catalogue_workflow(items, directory):
    """A fitted Categorify whose vocabulary is the whole catalogue of the model.

    Encoded ids 3 .. ``items - 1`` (0-2 are Categorify's reserved ids) get large, sparse int64
    raw ids, so that ``DecodeItemIds`` does the work a shop's vocabulary asks of it.
    """
    import nvtabular as nvt
    import pandas as pd
    from merlin.io import Dataset
    from merlin.schema import Tags

    raw_ids = 10_000_000_000 + 7_919 * np.arange(items - 3, dtype=np.int64)
    encode = (["item_id-list"] >> nvt.ops.Categorify(out_path=str(directory))
              >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.CATEGORICAL, Tags.LIST]))
    workflow = nvt.Workflow(encode)
    workflow.fit(Dataset(pd.DataFrame({"item_id-list": [raw_ids]}), npartitions=1))
    return workflow


def export_repository(model, args, device, path, decoders):
    """Export the ensembles the chosen paths need, with ``--instances`` per GPU if given.

    The masked-and-decoded ones end with their ``DecodeItemIds`` from ``decoders``.
    """
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import PredictT4RPyTorch

    # name: (top_k, CUDA-graph buckets, exclude_seen and decode)
    settings = {"full": (None, None, False), "top": (args.top_k, None, False),
                "top_captured": (args.top_k, args.buckets, False),
                "batched": (args.top_k, None, False),
                "batched_captured": (args.top_k, args.buckets, False),
                "decoded": (args.top_k, None, True),
                "decoded_captured": (args.top_k, args.buckets, True)}
    needed = {ENSEMBLE_OF[p] for p in args.paths if p in ENSEMBLE_OF}
    ensembles = {}
    for name in sorted(needed):
        top_k, buckets, decoded = settings[name]
        pipeline = model.input_schema.column_names >> PredictT4RPyTorch(
            model, top_k=top_k, device=str(device), cuda_graph_buckets=buckets,
            exclude_seen=decoded)
        if decoded:
            assert len(decoders[name].vocabulary.raw_ids) == args.items - 3  # every id decodes
            pipeline = pipeline >> decoders[name]
        ensembles[name] = Ensemble(pipeline, model.input_schema)
        ensembles[name].export(str(path), name=name, runtime=export_runtime(name, args))
    return ensembles


def export_runtime(name, args):
    """Merlin's runtime, or ours for ``--instances`` and for batching across requests."""
    from merlin_t4r_ops.runtime import BatchingTritonRuntime, TritonRuntime

    instances = {"instances": args.instances} if args.instances else {}
    if name.startswith("batched"):
        return BatchingTritonRuntime(max_queue_delay_us=args.batch_delay_us, **instances)
    return TritonRuntime(**instances) if instances else None


def measure(calls, per_thread, seconds, warmup):
    """One round of one path: ``len(calls)`` threads, each calling its own callable.

    With one callable the round runs in the calling thread and its wall time is the sum of
    the request latencies (nothing else runs between them).

    Returns
    -------
    tuple
        Latencies in ms (all threads), wall seconds of the round, size of one response.
    """
    latencies = [[] for _ in calls]
    sizes = [0] * len(calls)
    start = threading.Barrier(len(calls) + 1)

    def worker(i):
        for _ in range(warmup):
            sizes[i] = calls[i]()
        start.wait()
        deadline = time.perf_counter() + seconds
        while len(latencies[i]) < per_thread and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            calls[i]()
            latencies[i].append(time.perf_counter() - t0)

    if len(calls) == 1:
        # Concurrency 1 runs in this thread: torch.compile's CUDA-graph trees are bound to
        # the thread that compiled them (torch 2.11 asserts in cudagraph_trees otherwise).
        start = threading.Barrier(1)
        worker(0)
        return [1e3 * x for x in latencies[0]], sum(latencies[0]), sizes[0]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    return [1e3 * x for lat in latencies for x in lat], wall, sizes[0]


def measure_cell(makers, rows, concurrency, args):
    """All paths of one (batch, concurrency) cell, alternating over ``args.rounds`` rounds.

    Returns
    -------
    dict
        Per path: ``p50_ms``, ``p99_ms``, ``rows_per_s`` (over the wall time of all
        threads), ``requests`` and ``response_bytes`` (of one response).
    """
    calls = {path: [make() for _ in range(concurrency)] for path, make in makers.items()}
    per_thread = max(1, args.requests // (concurrency * args.rounds))
    totals = {path: ([], 0.0, 0) for path in makers}
    for round_ in range(args.rounds):
        for path in makers:
            lat, wall, size = measure(calls[path], per_thread, args.seconds / args.rounds,
                                      args.warmup if round_ == 0 else 1)
            old = totals[path]
            totals[path] = (old[0] + lat, old[1] + wall, size)
    cells = {}
    for path, (lat, wall, size) in totals.items():
        cells[path] = {
            "p50_ms": float(np.percentile(lat, 50)),
            "mean_ms": float(np.mean(lat)),
            "p99_ms": float(np.percentile(lat, 99)),
            "rows_per_s": rows * len(lat) / wall,
            "requests": len(lat),
            "response_bytes": int(size),
        }
    return cells


def in_process_ops(model, args):
    """The operator eager and with CUDA-graph buckets (captured now, logged), in process."""
    from merlin_t4r_ops import PredictT4RPyTorch

    eager = PredictT4RPyTorch(model, top_k=args.top_k, cuda_graph_buckets=None)
    captured = PredictT4RPyTorch(model, top_k=args.top_k, cuda_graph_buckets=args.buckets)
    captured._capture_graphs()
    return {"eager": eager, "captured": captured}


def path_calls(path, df, inputs_dtypes, cpu_inputs, ops, ensembles, server):
    """A factory of per-thread callables for ``path``; each call returns the response size."""
    import torch

    from merlin.table import TensorTable
    from merlin_t4r_ops.serving.client import dataframe_arrays

    def nbytes(outputs):
        return sum(v.element_size() * v.nelement() for v in outputs.values())

    if path == "eager":
        op = ops["eager"]
        device = op.device

        def make():
            def call():
                with torch.inference_mode():
                    outputs = op._device_outputs({k: v.to(device) for k, v in cpu_inputs.items()})
                return nbytes({k: v.cpu() for k, v in outputs.items()})
            return call
        return make
    if path == "captured":
        graphs = ops["captured"]._graph_runner()
        op = ops["captured"] if graphs is not None and graphs.bucket_for(len(df)) else ops["eager"]

        def make():
            def call():  # op.predict's own choice: the bucket, or eager above the largest
                if op is ops["eager"]:
                    with torch.inference_mode():
                        outputs = op._device_outputs(
                            {k: v.to(op.device) for k, v in cpu_inputs.items()})
                    return nbytes({k: v.cpu() for k, v in outputs.items()})
                # To the host, as op.predict does: a replay alone returns before the GPU ends.
                return nbytes({k: v.cpu() for k, v in graphs(cpu_inputs).items()})
            return call
        return make
    if path == "compiled":
        return compiled_calls(ops, cpu_inputs)
    if path.startswith("local"):
        table = TensorTable(dataframe_arrays(df, inputs_dtypes))
        ensemble = ensembles[ENSEMBLE_OF[path]]

        def make():
            def call():
                out = ensemble.transform(table)
                return sum(np.asarray(out[c].values).nbytes for c in out.columns)
            return call
        return make

    name = ENSEMBLE_OF[path]
    return triton_calls(name, ensembles[name].output_schema.column_names, df, inputs_dtypes,
                        server, batch_dimension=name.startswith("batched"))


def triton_calls(name, outputs, df, inputs_dtypes, server, *, batch_dimension=False,
                 prepared=False):
    """Per-thread callables sending ``df`` to Triton model ``name``; each returns the size.

    ``batch_dimension``: the model was exported with ``BatchingTritonRuntime``, which takes
    each request as one batch entry (a leading dimension of 1 on every tensor).
    ``prepared``: the inputs are encoded once per thread, not on every call.
    """
    import tritonclient.grpc as grpcclient

    from merlin_t4r_ops.serving.client import dataframe_to_inputs

    def make():
        client = server.client()
        requested = [grpcclient.InferRequestedOutput(o) for o in outputs]

        once = (dataframe_to_inputs(df, inputs_dtypes, batch_dimension=batch_dimension)
                if prepared else None)

        def call():
            inputs = once or dataframe_to_inputs(df, inputs_dtypes,
                                                 batch_dimension=batch_dimension)
            result = client.infer(name, inputs, outputs=requested)
            for o in outputs:
                result.as_numpy(o)
            return result.get_response().ByteSize()
        return call
    return make


def compiled_calls(ops, cpu_inputs):
    """``torch.compile(mode="reduce-overhead")`` of the operator's forward + top-k."""
    import torch

    op = ops["eager"]
    device = op.device
    if "compiled" not in ops:
        ops["compiled"] = torch.compile(op._device_outputs, mode="reduce-overhead",
                                        dynamic=False)
    compiled = ops["compiled"]

    def run_once():
        with torch.inference_mode(), torch.device(device):
            outputs = compiled({k: v.to(device) for k, v in cpu_inputs.items()})
            return {k: v.cpu() for k, v in outputs.items()}

    t0 = time.perf_counter()
    got = run_once()
    with torch.inference_mode():
        want = op._device_outputs({k: v.to(device) for k, v in cpu_inputs.items()})
    same = all(torch.allclose(got[k].float(), want[k].cpu().float(), rtol=1e-5, atol=1e-5)
               for k in ("item_id_scores",) if k in got)
    print(f"compiled: batch {len(next(iter(cpu_inputs.values())))}, first call (compile) "
          f"{time.perf_counter() - t0:.1f} s, top-k scores equal eager: {same}", flush=True)

    def make():
        def call():
            return sum(v.element_size() * v.nelement() for v in run_once().values())
        return call
    return make


def gpu_times(op, example_inputs, repeats=50):
    """Per captured bucket: ms of GPU time per forward + top-k, from back-to-back replays.

    ``example_inputs`` maps bucket -> inputs of exactly that many rows.
    """
    import torch

    graphs = op._graph_runner()
    times = {}
    for bucket in example_inputs:
        captured = graphs.captured[bucket]
        for name, value in example_inputs[bucket].items():
            captured.inputs[name].copy_(value)
        captured.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            captured.graph.replay()
        end.record()
        end.synchronize()
        times[bucket] = start.elapsed_time(end) / repeats
    return times


def bucket_table(ops, rng, args):
    """Per bucket: GPU time of forward + top-k, captured and eager p50 in process, ratios."""
    import t4r_factories as factories

    graphs = ops["captured"]._graph_runner()
    if graphs is None or not graphs.covered:
        return []
    rows = []
    for bucket in graphs.covered:
        df = factories.random_sessions(bucket, rng, max_len=args.seq_len, items=args.items,
                                       categories=100)
        cpu_inputs = factories.reference_inputs(df, args.seq_len)
        gpu = gpu_times(ops["captured"], {bucket: cpu_inputs})
        makers = {p: path_calls(p, df, None, cpu_inputs, ops, {}, None)
                  for p in ("eager", "captured")}
        cells = measure_cell(makers, bucket, 1, args)
        rows.append({"bucket": bucket, "gpu_ms": gpu[bucket],
                     "captured_ms": cells["captured"]["p50_ms"],
                     "eager_ms": cells["eager"]["p50_ms"]})
        print(format_bucket_row(rows[-1]), flush=True)
    return rows


def triton_stats(client, name, before=None, sent=0):
    """Triton's cumulative inference statistics of one model (counts and nanoseconds).

    Triton counts a request after its answer has left, so they are read once settled: at
    least ``sent`` requests counted since ``before`` (an earlier ``triton_stats``), and the
    counts holding still (:func:`merlin_t4r_ops.serving.statistics.settled_statistics`).
    """
    from merlin_t4r_ops.serving.statistics import Counts, settled_statistics

    since = Counts(before["requests"], before["executions"]) if before else Counts(0, 0)
    stats = settled_statistics(client, name, since, expect=sent)
    inference = stats.get("inference_stats", {})
    # Requests (failed ones too) and execute calls: their ratio is the batch Triton formed.
    out = {"requests": int(stats.get("inference_count", 0) or 0),
           "executions": int(stats.get("execution_count", 0) or 0)}
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        out[key + "_ns"] = int(inference.get(key, {}).get("ns", 0) or 0)
        out[key + "_n"] = int(inference.get(key, {}).get("count", 0) or 0)
    return out


def stats_row(before, after, path, batch, cell):
    """Mean ms per request of each server stage between two snapshots, and the client's."""
    n = max(1, after["success_n"] - before["success_n"])

    def ms(key):
        return (after[key + "_ns"] - before[key + "_ns"]) / n / 1e6

    server = ms("success")
    executions = max(1, after["executions"] - before["executions"])
    return {"path": path, "batch": batch, "client_p50_ms": cell["p50_ms"],
            "requests_per_execute": (after["requests"] - before["requests"]) / executions,
            "client_mean_ms": cell["mean_ms"], "server_ms": server,
            "queue_ms": ms("queue"), "input_ms": ms("compute_input"),
            "infer_ms": ms("compute_infer"), "output_ms": ms("compute_output"),
            "outside_ms": cell["mean_ms"] - server}


def run(args):
    """Build, export, serve, and measure every (path, batch, concurrency) cell."""
    import torch
    import t4r_factories as factories

    from merlin_t4r_ops import DecodeItemIds
    from merlin_t4r_ops.serving import triton_server
    from merlin_t4r_ops.serving.client import model_spec
    from merlin_t4r_ops.serving.triton_env import stub_threads

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads or stub_threads())
    # The catalogue's vocabulary is read here, outside the repository (Triton reads its
    # folders as models); the model's item column and the DecodeItemIds keep what they need.
    with tempfile.TemporaryDirectory(prefix="serving-bench-catalogue-") as tmp:
        workflow = catalogue_workflow(args.items, tmp)
        model = build_model(args, device, workflow)
        decoders = {ENSEMBLE_OF[path]: DecodeItemIds(workflow) for path in DECODED_VS_PLAIN}
    ops = in_process_ops(model, args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = np.random.default_rng(0)
    result = {"rows": [], "buckets": [], "stats": [],
              "graphs": (ops["captured"]._graphs.summary() if ops["captured"]._graphs
                         else "no CUDA graphs (CPU)")}
    print(result["graphs"], flush=True)
    if device.type == "cuda" and "captured" in args.paths and args.bucket_table:
        print(BUCKET_HEADER, flush=True)
        result["buckets"] = bucket_table(ops, rng, args)
    print(HEADER, flush=True)
    triton_paths = [p for p in args.paths if p.startswith("triton")]
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as repo:
        ensembles = export_repository(model, args, device, repo, decoders)
        serve = triton_server(repo, timeout=600) if ensembles else contextlib.nullcontext()
        with serve as server:
            stats_client = server.client() if server else None
            dtypes = (model_spec(stats_client, "top" if "top" in ensembles
                                 else next(iter(ensembles))).dtypes
                      if server else None)
            for batch in batches:
                df = factories.random_sessions(batch, rng, max_len=args.session_len,
                                               items=args.items, categories=100)
                cpu_inputs = factories.reference_inputs(df, args.seq_len)
                makers = {path: path_calls(path, df, dtypes, cpu_inputs, ops, ensembles, server)
                          for path in args.paths}
                for path in triton_paths:  # cold first requests stay out of the statistics
                    call = makers[path]()
                    for _ in range(3):
                        call()
                for concurrency in levels:
                    record_cell(makers, batch, concurrency, args, stats_client, result)
                if batch == 1:  # then from many clients at once
                    concurrent = {p: m for p, m in makers.items() if p in CONCURRENT_PATHS}
                    for concurrency in [int(c) for c in args.batch1_concurrency.split(",")]:
                        record_cell(concurrent, 1, concurrency, batch1_budget(args, concurrency),
                                    stats_client, result)
    return result, device


def batch1_budget(args, concurrency):
    """``args`` for a cell of batch-1 requests from ``concurrency`` clients.

    Every client sends up to 25 requests per round (with the grid's budget, a few per client
    would time little but the clients' start), and the cell gets at least 2 s.
    """
    return argparse.Namespace(**{
        **vars(args), "requests": max(args.requests, 25 * concurrency * args.rounds),
        "seconds": max(args.seconds, 2.0)})


def record_cell(makers, batch, concurrency, args, stats_client, result):
    """Measure one (batch, concurrency) cell of ``makers``; add its rows and Triton stats."""
    triton_paths = [p for p in makers if p.startswith("triton")]
    before = {p: triton_stats(stats_client, ENSEMBLE_OF[p]) for p in triton_paths}
    cells = measure_cell(makers, batch, concurrency, args)
    floor = cells["eager"]["p50_ms"] if "eager" in cells else float("nan")
    for path, cell in cells.items():
        cell.update(path=path, batch=batch, concurrency=concurrency,
                    vs_floor=cell["p50_ms"] / floor)
        result["rows"].append(cell)
        print(format_row(cell), flush=True)
    for path in triton_paths:
        after = triton_stats(stats_client, ENSEMBLE_OF[path], before[path],
                             sent=cells[path]["requests"])
        result["stats"].append(dict(stats_row(before[path], after, path, batch, cells[path]),
                                    concurrency=concurrency))


def batching_gains(result):
    """Markdown table: batch-1 rows/s of each batching path over Triton today, per clients."""
    rows = {(r["path"], r["concurrency"]): r for r in result["rows"] if r["batch"] == 1}
    per_execute = {(r["path"], r["concurrency"]): r["requests_per_execute"]
                   for r in result["stats"] if r["batch"] == 1}
    lines = ["| batch-1 clients | path | Triton today rows/s | rows/s | gain | "
             "requests per execute |", "|---:|---|---:|---:|---:|---:|"]
    for (path, concurrency), row in sorted(rows.items(), key=lambda kv: kv[0][1]):
        today = rows.get(("triton", concurrency))
        if not path.startswith(BATCHED) or today is None:
            continue
        lines.append(f"| {concurrency} | {path} | {today['rows_per_s']:,.0f} | "
                     f"{row['rows_per_s']:,.0f} | {row['rows_per_s'] / today['rows_per_s']:.2f}x"
                     f" | {per_execute.get((path, concurrency), float('nan')):.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


HEADER = ("| path | batch | conc | p50 ms | p99 ms | rows/s | response bytes | p50 / floor |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")


BUCKET_HEADER = ("| bucket | GPU ms (fwd + top-k) | captured p50 ms | captured / GPU | "
                 "eager p50 ms | eager / captured |\n|---:|---:|---:|---:|---:|---:|")
STATS_HEADER = ("| path | batch | conc | client p50 ms | client mean ms | server mean ms | queue "
                "| compute input | compute infer | compute output | client + gRPC (means) "
                "| requests per execute |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_bucket_row(r):
    """One row of the per-bucket table."""
    return (f"| {r['bucket']} | {r['gpu_ms']:.3f} | {r['captured_ms']:.3f} | "
            f"{r['captured_ms'] / r['gpu_ms']:.2f}x | {r['eager_ms']:.3f} | "
            f"{r['eager_ms'] / r['captured_ms']:.1f}x |")


def format_stats_row(r):
    """One row of the Triton statistics table (mean ms per request)."""
    return (f"| {r['path']} | {r['batch']} | {r['concurrency']} | {r['client_p50_ms']:.2f} | "
            f"{r['client_mean_ms']:.2f} | {r['server_ms']:.2f} | {r['queue_ms']:.2f} | "
            f"{r['input_ms']:.2f} | {r['infer_ms']:.2f} | {r['output_ms']:.2f} | "
            f"{r['outside_ms']:.2f} | {r['requests_per_execute']:.1f} |")


DECODED_HEADER = ("| path | vs | batch | conc | plain top-k p50 ms | masked + decoded p50 ms "
                  "| ratio |\n|---|---|---:|---:|---:|---:|---:|")


def decoded_rows(rows):
    """Each masked-and-decoded cell beside its plain top-k cell (p50, ratio)."""
    p50 = {(r["path"], r["batch"], r["concurrency"]): r["p50_ms"] for r in rows}
    return [{"path": path, "vs": DECODED_VS_PLAIN[path], "batch": batch, "concurrency": conc,
             "plain_ms": p50[(DECODED_VS_PLAIN[path], batch, conc)], "decoded_ms": value}
            for (path, batch, conc), value in p50.items()
            if path in DECODED_VS_PLAIN and (DECODED_VS_PLAIN[path], batch, conc) in p50]


def format_decoded_row(r):
    """One row of the masked-and-decoded vs plain top-k table."""
    return (f"| {r['path']} | {r['vs']} | {r['batch']} | {r['concurrency']} | "
            f"{r['plain_ms']:.2f} | {r['decoded_ms']:.2f} | "
            f"{r['decoded_ms'] / r['plain_ms']:.2f}x |")


def format_row(r):
    """One markdown table row; the last cell is "-" when no eager floor was measured."""
    vs_floor = "-" if np.isnan(r["vs_floor"]) else f"{r['vs_floor']:.2f}x"
    return (f"| {r['path']} | {r['batch']} | {r['concurrency']} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {r['rows_per_s']:,.0f} | {r['response_bytes']:,} | "
            f"{vs_floor} |")


def machine(device):
    """CPU model and core count, plus the GPU's name when one is used."""
    import torch

    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    text = f"{cpu}, {os.cpu_count()} cores"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text


def main(argv=None):
    """Run the benchmark; print the tables and write them under ``--output-dir``."""
    import torch

    args = parse_args(argv)
    result, device = run(args)
    settings = (f"{args.model}, d_model {args.d_model}, {args.n_layer} layers, sequence "
                f"length {args.seq_len}, sessions of 1 to {args.session_len} items, "
                f"{args.items:,} items, top-{args.top_k}, device "
                f"{device}, instances {args.instances or 'as exported'}, torch threads "
                f"{torch.get_num_threads()}, {args.rounds} rounds, buckets {list(args.buckets)}, "
                f"batched max_queue_delay_us {args.batch_delay_us}")
    tables = ["\n".join([HEADER] + [format_row(r) for r in result["rows"]])]
    if result["buckets"]:
        tables.insert(0, "\n".join([BUCKET_HEADER]
                                   + [format_bucket_row(r) for r in result["buckets"]]))
    if result["stats"]:
        tables.append("\n".join([STATS_HEADER]
                                 + [format_stats_row(r) for r in result["stats"]]))
    result["decoded"] = decoded_rows(result["rows"])
    if result["decoded"]:
        tables.append("\n".join([DECODED_HEADER]
                                 + [format_decoded_row(r) for r in result["decoded"]]))
    gains = batching_gains(result)
    if gains:
        tables.append("Batching across requests, measured in the same run:\n\n" + gains)
    text = (f"Machine: {machine(device)}\n\nSettings: {settings}\n\n{result['graphs']}\n\n"
            + "\n\n".join(tables) + "\n")
    print("\n" + text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serving.md").write_text(text)
        (out / "serving.json").write_text(json.dumps(
            {"machine": machine(device), "settings": {**vars(args), "buckets": list(args.buckets)},
             **result}, indent=2))


if __name__ == "__main__":
    main()
