"""The whole serving endpoint, raw sessions to raw ids, beside the model alone.

The ensembles in one tritonserver, measured side by side in one run, rounds alternating
(``serving.py``'s ``measure_cell``), p50 over gRPC with each request's inputs prepared once
(no metadata RPC per call):

* ``model``          encoded sessions >> ``PredictT4RPyTorch(top_k)``: the model alone, as
                     Merlin exports it (its executor model, ``LocalExecutor``);
* ``model-lean``     the model alone exported with ``merlin_t4r_ops.runtime.TritonRuntime()``:
                     a chain of one operator, run directly (``merlin_t4r_ops.runtime.chain``);
* ``endpoint``       raw sessions >> ``TransformWorkflow`` (Categorify of items and
                     categories) >> ``PredictT4RPyTorch(top_k, exclude_seen=True)`` >>
                     ``DecodeItemIds``, exported as Merlin does: NVTabular in a Triton model
                     of its own (``0_transformworkflowtriton``);
* ``endpoint-fast``  the same graph exported with
                     ``merlin_t4r_ops.runtime.TritonRuntime(lean_chain=False)``: the workflow
                     through its fast path (``merlin_t4r_ops.workflow``), inside the executor
                     model, the graph walked by Merlin's ``LocalExecutor``;
* ``endpoint-lean``  the same with ``TritonRuntime()``: the three operators run one after the
                     other (``merlin_t4r_ops.runtime.chain``), no ``LocalExecutor``;
* ``endpoint-batched`` the lean chain exported with ``BatchingTritonRuntime()``: Triton's
                     dynamic batcher hands the executor the requests queued while it was
                     busy, whose rows run as one batch (the client sends each request with a
                     leading batch dimension of 1).

Then where the time goes, per batch: the client's encoding and decoding as
``infer_dataframe`` does them (``dataframe_to_inputs``, ``response_to_dataframe``) and as
``infer_arrays`` does them for a client that holds flat arrays (``checked_arrays`` and
``arrays_to_inputs``, ``response_arrays``), with their share of the lean call,
each stage of the graph in process (NVTabular's ``Workflow._transform_df``, the fast path,
the operator with masking, ``DecodeItemIds``, the whole graph through ``LocalExecutor`` and
through the lean chain), and Triton's per-model statistics (``compute_infer`` of each
composing model and the executor; the executor's includes the workflow model it calls). The
ratios endpoint / model are printed last.

Usage::

    python benchmarks/endpoint.py --quick                    # CPU, a few minutes
    python benchmarks/endpoint.py --device cuda              # the H200 (CUDA-graph buckets)
    python benchmarks/endpoint.py --concurrency 1,64         # and 64 concurrent clients
    python benchmarks/endpoint.py --device cuda --concurrency 1,64 --seconds 3 \
        --paths model,model-lean,endpoint-fast,endpoint-lean --output endpoint-h200.md
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serving as bench  # noqa: E402  (adds the tests' factories to sys.path)
from timing import p50_ms  # noqa: E402

PATHS = {"model": "model_alone", "model-lean": "model_lean", "endpoint": "endpoint",
         "endpoint-fast": "endpoint_fast", "endpoint-lean": "endpoint_lean",
         "endpoint-batched": "endpoint_batched"}
BATCHED = ("endpoint-batched",)  # exported with BatchingTritonRuntime: requests carry a batch dim
ENCODED = ("model", "model-lean")  # the paths that take encoded sessions, not raw ones
IN_PROCESS = "in process"  # the endpoint's graph, built but not exported: its ops' stages
_CHAINS = {}
RUNTIMES = {"endpoint-fast": dict(lean_chain=False), "endpoint-lean": dict(lean_chain=True),
            "endpoint-batched": dict(lean_chain=True)}
CATEGORIES = 100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_model_args(p)
    p.add_argument("--session-len", type=int, default=20, help="longest raw session")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--concurrency", default="1", help="e.g. 1,64 (short on the CPU)")
    p.add_argument("--requests", type=int, default=None,
                   help="most requests per cell and path (200; 60 with --quick)")
    p.add_argument("--seconds", type=float, default=6.0, help="most seconds per cell and path")
    p.add_argument("--rounds", type=int, default=None, help="4; 2 with --quick")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--buckets", default="1,2,4,8,16,32,64,128,256",
                   help="CUDA-graph buckets of the operator on cuda")
    p.add_argument("--quick", action="store_true",
                   help="5k items; 60 requests and 2 rounds per cell unless given")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="model is always measured; the others: " + ", ".join(list(PATHS)[1:]))
    p.add_argument("--output", default=None, help="write the printed text here too")
    args = p.parse_args(argv)
    if args.quick:
        args.items = 5_000
    args.requests = args.requests or (60 if args.quick else 200)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.buckets = tuple(int(b) for b in args.buckets.split(",") if b)
    args.paths = ["model"] + [p for p in args.paths.split(",") if p and p != "model"]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown {sorted(unknown)}; choose from {list(PATHS)}")
    return args


def fit_workflow(items, directory):
    """Categorify of item ids (the whole catalogue, large sparse raw ids) and categories."""
    import nvtabular as nvt
    import pandas as pd
    from merlin.io import Dataset
    from merlin.schema import Tags

    from merlin_t4r_ops.harmless_warnings import cpu_datasets_quiet

    cat = dict(out_path=str(directory))
    encoded = ((["item_id-list"] >> nvt.ops.Categorify(**cat)
                >> nvt.ops.AddTags([Tags.ITEM_ID, Tags.ITEM, Tags.CATEGORICAL, Tags.LIST]))
               + (["category-list"] >> nvt.ops.Categorify(**cat)
                  >> nvt.ops.AddTags([Tags.CATEGORICAL, Tags.LIST]))
               + (["price-list"] >> nvt.ops.AddTags([Tags.CONTINUOUS, Tags.LIST])))
    workflow = nvt.Workflow(encoded)
    catalogue = pd.DataFrame({"item_id-list": [raw_item_ids(np.arange(3, items))],
                              "category-list": [raw_categories(np.arange(3, CATEGORIES))],
                              "price-list": [np.ones(items - 3, dtype=np.float32)]})
    with cpu_datasets_quiet():
        workflow.fit(Dataset(catalogue, npartitions=1))
    return workflow


def raw_item_ids(codes):
    return 10_000_000_000 + 7_919 * (np.asarray(codes, dtype=np.int64) - 3)


def raw_categories(codes):
    return 500 + 13 * (np.asarray(codes, dtype=np.int64) - 3)


def raw_sessions(batch, rng, args):
    """Sessions in the shop's ids; one item in fifty is unknown to the catalogue."""
    import t4r_factories as factories

    df = factories.random_sessions(batch, rng, max_len=args.session_len, items=args.items,
                                   categories=CATEGORIES)
    df["item_id-list"] = [np.where(rng.random(len(ids)) < 0.02, 13, raw_item_ids(ids))
                          for ids in df["item_id-list"]]
    df["category-list"] = [raw_categories(c) for c in df["category-list"]]
    return df


