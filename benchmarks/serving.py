"""Serving latency of a T4R next-item model: eager floor vs Merlin's local runtime vs Triton.

Four paths side by side, for the same sessions:

* ``eager``       the floor: ``model(padded tensors)`` under ``torch.inference_mode``;
* ``local``       ``ensemble.transform(TensorTable)``, Merlin's in-process runtime;
* ``triton-full`` tritonserver over gRPC on 127.0.0.1, full score matrix back;
* ``triton-top``  the same, returning the top ``--top-k`` items and their scores (Triton
  today);
* ``triton-batched`` the top-k ensemble exported with
  :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime`: Triton's dynamic batcher hands its
  executor several requests, which run as one batch (batching across requests).

After the grid, batch-1 requests from ``--batch1-concurrency`` clients (16 and 64 by
default, 8 with ``--quick``) compare Triton today with batching across requests, and the
gain in rows/s is printed with the requests each ``execute`` call held (Triton's own
statistics).

The Triton paths are timed from a pandas DataFrame of sessions to numpy outputs: the
client's encoding (``dataframe_to_inputs``) and decoding (``as_numpy``) are part of the
cost. The eager and local paths start from tensors built before the clock starts. Each
thread of a concurrency level has its own gRPC client. Every cell is bounded by a request
count and by a time budget, and split into ``--rounds`` that alternate between the paths,
so that load from elsewhere on the machine falls on all of them alike. The benchmark
process uses the same number of torch threads as each Triton stub (``stub_threads``), so
the floor and the served model run alike.

Usage::

    python benchmarks/serving.py --output-dir results/          # 50k items, the full grid
    python benchmarks/serving.py --quick --output-dir /tmp/sb   # small smoke run
    python benchmarks/serving.py --device cuda --instances 2    # two Triton GPU instances
"""

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]  # the tests' factories

BATCHED = "triton-batched"
PATHS = ("eager", "local", "triton-full", "triton-top", BATCHED)
# Batch-1 requests from many clients: the floor, Triton today, batching across requests.
CONCURRENT_PATHS = ("eager", "triton-top", BATCHED)


def parse_args(argv=None):
    """Command-line options; ``--quick`` shrinks every size for a smoke run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("xlnet", "gpt2"), default="xlnet")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=20)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=200, help="most requests per cell")
    p.add_argument("--seconds", type=float, default=4.0, help="most seconds per cell")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per thread")
    p.add_argument("--rounds", type=int, default=4, help="alternations of the paths per cell")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here (default: what each Triton stub gets)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--instances", type=int, default=None,
                   help="optional: rewrite the exported instance_group count (default: as exported)")
    p.add_argument("--batch1-concurrency", default=None,
                   help="clients sending batch-1 requests (default 16,64; 8 with --quick)")
    p.add_argument("--batch-delay-us", type=int, default=0,
                   help="max_queue_delay_microseconds of the triton-batched model")
    p.add_argument("--quick", action="store_true", help="1k items, 32 requests, 1 s, 2 rounds per cell")
    p.add_argument("--output-dir", default=None, help="write serving.md and serving.json here")
    args = p.parse_args(argv)
    if args.quick:
        args.items, args.requests, args.seconds, args.warmup, args.rounds = 1_000, 32, 1.0, 2, 2
    args.batch1_concurrency = args.batch1_concurrency or ("8" if args.quick else "16,64")
    return args


def build_model(args, device):
    """An untrained causal next-item model (``args.model``) over items, categories and prices."""
    import torch
    import transformers4rec.torch as tr

    import t4r_factories as factories

    torch.manual_seed(0)
    schema = factories.session_schema(items=args.items, categories=100, seq_len=args.seq_len)
    config_cls = {"xlnet": tr.XLNetConfig, "gpt2": tr.GPT2Config}[args.model]
    config = config_cls.build(d_model=args.d_model, n_head=4, n_layer=args.n_layer,
                              total_seq_length=args.seq_len)
    body = factories._body(schema, config, "causal", args.seq_len, args.d_model)
    head = tr.Head(body, tr.NextItemPredictionTask(weight_tying=True), inputs=body.inputs)
    return tr.Model(head, max_sequence_length=args.seq_len).eval().to(device)


def export_repository(model, args, device, path):
    """Export the full-score and top-k ensembles; optionally set their instance count."""
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import PredictT4RPyTorch

    ensembles = {}
    for name, top_k in (("full", None), ("top", args.top_k)):
        op = PredictT4RPyTorch(model, top_k=top_k, device=str(device))
        ensembles[name] = Ensemble(model.input_schema.column_names >> op, model.input_schema)
        ensembles[name].export(str(path), name=name)
        if args.instances:
            set_instance_count(Path(path) / name / "config.pbtxt", args.instances)
    ensembles["batched"] = export_batched(model, args, device, path)
    return ensembles


def export_batched(model, args, device, path):
    """The top-k ensemble once more, batched across requests (the ``triton-batched`` path)."""
    from merlin.systems.dag import Ensemble

    from merlin_t4r_ops import PredictT4RPyTorch
    from merlin_t4r_ops.runtime import BatchingTritonRuntime

    op = PredictT4RPyTorch(model, top_k=args.top_k, device=str(device))
    ensemble = Ensemble(model.input_schema.column_names >> op, model.input_schema)
    runtime = BatchingTritonRuntime(max_queue_delay_us=args.batch_delay_us,
                                    instances=args.instances or 1)
    ensemble.export(str(path), name="batched", runtime=runtime)
    return ensemble


def set_instance_count(config_path, count):
    """Optional post-export tuning: give every ``instance_group`` of a config ``count`` copies."""
    text = Path(config_path).read_text()
    text = re.sub(r"instance_group\s*\{", f"instance_group {{\n  count: {count}", text)
    Path(config_path).write_text(text)


def measure(calls, per_thread, seconds, warmup):
    """One round of one path: ``len(calls)`` threads, each calling its own callable.

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
            "p99_ms": float(np.percentile(lat, 99)),
            "rows_per_s": rows * len(lat) / wall,
            "requests": len(lat),
            "response_bytes": int(size),
        }
    return cells


