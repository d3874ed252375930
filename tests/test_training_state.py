"""resolve_strategy / prepare_model / unwrap_model on this machine, plus GPU-only checks."""

import os
import subprocess
import sys

import pytest
import torch

from merlin_t4r_ops.errors import StrategyError, T4ROpsError
from merlin_t4r_ops.training import prepare_model, resolve_strategy, unwrap_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
no_torchrun = pytest.mark.skipif(
    "RANK" in os.environ or "WORLD_SIZE" in os.environ, reason="test runs outside torchrun only"
)


@pytest.mark.skipif(N_GPUS > 1, reason="auto picks dp on a multi-GPU machine")
def test_auto_without_torchrun_is_single_device(no_launcher_env):
    state = resolve_strategy("auto")
    assert state.strategy == "single"
    assert (state.rank, state.local_rank, state.world_size) == (0, 0, 1)
    assert state.device == torch.device("cuda:0" if N_GPUS else "cpu")
    assert state.is_main_process and not state.is_distributed
    assert "no torchrun" in state.reason
    state.barrier()  # no-op, must not need a process group


def test_single_is_frozen_and_explicit(no_launcher_env):
    state = resolve_strategy("single")
    assert state.reason == "strategy='single' was asked for"
    with pytest.raises(Exception):
        state.rank = 3


@pytest.mark.skipif(N_GPUS >= 2, reason="needs a machine with fewer than two GPUs")
def test_dp_without_two_gpus_raises(no_launcher_env):
    with pytest.raises(StrategyError, match=r"strategy='dp' needs one process that sees two or more CUDA GPUs, found \d GPU"):
        resolve_strategy("dp")


def test_ddp_without_torchrun_raises(no_launcher_env):
    with pytest.raises(StrategyError, match=r"strategy='ddp' expects to be launched by torchrun .*found RANK=None, WORLD_SIZE=None"):
        resolve_strategy("ddp")


@pytest.mark.parametrize("bad", ["DDP", "fsdp", "", None, 2])
def test_unknown_strategy_raises(bad):
    with pytest.raises(StrategyError, match=r"strategy must be one of 'auto', 'single', 'dp', 'ddp', got"):
        resolve_strategy(bad)


def test_bad_rank_env_raises(no_launcher_env, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StrategyError, match=r"environment variable RANK must be an integer .* got 'zero'"):
        resolve_strategy("auto")


def test_strategy_error_is_catchable_as_package_error():
    assert issubclass(StrategyError, T4ROpsError)


def test_prepare_model_single_returns_model_on_device_and_refuses_wrapped(no_launcher_env):
    state = resolve_strategy("single")
    model = torch.nn.Linear(3, 2)
    prepared = prepare_model(model, state)
    assert prepared is model and model.weight.device.type == state.device.type
    with pytest.raises(StrategyError, match="prepare_model expects an unwrapped model, got one already wrapped in DataParallel"):
        prepare_model(torch.nn.DataParallel(model), state)
    with pytest.raises(StrategyError, match="state must be a DistributedState"):
        prepare_model(model, "single")


def test_unwrap_model_any_depth():
    inner = torch.nn.Linear(2, 2)
    assert unwrap_model(inner) is inner
    assert unwrap_model(torch.nn.DataParallel(torch.nn.DataParallel(inner))) is inner


@no_torchrun
def test_auto_under_torchrun_is_ddp_over_gloo_and_wrapping_twice_raises(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from merlin_t4r_ops.errors import StrategyError\n"
        "from merlin_t4r_ops.training import resolve_strategy, prepare_model\n"
        "s = resolve_strategy('auto')\n"
        "m = prepare_model(torch.nn.Linear(2, 2), s)\n"
        "assert type(m).__name__ == 'DistributedDataParallel'\n"
        "try:\n"
        "    prepare_model(m, s)\n"
        "    raise SystemExit('wrapping twice did not raise')\n"
        "except StrategyError as e:\n"
        "    assert 'already wrapped in DistributedDataParallel' in str(e)\n"
        "s.barrier()\n"
        "line = ' '.join(map(str, ['STATE', s.strategy, s.rank, s.local_rank, s.world_size, s.device, dist.get_backend(), s.is_main_process]))\n"
        f"open(r'{tmp_path}' + f'/rank{{s.rank}}.txt', 'w').write(line)\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = REPO
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Ranks write files: their stdout lines can interleave.
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert lines == [
        "STATE ddp 0 0 2 cpu gloo True",
        "STATE ddp 1 1 2 cpu gloo False",
    ]


# ---- GPU-only -------------------------------------------------------------------------------

@pytest.mark.multigpu
@pytest.mark.skipif(N_GPUS < 2, reason="DataParallel needs two or more CUDA GPUs")
def test_auto_with_two_gpus_is_dp(no_launcher_env):
    state = resolve_strategy("auto")
    assert state.strategy == "dp" and state.device == torch.device("cuda:0")
    model = prepare_model(torch.nn.Linear(2, 2), state)
    assert isinstance(model, torch.nn.DataParallel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nccl DDP needs a CUDA GPU")
@no_torchrun
def test_ddp_nccl_world_size_one(tmp_path):
    script = tmp_path / "nccl.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from merlin_t4r_ops.training import resolve_strategy, prepare_model\n"
        "s = resolve_strategy('ddp')\n"
        "m = prepare_model(torch.nn.Linear(2, 2), s)\n"
        "m(torch.randn(4, 2, device=s.device)).sum().backward()\n"
        "print('STATE', s.strategy, s.world_size, s.device, dist.get_backend())\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "STATE ddp 1 cuda:0 nccl" in proc.stdout