def export(workflow, model, args, device, path):
    """The ensembles of ``args.paths`` into one repository; returns them by path."""
    from merlin.systems.dag import Ensemble
    from merlin.systems.dag.ops.workflow import TransformWorkflow

    from merlin_t4r_ops import DecodeItemIds, PredictT4RPyTorch
    from merlin_t4r_ops.runtime import BatchingTritonRuntime, TritonRuntime

    buckets = args.buckets if device.type == "cuda" else None

    def predict(**kw):
        return PredictT4RPyTorch(model, top_k=args.top_k, device=str(device),
                                 cuda_graph_buckets=buckets, **kw)

    def endpoint():
        return Ensemble(workflow.input_schema.column_names >> TransformWorkflow(workflow)
                        >> predict(exclude_seen=True) >> DecodeItemIds(workflow),
                        workflow.input_schema)

    ensembles = {"model": Ensemble(model.input_schema.column_names >> predict(),
                                   model.input_schema)}
    ensembles["model"].export(path, name=PATHS["model"])
    ensembles[IN_PROCESS] = endpoint()
    for name in args.paths[1:]:
        if name == "model-lean":
            ensembles[name] = Ensemble(model.input_schema.column_names >> predict(),
                                       model.input_schema)
            ensembles[name].export(path, name=PATHS[name], runtime=TritonRuntime())
            continue
        ensembles[name] = endpoint()
        runtime_class = BatchingTritonRuntime if name in BATCHED else TritonRuntime
        runtime = runtime_class(**RUNTIMES[name]) if name in RUNTIMES else None
        ensembles[name].export(path, name=PATHS[name], runtime=runtime)
    return ensembles