def path_calls(path, df, inputs_dtypes, tensors, ensembles, server, device):
    """A factory of per-thread callables for ``path``; each call returns the response size."""
    import torch

    from merlin.table import TensorTable
    from merlin_t4r_ops.serving.client import dataframe_arrays, dataframe_to_inputs

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = ensembles["full"].graph.output_node.op.model
    if path == "eager":
        def make():
            def call():
                with torch.inference_mode():
                    scores = model(tensors, training=False, testing=False)
                sync()
                return scores.element_size() * scores.nelement()
            return call
        return make
    if path == "local":
        table = TensorTable(dataframe_arrays(df, inputs_dtypes))
        ensemble = ensembles["full"]

        def make():
            def call():
                out = ensemble.transform(table)
                return sum(np.asarray(out[c].values).nbytes for c in out.columns)
            return call
        return make

    name = {"triton-full": "full", "triton-top": "top", BATCHED: "batched"}[path]
    return triton_calls(name, ensembles[name].output_schema.column_names, df, inputs_dtypes,
                        server, batch_dimension=path == BATCHED)


def triton_calls(name, outputs, df, inputs_dtypes, server, *, batch_dimension=False):
    """Per-thread callables sending ``df`` to Triton model ``name``; each returns the size.

    ``batch_dimension``: the model was exported with ``BatchingTritonRuntime``, which takes
    each request as one batch entry (a leading dimension of 1 on every tensor).
    """
    import tritonclient.grpc as grpcclient

    from merlin_t4r_ops.serving.client import dataframe_to_inputs

    def make():
        client = server.client()
        requested = [grpcclient.InferRequestedOutput(o) for o in outputs]

        def call():
            inputs = dataframe_to_inputs(df, inputs_dtypes, batch_dimension=batch_dimension)
            result = client.infer(name, inputs, outputs=requested)
            for o in outputs:
                result.as_numpy(o)
            return result.get_response().ByteSize()
        return call
    return make


