"""Where vLLM is not installed, and on an Apple GPU: which device (--device), rollout engine (--engine) and
numerics (--precision) a run picks, with torch's CUDA and MPS answers faked; and that RL_LM_HIDE_VLLM=1
(tests/hide_vllm) makes this machine one without vLLM, for the suite (.ci/run) and the Pythons it starts.
The laptop's platforms: a checkpoint keeps an Apple GPU's generator, macOS's ru_maxrss is in bytes, and
without `resource` and SIGALRM (Windows) the modules import and the built-in rewards run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from common import dist, metrics, run
from common.errors import ConfigError
from common.scripts import algorithm_scripts, load_script
from common.setup import Precision, choose_engine
from tests.conftest import ROOT, pythonpath
from tests.test_grpo_e2e import read_metrics

HIDE_VLLM = str(ROOT / "tests" / "hide_vllm")


@pytest.fixture()
def machine(monkeypatch):
    """machine(cuda=..., mps=..., vllm=...): torch and the vLLM check answer as on that machine."""
    def fake(cuda: bool = False, mps: bool = False, vllm: bool = True, macos14: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos14)
        monkeypatch.setattr("common.setup.vllm_installed", lambda: vllm)
    return fake


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_device_auto_is_cuda_else_mps_else_cpu(machine, cuda, mps, expected):
    machine(cuda=cuda, mps=mps)
    assert dist.pick_device("auto") == dist.init("auto") == expected
    assert dist.pick_device("cpu") == "cpu"  # an explicit one wins


def test_a_device_torch_does_not_offer_is_one_line(machine):
    machine(cuda=False, mps=False)
    with pytest.raises(ConfigError, match=r"--device mps: torch finds no mps device here \(--device auto picks "
                                          r"what it finds: cpu\)"):
        dist.pick_device("mps")


def args_of(*flags: str, script: str = "grpo.py"):
    from common.args import parse_args

    return parse_args(load_script(script).Args, list(flags))


@pytest.mark.parametrize("script", algorithm_scripts())
def test_every_script_defaults_to_auto_device_and_engine(script):
    args = args_of(script=script)
    assert (args.engine, args.device) == ("auto", "auto")


@pytest.mark.parametrize("cuda, mps, vllm, device, engine", [
    (False, False, True, "cpu", "vllm"),            # vLLM installed: vLLM
    (False, False, False, "cpu", "transformers"),   # not installed: the policy samples itself
    (False, True, True, "mps", "transformers"),     # an Apple GPU: vLLM has no build for it
    (True, False, False, "cuda", "transformers"),
])
def test_engine_auto_is_vllm_where_installed_and_not_on_mps(machine, capsys, cuda, mps, vllm, device, engine):
    machine(cuda=cuda, mps=mps, vllm=vllm)
    args = args_of()
    said = choose_engine(args)
    assert (args.device, args.engine) == (device, engine)
    assert said.startswith(f"--engine auto: {engine} (")  # prepare() says it once every check has passed


def test_an_explicit_engine_and_device_are_kept(machine, capsys):
    machine(cuda=False, mps=True, vllm=False)
    args = args_of("--engine", "vllm", "--device", "cpu")
    assert choose_engine(args) is None
    assert (args.device, args.engine) == ("cpu", "vllm")


def test_mps_runs_fp32_unless_asked_for_bf16_which_needs_macos_14(machine):
    machine(mps=True)
    assert Precision.of(args_of(), "mps").autocast_dtype is None  # auto: fp32, as on CPU
    bf16 = Precision.of(args_of("--precision", "bf16"), "mps")
    assert bf16.autocast_dtype == torch.bfloat16 and bf16.engine_dtype == "bfloat16"
    machine(mps=True, macos14=False)
    with pytest.raises(ConfigError, match="--precision bf16 on an Apple GPU \\(mps\\) needs macOS 14 or newer"):
        Precision.of(args_of("--precision", "bf16"), "mps")


def test_hide_vllm_makes_this_machine_one_without_vllm():
    """In a Python started as the tests start them, with RL_LM_HIDE_VLLM=1: import vllm fails, the check says
    vLLM is absent, and transformers (which looks for optional packages) imports."""
    code = ("import importlib, sys; sys.path.insert(0, '.'); from common.args import vllm_installed; "
            "import transformers; print(vllm_installed()); import vllm")
    env = {**os.environ, "RL_LM_HIDE_VLLM": "1", "PYTHONPATH": HIDE_VLLM + os.pathsep + pythonpath()}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False"]
    assert "ModuleNotFoundError: No module named 'vllm' (hidden: RL_LM_HIDE_VLLM=1)" in proc.stderr


@pytest.mark.slow
def test_without_vllm_the_readmes_first_command_picks_the_transformers_engine_and_learns(tmp_path):
    """`python grpo.py` (10 steps) where vLLM is absent: says so first, records the engine, and learns as
    tests/test_learning.py's runs do (held-out accuracy 0.3 above its start)."""
    env = {**os.environ, "RL_LM_HIDE_VLLM": "1", "PYTHONPATH": HIDE_VLLM + os.pathsep + pythonpath()}
    proc = subprocess.run([sys.executable, "grpo.py", "--steps", "10", "--eval-every", "10", "--output-dir",
                           tmp_path / "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == ("--engine auto: transformers (vLLM is not installed here: the policy "
                                           f"samples itself), --device {dist.pick_device()}")
    saved = json.loads((tmp_path / "run" / "args.json").read_text())
    assert (saved["engine"], saved["device"]) == ("transformers", dist.pick_device())
    metrics = read_metrics(tmp_path / "run")
    start, end = metrics[0]["eval/accuracy"], metrics[-1]["eval/accuracy"]
    assert start < 0.5 and end >= start + 0.3, (start, end)


def test_a_checkpoint_keeps_an_apple_gpus_generator(machine, monkeypatch):
    """rng_state() saves torch.mps's generator where an Apple GPU is (faked: a state a tensor), set_rng_state
    restores it; a checkpoint without one (saved on CPU or CUDA) leaves it as it is."""
    machine(mps=True)
    generator = {"state": torch.arange(8, dtype=torch.uint8)}
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": generator["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": generator.update(state=state.clone()))
    saved = run.rng_state()
    assert torch.equal(saved["mps"], torch.arange(8, dtype=torch.uint8))
    generator["state"] = torch.zeros(8, dtype=torch.uint8)  # the generator moves on
    run.set_rng_state(saved)
    assert torch.equal(generator["state"], torch.arange(8, dtype=torch.uint8))
    moved = generator["state"] = torch.ones(8, dtype=torch.uint8)
    run.set_rng_state({k: v for k, v in saved.items() if k != "mps"})
    assert generator["state"] is moved
    machine(mps=False)
    assert "mps" not in run.rng_state()


class FakeResource:
    RUSAGE_SELF = 0

    def __init__(self, maxrss: int):
        self.maxrss = maxrss

    def getrusage(self, who):
        return type("Usage", (), {"ru_maxrss": self.maxrss})()


@pytest.mark.parametrize("platform, maxrss", [("linux", 3 * 2**20), ("darwin", 3 * 2**30)])
def test_peak_memory_reads_ru_maxrss_in_kib_on_linux_and_bytes_on_macos(monkeypatch, platform, maxrss):
    """3 GiB as getrusage says it on each (KiB on Linux, bytes on macOS); no memory/peak_gib without resource."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(metrics, "resource", FakeResource(maxrss))
    llm = type("LLM", (), {"memory": {"device": 2**29, "allocated": 0}})()
    assert metrics.memory_metrics(llm) == {"memory/peak_gib": 3.0, "memory/engine_gib": 0.5}
    monkeypatch.setattr(metrics, "resource", None)
    assert metrics.memory_metrics(llm) == {"memory/engine_gib": 0.5}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_peak_memory_is_the_process_high_water_mark():
    """On Linux, peak_rss() is the kernel's VmHWM (KiB in /proc/self/status), in bytes."""
    peak = metrics.peak_rss()
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
    assert peak <= hwm < peak + 2**26  # read after it, so at most a little higher


WITHOUT_RESOURCE_AND_SIGALRM = r"""
import signal, sys
sys.path.insert(0, ".")
sys.modules["resource"] = None  # import resource raises ImportError, as on Windows
for name in ("SIGALRM", "alarm", "setitimer", "getitimer", "ITIMER_REAL"):
    delattr(signal, name)
from common import metrics
from common.rewards import Reward, RewardTerm, format_reward
from common.tasks import math_reward
reward = Reward([RewardTerm("format", format_reward, 1.0, "format")], timeout=2.0)
for _ in range(2):
    total, parts = reward(["<answer>1</answer>", "no answer"], [{}, {}])
    print(total.tolist(), parts["timeouts"].tolist())
print(math_reward("\\boxed{3}", {"answer": "3"}))
print(metrics.peak_rss(), sorted(metrics.memory_metrics(type("LLM", (), {"memory": {"device": 0}})())))
"""


def test_without_resource_and_sigalrm_the_modules_import_and_the_rewards_run():
    """As on Windows: `resource` cannot be imported and signal has no SIGALRM. The built-in rewards score, without
    a time limit, said once; math-verify runs without its own SIGALRM timeout; memory/peak_gib is not logged."""
    proc = subprocess.run([sys.executable, "-c", WITHOUT_RESOURCE_AND_SIGALRM], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[1.0, 0.0] [0.0, 0.0]"] * 2 + ["1.0", "None ['memory/engine_gib']"]
    assert proc.stderr == ("no SIGALRM on this platform (Windows): the built-in rewards and the calculator run "
                           "without their 2 s time limit\n")