def in_process_stages(workflow, raw, encoded, ensembles, dtypes, server, repeats, args_paths):
    """p50 ms of each stage of the endpoint, alone, in this process."""
    import tritonclient.grpc as grpcclient
    from merlin.dag import ColumnSelector
    from merlin.systems.dag.ops.workflow import TransformWorkflow
    from merlin.table import TensorTable

    from merlin_t4r_ops.runtime.chain import lean_chain
    from merlin_t4r_ops.serving.client import (
        arrays_to_inputs, checked_arrays, dataframe_arrays, dataframe_to_inputs, model_spec,
        response_arrays, response_to_dataframe)
    from merlin_t4r_ops.workflow import compile_workflow

    endpoint = args_paths[-1]  # the client's stages read this path's answer
    decode_node = ensembles[IN_PROCESS].graph.output_node  # never exported, never chained
    decode_op, predict_op = decode_node.op, decode_node.parents[0].op
    alone_op = ensembles["model"].graph.output_node.op
    raw_table = TensorTable(dataframe_arrays(raw, dtypes))
    encoded_table = TensorTable.from_df(encoded)
    everything = ColumnSelector(list(encoded_table.columns))
    top_k = predict_op.transform(everything, encoded_table)
    outputs = ensembles[endpoint].output_schema.column_names
    result = server.client().infer(PATHS[endpoint], dataframe_to_inputs(raw, dtypes),
                                   outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
    raw_arrays = dataframe_arrays(raw, dtypes)
    spec = model_spec(server.client(), PATHS[endpoint])
    stages = {
        "client encode": p50_ms(lambda: dataframe_to_inputs(raw, dtypes), repeats),
        "client encode from arrays": p50_ms(lambda: arrays_to_inputs(
            checked_arrays(raw_arrays, spec.dtypes, spec.shapes)), repeats),
        "workflow, NVTabular": p50_ms(lambda: workflow._transform_df(raw_table.to_df()), repeats),
    }
    if "endpoint-fast" in ensembles or "endpoint-lean" in ensembles:
        fast = compile_workflow(TransformWorkflow(workflow))
        stages["workflow, fast path"] = p50_ms(lambda: fast.transform(None, raw_table), repeats)
    if "endpoint-fast" in ensembles:  # exported: its graph holds the compiled workflow
        stages["graph, Merlin's LocalExecutor"] = p50_ms(
            lambda: ensembles["endpoint-fast"].transform(raw_table), repeats)
    if "endpoint-lean" in ensembles:
        # Built once: the chain decodes with a copy of the model's op (captured again).
        if "lean" not in _CHAINS:
            _CHAINS["lean"] = lean_chain(ensembles["endpoint-lean"])
        chain = _CHAINS["lean"]
        stages["graph, lean chain"] = p50_ms(lambda: chain.transform(raw_table), repeats)
    return {
        **stages,
        "model + top-k (the model alone)": p50_ms(
            lambda: alone_op.transform(everything, encoded_table), repeats),
        "model + mask + top-k": p50_ms(lambda: predict_op.transform(everything, encoded_table),
                                       repeats),
        "decode": p50_ms(lambda: decode_op.transform(ColumnSelector(list(top_k.columns)),
                                                     top_k), repeats),
        "client decode to arrays": p50_ms(lambda: response_arrays(result, outputs), repeats),
        "client decode to a DataFrame": p50_ms(
            lambda: response_to_dataframe(result, outputs), repeats),
    }


def server_stages(before, after, models):
    """Mean ms per request of Triton's compute_infer for each model between two snapshots."""
    out = {}
    for model in models:
        n = max(1, after[model]["success_n"] - before[model]["success_n"])
        out[model] = {key: (after[model][key + "_ns"] - before[model][key + "_ns"]) / n / 1e6
                      for key in ("success", "compute_infer")}
    return out


def run(args):
    import torch

    from merlin_t4r_ops.serving import triton_server
    from merlin_t4r_ops.serving.client import model_spec
    from merlin_t4r_ops.serving.triton_env import stub_threads

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(stub_threads())
    rng = np.random.default_rng(0)
    lines, stages, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="endpoint-bench-") as tmp:
        workflow = fit_workflow(args.items, Path(tmp) / "categories")
        model = bench.build_model(args, device, workflow)
        repo = Path(tmp) / "repository"
        ensembles = export(workflow, model, args, device, str(repo))
        with triton_server(repo, timeout=600) as server:
            client = server.client()
            specs = {path: model_spec(client, PATHS[path]).dtypes
                     for path in args.paths}
            models = [PATHS[path] for path in args.paths] + (
                ["0_transformworkflowtriton"] if "endpoint" in args.paths else [])
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                raw = raw_sessions(batch, rng, args)
                encoded = workflow._transform_df(raw)
                frames = {path: encoded if path in ENCODED else raw for path in args.paths}
                makers = {path: bench.triton_calls(
                    PATHS[path], ensembles[path].output_schema.column_names, frames[path],
                    specs[path], server, prepared=True, batch_dimension=path in BATCHED)
                    for path in args.paths}
                for make in makers.values():  # cold first requests stay out of the statistics
                    call = make()
                    for _ in range(3):
                        call()
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    before = {m: bench.triton_stats(client, m) for m in models}
                    cell_args = args if concurrency == 1 else bench.batch1_budget(args, concurrency)
                    cells = bench.measure_cell(makers, batch, concurrency, cell_args)
                    sent = {PATHS[path]: cells[path]["requests"] for path in args.paths}
                    if "endpoint" in args.paths:  # its workflow model answers each of them
                        sent["0_transformworkflowtriton"] = sent[PATHS["endpoint"]]
                    after = {m: bench.triton_stats(client, m, before[m], sent.get(m, 0))
                             for m in models}
                    for path, cell in cells.items():
                        lines.append((path, batch, concurrency, cell))
                        print(format_row(path, batch, concurrency, cell), flush=True)
                    for path in args.paths[1:]:
                        ratios.append((path, batch, concurrency,
                                       cells[path]["p50_ms"] / cells["model"]["p50_ms"]))
                    # The stages are those of a raw path whose requests have no batch dim.
                    raw_paths = [path for path in args.paths if path not in ENCODED + BATCHED]
                    if concurrency == 1 and raw_paths:
                        last = raw_paths[-1]
                        local = in_process_stages(workflow, raw, encoded, ensembles,
                                                  specs[last], server, 30, raw_paths)
                        stages.append((batch, server_stages(before, after, models), local,
                                       (last, cells[last]["p50_ms"])))
    return device, lines, stages, ratios


