"""How many loader workers each rank starts: none by default, and its share of the node's
cores never oversubscribed without a warning."""

import os

import pytest
import torch

from merlin_t4r_ops.training import DistributedState
from merlin_t4r_ops.training.data import ShardedLoader, as_dataset, worker_share
from torchrun_launch import torchrun

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training_scripts",
                      "ddp_workers.py")


def test_two_gloo_ranks_share_the_cores_without_oversubscription(tmp_path):
    ranks, _ = torchrun(tmp_path, SCRIPT)
    infos = [info for info, _ in ranks]
    cores = infos[0]["cores"]
    for info in infos:
        assert info["local_world_size"] == 2, info
        assert info["started_by_default"] == 0, info  # batches made in the training process
        assert info["share"] == cores // 2, info
        assert info["started_for_share"] == min(info["share"], 2), info
        assert len(info["over_share_warnings"]) == 1, info
        assert f"num_workers={cores // 2 + 1} is more than this rank's share" \
            in info["over_share_warnings"][0], info
    assert sum(info["started_for_share"] for info in infos) <= cores, infos


def test_a_rank_s_share_is_its_cores_over_the_local_ranks():
    cores = len(os.sched_getaffinity(0))
    single = DistributedState("single", 0, 0, 1, torch.device("cuda", 0), "stand-in")
    assert worker_share(single) == cores
    eight = DistributedState("ddp", 0, 0, 8, torch.device("cuda", 0), "stand-in",
                             local_world_size=8)
    assert worker_share(eight) == cores // 8


def test_no_workers_by_default_on_a_gpu_either(tmp_path):
    import t4r_training_factories as factories

    path = factories.write_sessions(str(tmp_path / "train"), 32, n_files=1)
    on_cuda = DistributedState("single", 0, 0, 1, torch.device("cuda", 0), "stand-in")
    loader = ShardedLoader(as_dataset(path), on_cuda, 16, ["item_id-list"], ["click"])
    assert loader.num_workers == 0
    with pytest.warns(UserWarning, match=r"num_workers=\d+ is more than this rank's share"):
        ShardedLoader(as_dataset(path), on_cuda, 16, ["item_id-list"], ["click"],
                      num_workers=worker_share(on_cuda) + 1)
