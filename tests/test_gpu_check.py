"""benchmarks/gpu_check.py at toy size on CPU: the update it measures really trains (the
trainable weights move, LoRA's base weights don't), gradient checkpointing changes memory but
not the gradient, and a NaN fails the run; its process-group, scripts and packing checks run
and can fail."""

import json
import math
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from tests.conftest import ROOT

TINY = ["--config", "tiny", "--device", "cpu", "--micro-batch-size", "2", "--micro-batches", "2",
        "--prompt-len", "8", "--completion-len", "8", "--updates", "2", "--checks", "update"]  # a later --checks wins


@pytest.fixture(autouse=True)
def one_thread():
    """The machine's cores are shared; the toy model needs no more than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(tmp_path, *flags):
    """main() in this process; returns its exit status and the --json report, by variant."""
    path = tmp_path / "gpu_check.json"
    status = gpu_check.main([*TINY, "--json", str(path), *flags])
    report = json.loads(path.read_text())
    return status, report, {r["variant"]: r for r in report["variants"]}


def assert_trained(r):
    assert r["status"] == "ok"
    assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
    assert all(g > 0 for g in r["grad_norms"])
    assert r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0
    assert r["completion_tokens"] == int(r["completion_tokens"]) > 0
    # every trainable tensor moved (LoRA's A matrices only from the second update: B starts at 0)
    assert r["trainable_changed"] == r["trainable_tensors"] > 0 and r["unchanged_trainable"] == []
    assert 0 < r["trainable_params"] <= r["params"]


def test_full_finetuning_with_and_without_checkpointing(tmp_path, capsys):
    status, report, by_name = run(tmp_path, "--variants", "full", "full+gc")
    assert status == 0
    for name in ("full", "full+gc"):
        assert_trained(by_name[name])
        assert by_name[name]["frozen_tensors"] == 0  # every weight trains
        assert by_name[name]["trainable_params"] == by_name[name]["params"]
    # recomputing activations in the backward changes memory, not the math (fp32 on CPU)
    assert by_name["full+gc"]["grad_norms"] == pytest.approx(by_name["full"]["grad_norms"], rel=1e-5)
    assert by_name["full+gc"]["losses"] == pytest.approx(by_name["full"]["losses"], rel=1e-5)
    # a random model's next-token distribution is near uniform: entropy close to ln(vocab)
    assert by_name["full"]["entropy"] == pytest.approx(math.log(512), abs=0.1)
    assert report["torch"] == torch.__version__ and report["device"].startswith("CPU") and report["date"]
    out = capsys.readouterr().out
    assert "tokens/s" in out and "peak process RSS" in out


def test_lora_trains_only_the_adapters(tmp_path):
    pytest.importorskip("peft")
    status, _, by_name = run(tmp_path, "--variants", "full", "lora", "lora+gc")
    assert status == 0
    for name in ("lora", "lora+gc"):
        r = by_name[name]
        assert_trained(r)
        assert r["frozen_tensors"] == by_name["full"]["trainable_tensors"]  # the whole base model is frozen
        assert r["frozen_changed"] == 0  # and stays bit for bit what it was
        assert r["params"] == by_name["full"]["params"] + r["trainable_params"]  # base + adapters
    assert by_name["lora+gc"]["grad_norms"] == pytest.approx(by_name["lora"]["grad_norms"], rel=1e-5)


def test_lora_without_peft_is_skipped_not_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "peft", None)
    status, _, by_name = run(tmp_path, "--variants", "lora", "full")
    assert status == 0
    assert by_name["lora"]["status"].startswith("skipped")
    assert by_name["full"]["status"] == "ok"


def test_nan_loss_fails_the_run(tmp_path, monkeypatch, capsys):
    loss = gpu_check.grpo_loss
    monkeypatch.setattr(gpu_check, "grpo_loss", lambda *a: loss(*a) * float("nan"))
    status, _, by_name = run(tmp_path, "--variants", "full")
    assert status == 1
    assert by_name["full"]["status"].startswith("FAILED") and "not finite" in by_name["full"]["status"]
    assert "FAILED: full" in capsys.readouterr().err


def run_alone(tmp_path, *flags):
    """gpu_check.py in a process of its own, as on the GPU machine (this one's vLLM engines have made a
    process group already): its exit status, its --json report and its stderr."""
    path = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", *TINY, "--json", path, *flags], cwd=ROOT,
                          capture_output=True, text=True)
    return proc.returncode, json.loads(path.read_text()), proc.stderr


def test_the_process_group_scripts_and_packing_checks_at_toy_size(tmp_path):
    """The GPU machine's other checks, here on CPU: a group made as common/dist.py makes it takes
    every kind of collective and FSDP2; grpo.py and ppo.py run end to end with --engine
    transformers on the tiny model and a random model of --config; the mask's bytes are L^2."""
    status, report, stderr = run_alone(tmp_path, "--checks", "process_group", "scripts", "sampling", "packing",
                                       "--script-steps", "2", "--script-steps-large", "2")
    assert status == 0, stderr[-2000:]
    group = report["process_group"]
    assert group["backend"] == "gloo" and group["status"] == "ok"
    assert len(group) == 12 and all(v == "ok" for k, v in group.items() if k != "backend")
    assert "FSDP2 with gradient checkpointing (the same gradient)" in group
    assert "LoRA merge of sharded weights (the unsharded merge)" in group
    runs = report["scripts"]
    assert [(r["script"], r["model"]) for r in runs] == [("grpo.py", "tiny-sort"), ("grpo.py", "tiny"),
                                                         ("ppo.py", "tiny-sort"), ("ppo.py", "tiny"),
                                                         ("grpo_multiturn.py", "tiny-sort")]
    for r in runs:
        assert r["status"] == "ok" and r["exit_code"] == 0 and r["steps"] == 2 and r["losses_finite"]
        assert r["logprob_mismatch"] < 1e-4 and r["peak_memory_gib"] > 0 and r["median_step_s"] > 0
    assert runs[-1]["turns_mean"] > 1
    sampling = report["sampling"]
    assert sampling["status"] == "ok" and sampling["rank_0"] != sampling["rank_1"] and len(sampling["rank_0"]) == 8
    L = 2 * (8 + 8)  # micro-batch x (prompt + completion)
    assert report["packing"]["sdpa_mask_bytes"] == L * L and report["packing"]["eager_mask_bytes"] == 4 * L * L


def test_a_process_group_the_backend_cannot_make_fails_the_check(tmp_path):
    status, report, stderr = run_alone(tmp_path, "--checks", "process_group", "--backend", "nccl")  # no NCCL here
    assert status == 1 and report["process_group"]["status"].startswith("FAILED")
    assert "NCCL" in report["process_group"]["status"] and "FAILED: process_group" in stderr