HEADER = ("| path | batch | clients | p50 ms | p99 ms | rows/s |\n"
          "|---|---:|---:|---:|---:|---:|")


def format_row(path, batch, concurrency, cell):
    return (f"| {path} | {batch} | {concurrency} | {cell['p50_ms']:.2f} | {cell['p99_ms']:.2f} "
            f"| {cell['rows_per_s']:,.0f} |")


def stage_tables(stages):
    out = []
    for batch, server, local, (path, call_ms) in stages:
        rows = [f"Batch {batch}: stages in process (p50 ms, one at a time)", "",
                "| stage | ms |", "|---|---:|"]
        rows += [f"| {stage} | {ms:.3f} |" for stage, ms in local.items()]
        client = local["client encode"] + local["client decode to a DataFrame"]
        arrays = local["client encode from arrays"] + local["client decode to arrays"]
        rows += ["", f"Client encode + decode to a DataFrame: {client:.3f} ms, "
                     f"{100 * client / call_ms:.1f}% of the {path} call's p50 ({call_ms:.2f} ms)",
                 "", f"Client encode + decode from and to arrays (infer_arrays): {arrays:.3f} ms, "
                     f"{100 * arrays / call_ms:.1f}% of it"]
        rows += ["", f"Batch {batch}: Triton, mean ms per request", "",
                 "| model | request (success) | compute_infer |", "|---|---:|---:|"]
        rows += [f"| {model} | {s['success']:.3f} | {s['compute_infer']:.3f} |"
                 for model, s in server.items()]
        out.append("\n".join(rows))
    return out


def main(argv=None):
    args = parse_args(argv)
    print(HEADER, flush=True)
    device, lines, stages, ratios = run(args)
    settings = (f"{args.model}, d_model {args.d_model}, {args.n_layer} layers, sequence length "
                f"{args.seq_len}, sessions of 1 to {args.session_len} items, {args.items:,} "
                f"items, top-{args.top_k}, device {device}, {args.rounds} rounds, "
                f"{args.requests} requests and {args.seconds} s per cell at most")
    ratio_rows = ["| path | batch | clients | p50 / model alone p50 |", "|---|---:|---:|---:|"]
    ratio_rows += [f"| {p} | {b} | {c} | {r:.2f}x |" for p, b, c, r in ratios]
    text = "\n\n".join([f"Machine: {bench.machine(device)}", f"Settings: {settings}",
                        "\n".join([HEADER] + [format_row(*line) for line in lines]),
                        "\n".join(ratio_rows), *stage_tables(stages)]) + "\n"
    print("\n" + text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
