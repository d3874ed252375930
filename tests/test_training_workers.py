"""How many loader workers each rank starts: the node's cores shared out, never oversubscribed."""

import os

import torch

from merlin_t4r_ops.training import DistributedState
from merlin_t4r_ops.training.data import default_num_workers
from torchrun_launch import torchrun

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training_scripts",
                      "ddp_workers.py")


def test_two_gloo_ranks_share_the_cores_without_oversubscription(tmp_path):
    ranks, _ = torchrun(tmp_path, SCRIPT)
    infos = [info for info, _ in ranks]
    cores = infos[0]["cores"]
    for info in infos:
        assert info["local_world_size"] == 2, info
        assert info["cpu_default"] == 0, info  # on a CPU the step needs the cores itself
        # A CUDA rank of this node gets its share, at most 4, and starts exactly that many.
        assert info["cuda_default"] == min(4, cores // 2), info
        assert info["started"] == info["cuda_default"], info
    assert sum(info["started"] for info in infos) <= cores, infos


def test_one_cuda_process_takes_up_to_four_of_its_cores():
    cores = len(os.sched_getaffinity(0))
    single = DistributedState("single", 0, 0, 1, torch.device("cuda", 0), "stand-in")
    assert default_num_workers(single) == min(4, cores)
    eight = DistributedState("ddp", 0, 0, 8, torch.device("cuda", 0), "stand-in",
                             local_world_size=8)
    assert default_num_workers(eight) == min(4, cores // 8)
    cpu = DistributedState("single", 0, 0, 1, torch.device("cpu"), "stand-in")
    assert default_num_workers(cpu) == 0
