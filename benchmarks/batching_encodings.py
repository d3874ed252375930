"""Which encoding lets tritonserver hand one Python-backend ``execute`` several requests?

Merlin exports ragged list columns as ``<col>__values`` and ``<col>__offsets`` with
``max_batch_size: 0``: no batch dimension, so Triton's dynamic batcher cannot run and every
``execute`` gets one request. This experiment serves one toy Python model five ways against
the real tritonserver and counts how many requests each ``execute`` call received:

* ``stock``      Merlin's encoding, ``max_batch_size: 0`` (the baseline);
* ``ragged``     (a) the same tensors with a leading batch dimension of 1 per request,
  ``max_batch_size > 0``, ``allow_ragged_batch`` on every input and ``dynamic_batching``;
* ``unragged``   (a) without ``allow_ragged_batch``: requests batch only when their shapes match;
* ``padded``     (b) fixed-width ``[rows, width]`` sessions plus a ``[rows, 1]`` length,
  rows as the batch dimension, ``dynamic_batching``;
* ``decoupled``  (c) Merlin's encoding with ``max_batch_size: 0`` and a decoupled model that
  queues requests from successive ``execute`` calls and answers them from its own thread.

The toy model costs a fixed 4 ms per ``execute`` plus 20 us per row, which is how an eager
forward scales on a small batch (Python and kernel launches, not arithmetic). Clients send
batch-1 requests with sessions of random length from ``--concurrency`` threads.

Usage::

    python benchmarks/batching_encodings.py --concurrency 8,16 --seconds 3
"""

import argparse
import json
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

WIDTH = 20
ENCODINGS = ("stock", "ragged", "unragged", "padded", "decoupled")
MAX_BATCH = 64

MODEL_PY = '''
import json, queue, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

COST_S, COST_PER_ROW_S = 0.004, 0.00002


def work(rows):
    time.sleep(COST_S + COST_PER_ROW_S * rows)


def rows_of(request, encoding):
    if encoding == "padded":
        return pb_utils.get_input_tensor_by_name(request, "x").as_numpy().shape[0]
    offsets = pb_utils.get_input_tensor_by_name(request, "x__offsets").as_numpy()
    return offsets.reshape(-1).size - 1


def answer(rows, group, encoding):
    out = np.full(rows, group, dtype=np.int32)
    if encoding in ("ragged", "unragged"):
        out = out.reshape(1, rows)
    elif encoding == "padded":
        out = out.reshape(rows, 1)
    return pb_utils.InferenceResponse([pb_utils.Tensor("group", out)])


class TritonPythonModel:
    def initialize(self, args):
        self.encoding = json.loads(args["model_config"])["parameters"]["encoding"]["string_value"]
        if self.encoding == "decoupled":
            self.queue = queue.Queue()
            threading.Thread(target=self.loop, daemon=True).start()

    def execute(self, requests):
        if self.encoding == "decoupled":
            for request in requests:
                self.queue.put((request, request.get_response_sender()))
            return None
        rows = [rows_of(r, self.encoding) for r in requests]
        work(sum(rows))
        return [answer(n, len(requests), self.encoding) for n in rows]

    def loop(self):
        while True:
            batch = [self.queue.get()]
            deadline = time.monotonic() + 0.0005
            while len(batch) < %d:
                try:
                    batch.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            rows = [rows_of(r, "decoupled") for r, _ in batch]
            work(sum(rows))
            for (request, sender), n in zip(batch, rows):
                sender.send(answer(n, len(batch), "decoupled"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
''' % MAX_BATCH


def config(name, delay_us):
    """The ``config.pbtxt`` of encoding ``name``."""
    ragged = "allow_ragged_batch: true" if name == "ragged" else ""
    if name == "padded":
        inputs = f"""
        input [ {{ name: "x" data_type: TYPE_INT64 dims: [ {WIDTH} ] }},
                {{ name: "x__lengths" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "group" data_type: TYPE_INT32 dims: [ 1 ] }} ]"""
    else:
        inputs = f"""
        input [ {{ name: "x__values" data_type: TYPE_INT64 dims: [ -1 ] {ragged} }},
                {{ name: "x__offsets" data_type: TYPE_INT32 dims: [ -1 ] {ragged} }} ]
        output [ {{ name: "group" data_type: TYPE_INT32 dims: [ -1 ] }} ]"""
    batching = name in ("ragged", "unragged", "padded")
    text = f"""
        name: "{name}"
        backend: "python"
        max_batch_size: {MAX_BATCH if batching else 0}
        {inputs}
        instance_group [ {{ kind: KIND_CPU count: 1 }} ]
        parameters {{ key: "encoding" value {{ string_value: "{name}" }} }}
        """
    if batching:
        text += f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    if name == "decoupled":
        text += "model_transaction_policy { decoupled: true }\n"
    return textwrap.dedent(text)


