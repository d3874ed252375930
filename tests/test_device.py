"""Where a model instance runs: each Triton instance on its own GPU, never GPU 0 by accident.

The decision is a pure function of Triton's ``initialize`` args, the operator's ``device=`` and
the number of GPUs torch sees, so it is tested here on the CPU with the args dicts Triton's
Python backend passes. The GPU tests load a real export the way Merlin's executor does, from
inside ``initialize(args)``, and check what one GPU (or two) can show.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from merlin.systems.dag import Ensemble
from merlin.table import TensorTable

import t4r_factories as factories
from merlin_t4r_ops import PredictT4RPyTorch
from merlin_t4r_ops.errors import T4ROpsError
from merlin_t4r_ops.ops.device import choose_device, instance_placement, resolve_device
from merlin_t4r_ops.serving import triton_server
from merlin_t4r_ops.serving.client import infer_dataframe

N_GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(N_GPUS < 1, reason=f"needs a CUDA GPU, found {N_GPUS}")
needs_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs two CUDA GPUs, found {N_GPUS}")


def triton_args(kind, device_id=0, instance="executor_model_0_0"):
    """The dict Triton's Python backend hands ``initialize`` (every key and value a string)."""
    return {
        "model_config": json.dumps({"name": "executor_model", "backend": "python"}),
        "model_instance_kind": kind,
        "model_instance_name": instance,
        "model_instance_device_id": str(device_id),
        "model_repository": "/models/executor_model",
        "model_version": "1",
        "model_name": "executor_model",
    }


def placed(requested, args, cuda_count):
    kind, device_id, index = instance_placement(args)
    return choose_device(requested, kind, device_id, cuda_count, index)


@pytest.mark.parametrize("requested", [None, "cuda"])
@pytest.mark.parametrize("gpu", [0, 1, 3])
def test_a_gpu_instance_runs_on_its_own_gpu(requested, gpu):
    args = triton_args("GPU", gpu, instance=f"executor_model_0_{gpu}")
    assert placed(requested, args, cuda_count=4) == torch.device("cuda", gpu)


def test_device_cuda_at_export_no_longer_pins_every_instance_to_gpu_0():
    devices = {placed("cuda", triton_args("GPU", gpu), cuda_count=8) for gpu in range(8)}
    assert devices == {torch.device("cuda", gpu) for gpu in range(8)}


def test_kind_model_instances_spread_over_the_gpus():
    # Triton gives every KIND_MODEL instance device id 0 and numbers the instances.
    args = [triton_args("MODEL", 0, f"executor_model_0_{i}") for i in range(4)]
    assert [placed(None, a, cuda_count=2) for a in args] == [
        torch.device("cuda", i % 2) for i in range(4)
    ]


def test_kind_model_without_a_gpu_runs_on_the_cpu():
    assert placed(None, triton_args("MODEL"), cuda_count=0) == torch.device("cpu")


@pytest.mark.parametrize("cuda_count", [0, 2])
def test_a_cpu_instance_runs_on_the_cpu(cuda_count):
    assert placed(None, triton_args("CPU"), cuda_count) == torch.device("cpu")


@pytest.mark.parametrize("requested", ["cpu", "cuda:1"])
def test_an_explicit_device_wins(requested):
    assert placed(requested, triton_args("GPU", 0), cuda_count=2) == torch.device(requested)


def test_outside_triton_the_default_is_the_cpu_and_cuda_means_the_current_gpu():
    assert placed(None, None, cuda_count=2) == torch.device("cpu")
    assert placed("cuda", None, cuda_count=2) == torch.device("cuda")


def test_a_gpu_torch_does_not_see_is_an_error_naming_it():
    with pytest.raises(T4ROpsError, match=r"KIND_GPU instance on device 3 asks for GPU 3, "
                                          r"but torch sees only 2 CUDA device"):
        placed(None, triton_args("GPU", 3), cuda_count=2)
    with pytest.raises(T4ROpsError, match=r"device='cuda:1' asks for GPU 1, but torch sees no"):
        placed("cuda:1", None, cuda_count=0)


def test_triton_args_are_read_from_the_initialize_frame():
    """Merlin's executor calls load_artifacts from initialize(args) without passing args."""
    def initialize(args):
        return resolve_device(None)

    assert initialize(triton_args("CPU")) == torch.device("cpu")
    if N_GPUS == 0:
        with pytest.raises(T4ROpsError, match=r"KIND_GPU instance on device 0 .* no CUDA"):
            initialize(triton_args("GPU", 0))


# -- on a GPU --------------------------------------------------------------------------------

