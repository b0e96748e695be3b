"""The ranks' process group: on a GPU node, the counts train.py and eval.py reduce on the host still find a backend."""
import argparse

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

import distributed


@pytest.fixture
def torchrun_rank(monkeypatch):
    """A rank of an 8-GPU torchrun on this CPU machine: CUDA and init_process_group are stand-ins that record."""
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("cuda_device", index))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.setdefault("backend", backend))
    return calls


def test_a_cuda_group_serves_cpu_tensors_too(torchrun_rank):
    """SFT's token count, its loss sum, the rollout metrics and evaluate_ex's counts are CPU tensors: an NCCL-only
    group ("No backend type associated with device type cpu") would stop the first SFT step."""
    rank, world, device = distributed.setup_distributed(argparse.Namespace(device="cuda"))
    assert (rank, world, device) == (3, 8, "cuda:3")
    assert torchrun_rank["cuda_device"] == 3
    served = BackendConfig(Backend(torchrun_rank["backend"])).get_device_backend_map()
    assert served["cpu"] == "gloo"
    assert served["cuda"] == "nccl"


def test_a_cpu_group_is_gloo(torchrun_rank):
    distributed.setup_distributed(argparse.Namespace(device="cpu"))
    served = BackendConfig(Backend(torchrun_rank["backend"])).get_device_backend_map()
    assert served["cpu"] == "gloo"
    assert "cuda_device" not in torchrun_rank