def execute_counts(client, name):
    """(requests, execute calls) that Triton has counted for model ``name`` so far."""
    stats = client.get_inference_statistics(name, as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def concurrent_batch1(df, dtypes, tensors, ensembles, server, device, args):
    """Batch-1 requests from each of ``--batch1-concurrency`` clients, per path.

    The ``triton-batched`` cells also carry ``requests_per_execute``: how many requests
    Triton's dynamic batcher put in one ``execute`` call, from the server's statistics.
    """
    makers = {path: path_calls(path, df, dtypes, tensors, ensembles, server, device)
              for path in CONCURRENT_PATHS}
    stats = server.client()
    rows = []
    for concurrency in [int(c) for c in args.batch1_concurrency.split(",")]:
        # Enough requests that every client sends 25 per round (a few per client would time
        # little but the clients' start), and at least 2 s per cell; still bounded by both.
        budget = argparse.Namespace(**{
            **vars(args), "requests": max(args.requests, 25 * concurrency * args.rounds),
            "seconds": max(args.seconds, 2.0)})
        before = execute_counts(stats, "batched")
        cells = measure_cell(makers, 1, concurrency, budget)
        requests, executions = np.subtract(execute_counts(stats, "batched"), before)
        cells[BATCHED]["requests_per_execute"] = requests / max(1, executions)
        for path, cell in cells.items():
            cell.update(path=path, batch=1, concurrency=concurrency,
                        vs_floor=cell["p50_ms"] / cells["eager"]["p50_ms"])
            rows.append(cell)
            print(format_row(cell), flush=True)
    return rows


def batching_gains(rows):
    """Markdown table: rows/s of batching across requests over Triton today, batch 1."""
    cells = {(r["path"], r["concurrency"]): r for r in rows if r["batch"] == 1}
    lines = ["| batch-1 clients | Triton today rows/s | batched rows/s | gain | "
             "requests per execute |", "|---:|---:|---:|---:|---:|"]
    for (path, concurrency), batched in sorted(cells.items(), key=lambda kv: kv[0][1]):
        today = cells.get(("triton-top", concurrency))
        if path != BATCHED or today is None or "requests_per_execute" not in batched:
            continue
        lines.append(f"| {concurrency} | {today['rows_per_s']:,.0f} | "
                     f"{batched['rows_per_s']:,.0f} | "
                     f"{batched['rows_per_s'] / today['rows_per_s']:.2f}x | "
                     f"{batched['requests_per_execute']:.1f} |")
    return "\n".join(lines)


def run(args):
    """Build, export, serve, and measure every (path, batch, concurrency) cell."""
    import torch
    import t4r_factories as factories

    from merlin_t4r_ops.serving import triton_server
    from merlin_t4r_ops.serving.client import _input_dtypes
    from merlin_t4r_ops.serving.triton_env import stub_threads

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads or stub_threads())
    model = build_model(args, device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as repo:
        ensembles = export_repository(model, args, device, repo)
        with triton_server(repo, timeout=600) as server:
            dtypes = _input_dtypes(server.client(), "full")
            for batch in batches:
                df = factories.random_sessions(batch, rng, max_len=args.seq_len,
                                               items=args.items, categories=100)
                tensors = {k: v.to(device) for k, v in
                           factories.reference_inputs(df, args.seq_len).items()}
                makers = {path: path_calls(path, df, dtypes, tensors, ensembles, server, device)
                          for path in PATHS}
                for concurrency in levels:
                    cells = measure_cell(makers, batch, concurrency, args)
                    floor = cells["eager"]["p50_ms"]
                    for path, cell in cells.items():
                        cell.update(path=path, batch=batch, concurrency=concurrency,
                                    vs_floor=cell["p50_ms"] / floor)
                        rows.append(cell)
                        print(format_row(cell), flush=True)
                if batch == 1:
                    rows += concurrent_batch1(df, dtypes, tensors, ensembles, server, device,
                                              args)
    return rows, device


HEADER = ("| path | batch | conc | p50 ms | p99 ms | rows/s | response bytes | p50 / floor |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")


def format_row(r):
    """One markdown table row."""
    return (f"| {r['path']} | {r['batch']} | {r['concurrency']} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {r['rows_per_s']:,.0f} | {r['response_bytes']:,} | "
            f"{r['vs_floor']:.2f}x |")


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
    """Run the benchmark; print the table and write it under ``--output-dir``."""
    import torch

    args = parse_args(argv)
    print(HEADER, flush=True)
    rows, device = run(args)
    settings = (f"{args.model}, d_model {args.d_model}, {args.n_layer} layers, sequence "
                f"length {args.seq_len}, {args.items:,} items, top-{args.top_k}, device "
                f"{device}, instances {args.instances or 'as exported'}, torch threads "
                f"{torch.get_num_threads()}, {args.rounds} rounds")
    settings += f", triton-batched max_queue_delay_us {args.batch_delay_us}"
    table = "\n".join([HEADER] + [format_row(r) for r in rows])
    gains = batching_gains(rows)
    print(f"\nBatching across requests, measured in the same run:\n{gains}")
    print(f"\nMachine: {machine(device)}\nSettings: {settings}\n")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serving.md").write_text(
            f"Machine: {machine(device)}\n\nSettings: {settings}\n\n{table}\n\n{gains}\n")
        (out / "serving.json").write_text(json.dumps(
            {"machine": machine(device), "settings": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