def _export(tmp_path, device=None):
    model = factories.next_item_model("xlnet-causal", seed=31)
    op = PredictT4RPyTorch(model, device=device)
    Ensemble(model.input_schema.column_names >> op, model.input_schema).export(str(tmp_path))
    return model, tmp_path / "executor_model" / "1" / "ensemble"


def initialize(args, ensemble_path):
    """Merlin's executor model's ``initialize(args)``: the operators read ``args`` from here."""
    return factories.load_exported(ensemble_path)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("device", [None, "cuda"])
def test_gpu_instance_loads_on_its_gpu_and_answers_like_eager(tmp_path, device):
    model, path = _export(tmp_path, device)
    ensemble = initialize(triton_args("GPU", 0), path)
    op = ensemble.graph.output_node.op
    assert op.device == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    df = factories.random_sessions(12, np.random.default_rng(0))
    got = np.asarray(ensemble.transform(TensorTable.from_df(df))["next-item"].values)
    np.testing.assert_allclose(got, factories.eager_scores(model, df), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_triton_runs_a_device_cuda_export_on_its_gpu_instance(tmp_path):
    model, _ = _export(tmp_path, "cuda")
    df = factories.random_sessions(12, np.random.default_rng(1))
    with triton_server(tmp_path, timeout=300) as server:
        served = infer_dataframe(server.client(), df)
        logs = server.logs()
    assert "PredictT4RPyTorch in executor_model_0_0 (KIND_GPU, device 0) runs on cuda:0" in logs
    np.testing.assert_allclose(np.stack(served["next-item"].to_list()),
                               factories.eager_scores(model, df), rtol=1e-4, atol=1e-5)


_SECOND_GPU = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    import t4r_factories as factories
    from merlin.dag import ColumnSelector
    from merlin.systems.dag import Ensemble
    from merlin.table import TensorTable
    from test_device import triton_args

    ensemble = Ensemble.load({path!r})  # Merlin's imports may touch CUDA themselves
    op = ensemble.graph.output_node.op
    before = torch._C._cuda_hasPrimaryContext(0)

    def initialize(args):
        op.load_artifacts({path!r})

    initialize(triton_args("GPU", 1, "executor_model_0_1"))
    df = factories.random_sessions(4, np.random.default_rng(0))
    op.transform(ColumnSelector(), TensorTable.from_df(df))
    print(op.device, torch.cuda.current_device(), before, torch._C._cuda_hasPrimaryContext(0))
""")


@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("device", [None, "cuda"])
def test_instance_on_gpu_1_leaves_gpu_0_alone(tmp_path, device):
    """In a fresh process, as in a Triton stub: loading and answering open no context on GPU 0."""
    _, path = _export(tmp_path, device)
    script = _SECOND_GPU.format(tests=str(Path(__file__).parent), path=str(path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    placed_on, current, before, after = result.stdout.split()[-4:]
    assert (placed_on, current) == ("cuda:1", "1")
    assert after == before, "loading or answering on GPU 1 opened a context on GPU 0"


def _request_on(device: str, table: TensorTable, kind: str) -> TensorTable:
    """``table`` as a workflow on ``device`` hands it over: cupy (cuDF) or torch columns."""
    if kind == "cupy":
        try:  # importorskip skips only a missing module, not one built for another numpy
            import cupy  # noqa: F401
        except ImportError as exc:
            pytest.skip(f"cuDF workflows hand over cupy columns; cupy does not import: {exc}")
        return table.gpu()
    from merlin.table import TorchColumn

    def tensor(array):
        return None if array is None else torch.as_tensor(array).to(device)

    return TensorTable({name: TorchColumn(tensor(column.values), tensor(column.offsets))
                        for name, column in table.items()})


def _answers_a_request_on(device, kind):
    model = factories.next_item_model(seed=8)
    op = PredictT4RPyTorch(model, top_k=5, exclude_seen=True)  # exclude_seen reads the ids too
    df = factories.random_sessions(6, np.random.default_rng(9))
    host = op.predict(TensorTable.from_df(df))
    got = op.predict(_request_on(device, TensorTable.from_df(df), kind))
    for name in ("item_ids", "item_id_scores"):
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(host[name]), rtol=1e-6)


def test_a_request_of_torch_columns_is_answered_like_numpy():
    _answers_a_request_on("cpu", "torch")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_a_request_of_gpu_columns_is_answered_like_numpy(kind):
    """A GPU workflow's columns (cupy from cuDF, or CUDA tensors). Before: TypeError."""
    _answers_a_request_on("cuda", kind)
