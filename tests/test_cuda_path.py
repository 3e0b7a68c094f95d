"""The CUDA path's rules, checked on CPU with stand-ins: the process group's backend serves every
device type a collective is handed (tests/test_dist.py checks the tensors a 2-process job hands
it), a checkpoint's CUDA RNG state resumes on any number of GPUs, and the suite's multi-process
tests start at most one process a GPU (or skip, saying why)."""

import pytest
import torch
import torch.distributed as tdist

from common import dist, run
from tests.conftest import device_processes, need_processes, node_env


def test_the_cuda_group_takes_cpu_tensors_too():
    # metrics and signal flags are CPU tensors on every device: a plain "nccl" group raises on them
    assert dist.served("nccl") == {"cuda"}  # the helper reads the string as torch does
    assert dist.served(dist.backend("cuda")) == {"cpu", "cuda"}
    assert "cpu" in dist.served(dist.backend("cpu"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_init_creates_the_group_with_its_devices_backend(monkeypatch, device):
    created = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: created.update(gpu=i))
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group", lambda name, **kwargs: created.update(backend=name))
    monkeypatch.setattr(tdist, "get_rank", lambda: 0)
    assert dist.init() == device
    assert created["backend"] == dist.backend(device)
    assert created.get("gpu") == (1 if device == "cuda" else None)  # the local rank's GPU


class FakeGPUs:
    """torch.cuda's RNG calls on a machine of n GPUs, seen from a process on GPU `current`: each
    GPU's state a distinct tensor; an index the machine lacks raises, as CUDA does."""

    def __init__(self, monkeypatch, n: int, current: int):
        self.states = [torch.full((16,), 10 * n + i, dtype=torch.uint8) for i in range(n)]
        self.current = current
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    def index(self, device) -> int:
        i = device if isinstance(device, int) else torch.device(device).index
        i = self.current if i is None else i  # "cuda": the current GPU
        if i >= len(self.states):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return i

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self.index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self.index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(len(self.states))]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for i, state in enumerate(states):  # by index, as torch.cuda does
            self.set_rng_state(state, i)


def test_a_checkpoint_from_gpu_5_of_8_resumes_on_a_machine_of_4(monkeypatch):
    eight = FakeGPUs(monkeypatch, 8, current=5)
    saved = run.rng_state()
    four = FakeGPUs(monkeypatch, 4, current=2)
    before = list(four.states)
    run.set_rng_state(saved)
    assert torch.equal(four.states[2], eight.states[5])  # the saving GPU's state, into this process's GPU
    assert all(four.states[i] is before[i] for i in (0, 1, 3))  # the other GPUs' are not this process's


def test_an_older_checkpoint_with_every_gpus_state_restores_this_gpus(monkeypatch):
    eight = FakeGPUs(monkeypatch, 8, current=0)
    saved = {**run.rng_state(), "cuda": torch.cuda.get_rng_state_all()}  # as rng_state() saved them before
    four = FakeGPUs(monkeypatch, 4, current=2)
    run.set_rng_state(saved)
    assert torch.equal(four.states[2], eight.states[2])
    unchanged = FakeGPUs(monkeypatch, 16, current=12)  # a GPU the checkpoint holds no state for keeps its own
    state = unchanged.states[12]
    run.set_rng_state(saved)
    assert unchanged.states[12] is state


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_multi_process_test_skips_on_fewer_gpus_than_processes(monkeypatch):
    fake_gpus(monkeypatch, 1)
    assert device_processes() == 1
    need_processes(1)
    with pytest.raises(pytest.skip.Exception, match="starts 2 processes, one a GPU: this machine has 1 GPU"):
        need_processes(2)
    fake_gpus(monkeypatch, 2)
    need_processes(2)
    fake_gpus(monkeypatch, 0)  # CPU: gloo ranks share the cores
    need_processes(2)
    need_processes(8)


def test_two_launchers_on_one_machine_each_see_a_gpu_of_their_own(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert [node_env(0), node_env(1)] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the GPUs this job was given
    assert [node_env(0), node_env(1)] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    fake_gpus(monkeypatch, 0)
    assert node_env(1) == {}