def write_repository(path, delay_us):
    for name in ENCODINGS:
        (path / name / "1").mkdir(parents=True)
        (path / name / "config.pbtxt").write_text(config(name, delay_us))
        (path / name / "1" / "model.py").write_text(MODEL_PY)


def request_arrays(name, length, rng):
    """One batch-1 request of ``name``'s encoding: a session of ``length`` items."""
    items = rng.integers(1, 1000, size=length, dtype=np.int64)
    if name == "padded":
        padded = np.zeros((1, WIDTH), dtype=np.int64)
        padded[0, :min(length, WIDTH)] = items[-WIDTH:]
        return {"x": padded, "x__lengths": np.array([[min(length, WIDTH)]], dtype=np.int32)}
    arrays = {"x__values": items, "x__offsets": np.array([0, length], dtype=np.int32)}
    if name in ("ragged", "unragged"):
        arrays = {k: v[None] for k, v in arrays.items()}
    return arrays


def _inputs(arrays):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for key, array in arrays.items():
        infer_input = grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def unary_call(client, name):
    def call(arrays):
        return client.infer(name, _inputs(arrays)).as_numpy("group").reshape(-1)[0]
    return call


def stream_call(client, name):
    """A blocking call over the gRPC stream, the only way to reach a decoupled model."""
    import queue

    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))

    def call(arrays):
        client.async_stream_infer(name, _inputs(arrays))
        result, error = answers.get()
        if error is not None:
            raise error
        return result.as_numpy("group").reshape(-1)[0]
    return call


def measure(server, name, concurrency, seconds):
    """rows/s, p50 ms and the mean number of requests per ``execute`` at ``concurrency``."""
    import tritonclient.grpc as grpcclient

    latencies, groups = [], []
    start = threading.Barrier(concurrency + 1)

    def worker(index):
        rng = np.random.default_rng(index)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        call = (stream_call if name == "decoupled" else unary_call)(client, name)
        for _ in range(3):
            call(request_arrays(name, int(rng.integers(1, 40)), rng))
        start.wait()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            arrays = request_arrays(name, int(rng.integers(1, 40)), rng)
            t0 = time.perf_counter()
            groups.append(call(arrays))
            latencies.append(time.perf_counter() - t0)
        if name == "decoupled":
            client.stop_stream()
        client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    return {"encoding": name, "concurrency": concurrency, "requests": len(latencies),
            "rows_per_s": len(latencies) / wall,
            "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "requests_per_execute": float(np.mean(groups))}


def unary_refused(server):
    """What a plain (non-streaming) ``infer`` gets from the decoupled model."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            unary_call(client, "decoupled")(request_arrays("stock", 3, np.random.default_rng()))
        except InferenceServerException as exc:
            return str(exc)
    return "accepted"


def main(argv=None):
    from merlin_t4r_ops.serving import triton_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="8,16")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    p.add_argument("--encodings", default=",".join(ENCODINGS), help=f"of {ENCODINGS}")
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="batching-encodings-") as repo:
        write_repository(Path(repo), args.delay_us)
        with triton_server(repo, timeout=300) as server:
            print("plain infer on the decoupled model:", unary_refused(server))
            print("| encoding | conc | requests | rows/s | p50 ms | requests per execute |")
            print("|---|---:|---:|---:|---:|---:|")
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                for name in args.encodings.split(","):
                    r = measure(server, name, concurrency, args.seconds)
                    rows.append(r)
                    print(f"| {name} | {concurrency} | {r['requests']} | {r['rows_per_s']:.0f} | "
                          f"{r['p50_ms']:.1f} | {r['requests_per_execute']:.1f} |", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
