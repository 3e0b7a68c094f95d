"""More than one process: the scripts under `torchrun --nproc-per-node 2` (gloo, the tiny model,
one vLLM CPU engine per rank), and the gradient of 2 processes against 1 on a fixed batch.

The script runs share one launch (tests/dist_runner.py: one engine per rank for all of them),
which is minutes on 2 cores; the tests below read what it left."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import dist
from common.scripts import algorithm_scripts, load_script
from tests.conftest import ROOT, pythonpath, TINY_MODEL, need_processes, needs_vllm, read_optimizer_state, vllm_module
from tests.test_grpo_e2e import STEP_METRICS, read_metrics
from tests.test_runs import wait_for_steps

pytestmark = pytest.mark.slow
# fp32 on every device (auto is bf16 on CUDA): these runs check fp32 numerics
SMALL = ["--num-minibatches", "2", "--prompts-per-step", "4", "--completions-per-prompt", "4",
         "--micro-batch-size", "3", "--max-new-tokens", "10", "--eval-every", "0", "--precision", "fp32"]
OTHERS = [s for s in algorithm_scripts() if s not in ("grpo.py", "ppo.py")]  # one step each
CASES = ["grpo:token-mean", "grpo:seq-mean-token-mean", "reinforce", "ppo"]


def small(script: str) -> list[str]:
    """SMALL, less --num-minibatches for the scripts that make one update per batch."""
    return SMALL if hasattr(load_script(script).Args, "num_minibatches") else SMALL[2:]


def torchrun(*args, processes: int = 2, **env) -> subprocess.Popen:
    need_processes(processes)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(), **env}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                             *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One torchrun launch of 2 processes: grpo and ppo 2 steps with checkpoints and a resume to
    step 3, the other scripts 1 step, and a long grpo run that a SIGTERM to rank 1 alone stops.
    Each rank records the collectives it calls (tests/dist_runner.py)."""
    vllm_module()  # every rank's engine is a vLLM one (tests/dist_runner.py)
    tmp = tmp_path_factory.mktemp("dist")
    runs = [["grpo.py", "--steps", "2", "--save-every", "1", "--output-dir", tmp / "grpo", *SMALL],
            ["grpo.py", "--steps", "3", "--resume", tmp / "grpo" / "checkpoints" / "step_1", "--discard-later"],
            ["ppo.py", "--steps", "2", "--save-every", "1", "--output-dir", tmp / "ppo", *SMALL],
            ["ppo.py", "--steps", "3", "--resume", tmp / "ppo"],
            *[[s, "--steps", "1", "--save-every", "0", "--output-dir", tmp / s[:-3], *small(s)] for s in OTHERS],
            ["grpo.py", "--steps", "2", "--save-every", "1", "--lora-rank", "8", "--lr", "2e-3", "--output-dir",
             tmp / "lora", *SMALL],
            ["grpo.py", "--steps", "1000", "--save-every", "0", "--output-dir", tmp / "stopped", *SMALL]]
    spec = tmp / "runs.json"
    spec.write_text(json.dumps([[str(x) for x in run] for run in runs]))
    proc = torchrun("tests/dist_runner.py", spec, RECORD_COLLECTIVES=str(tmp))
    wait_for_steps(proc, tmp / "stopped", 1, timeout_s=1800)  # the long run's first step
    os.kill(int((tmp / "pid_1").read_text()), signal.SIGTERM)  # rank 1 only
    signalled_at = read_metrics(tmp / "stopped")[-1]["step"]
    output = proc.communicate(timeout=600)[0]
    return {"tmp": tmp, "returncode": proc.returncode, "output": output, "signalled_at": signalled_at}


def test_grpo_under_two_processes_checkpoints_resumes_and_saves_a_final_model(launch):
    out = launch["tmp"] / "grpo"
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3], launch["output"][-3000:]  # resumed at step 1
    for m in read_metrics(out)[1:]:
        assert all(k in m for k in STEP_METRICS), sorted(m)
        # each rank's engine samples with the weights gathered from the shards after the last update
        assert m["rollout/logprob_mismatch"] < 1e-3, m
    step_1 = out / "checkpoints" / "step_1"
    assert sorted(os.listdir(step_1 / "optimizer")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # a shard each
    info = json.loads((step_1 / "run.json").read_text())
    assert (info["world_size"], info["device"]) == (2, "cpu")
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    # AdamW's step count continues across the resume: 2 minibatches a step, 3 steps
    assert {int(s["step"]) for s in read_optimizer_state(out / "checkpoints" / "step_3")["state"].values()} == {6}
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
    assert final.keys() == initial.keys()
    assert not torch.equal(final["model.layers.0.mlp.down_proj.weight"], initial["model.layers.0.mlp.down_proj.weight"])


def test_ppo_under_two_processes_checkpoints_policy_critic_and_resumes(launch):
    out = launch["tmp"] / "ppo"
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3], launch["output"][-3000:]
    groups = read_optimizer_state(out / "checkpoints" / "step_2")["param_groups"]
    assert len(groups) == 2 and all(n.startswith("critic.") for n in groups[1]["params"])
    assert (out / "checkpoints" / "step_2" / "critic" / "model.safetensors").exists()
    assert AutoModelForCausalLM.from_pretrained(out / "final").state_dict().keys() == \
        AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict().keys()


@pytest.mark.parametrize("script", OTHERS)
def test_every_other_script_runs_a_step_under_two_processes(launch, script):
    out = launch["tmp"] / script[:-3]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1], launch["output"][-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert (out / "final" / "model.safetensors").exists()


def test_a_lora_run_under_two_processes_saves_adapters_and_a_merged_final_model(launch):
    out = launch["tmp"] / "lora"
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2], launch["output"][-3000:]
    # step 2 samples from the merged weights synced after step 1: vLLM and the trainer agree (fp32)
    assert read_metrics(out)[2]["rollout/logprob_mismatch"] < 1e-3
    assert (out / "checkpoints" / "step_1" / "policy" / "adapter_model.safetensors").exists()
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
    assert final.keys() == initial.keys()
    name = "model.layers.0.self_attn.q_proj.weight"  # a LoRA target: W + scale * B A after one step
    assert not torch.equal(final[name], initial[name])
    assert torch.equal(final["model.layers.0.input_layernorm.weight"], initial["model.layers.0.input_layernorm.weight"])


def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_one_checkpoint(launch):
    out = launch["tmp"] / "stopped"
    assert launch["returncode"] != 0, launch["output"][-3000:]  # not a finished run
    last = read_metrics(out)[-1]["step"]
    assert last >= launch["signalled_at"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last}"]
    assert sorted(os.listdir(out / "checkpoints" / f"step_{last}" / "optimizer"))[1:] == ["__0_0.distcp",
                                                                                         "__1_0.distcp"]
    assert "saved checkpoint" in launch["output"] and "SIGTERM: finishing this step" in launch["output"]


# what the launch must have called, as "op via callers" (tests/dist_runner.py's record)
COLLECTIVES_SEEN = {
    "metrics": r"^all_reduce .*common/dist.py:mean_over_ranks",
    "signal flags": r"^all_gather .*common/interrupt.py:GracefulInterrupt.stop",
    "loss normalizers": r"^all_reduce .*common/dist.py:minibatch_totals",
    "a batch-mean baseline": r"^all_reduce .*common/dist.py:global_mean",
    "whitening": r"^all_reduce .*common/dist.py:global_masked_mean",
    "DAPO's pooled groups": r"^all_gather_object .*common/dist.py:all_gather_objects dapo.py:main",
    "the evaluation, rank 0's": r"^broadcast_object_list .*common/dist.py:on_main common/engine.py:evaluate",
    "the run folder, rank 0's": r"^broadcast_object_list .*common/dist.py:on_main common/run.py:Run.__init__",
    "checkpoint barriers": r"^barrier .*common/dist.py:barrier common/run.py:Run.save_checkpoint",
    "optimizer shards saved": r"^\w+ torch/distributed/checkpoint/.*common/run.py:Run.save_checkpoint",
    "optimizer shards loaded": r"^\w+ torch/distributed/checkpoint/.*common/run.py:Run.load_checkpoint",
    "FSDP2's gathers": r"^all_gather\w* torch/distributed/fsdp/",
    "FSDP2's gradient reductions": r"^reduce_scatter\w* torch/distributed/fsdp/",
    "whole weights (for vLLM, checkpoints)": r"^funcol.all_gather\w* torch/distributed/tensor/.*common/dist.py:full_",
}


def test_every_collective_is_handed_tensors_the_cuda_process_group_takes(launch):
    """On CUDA the process group is created as dist.backend("cuda"): every tensor handed to a
    collective, by the scripts, common/ or torch (FSDP2, DTensor, torch.distributed.checkpoint:
    on the compute device), must be on a device type it serves. A plain "nccl" group takes only
    CUDA tensors; the metrics and the signal flags are CPU tensors on every device. Here on CPU
    every tensor is a CPU tensor, so against "nccl" every collective fails, those included; under
    the same recorder on GPUs, only the CPU tensors would."""
    calls = [c for rank in (0, 1) for c in json.loads((launch["tmp"] / f"collectives_{rank}.json").read_text())]
    where = [f'{c["op"]} {c["via"]} {" ".join(c["callers"])}' for c in calls]
    missing = [what for what, pattern in COLLECTIVES_SEEN.items() if not any(re.search(pattern, w) for w in where)]
    assert not missing, f"{missing} not among:\n" + "\n".join(sorted(set(where)))
    served = dist.served(dist.backend("cuda"))
    unserved = sorted({" < ".join([f'{c["op"]} on {c["devices"]}', *c["callers"][:2]] if c["callers"] else [w])
                       for c, w in zip(calls, where) if not set(c["devices"]) <= served})
    assert not unserved, f"a {dist.backend('cuda')!r} group takes {sorted(served)} only:\n" + "\n".join(unserved)


def test_a_two_process_checkpoint_resumes_in_one_process(launch, run_main, tmp_path):
    """torch.distributed.checkpoint reshards the optimizer's state to the new world size."""
    run_main("grpo.py", "--steps", "3", "--resume", launch["tmp"] / "grpo" / "checkpoints" / "step_2",
             "--output-dir", tmp_path / "one")
    assert [m["step"] for m in read_metrics(tmp_path / "one")] == [3]
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["world_size"] == 1


def test_two_processes_give_the_gradient_and_the_step_of_one(tmp_path):
    """The scripts' advantages and their own update on one fixed batch (tests/dist_worker.py): the
    gradient the optimizer step sees (clipped) of 2 processes (each its half, global normalizers,
    FSDP2 summing) equals 1 process's to fp32 rounding, for GRPO's token-mean and
    seq-mean-token-mean, REINFORCE's batch-mean baseline and PPO's whitening; so do the logged losses
    and AdamW's first step wherever it is not a sign of noise."""
    one = subprocess.run([sys.executable, "tests/dist_worker.py", tmp_path / "one.pt"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun("tests/dist_worker.py", tmp_path / "two.pt")
    output = two.communicate()[0]
    assert two.returncode == 0, output[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for case in CASES:
        g1, g2 = (torch.cat([v.flatten() for v in r[case]["grad"].values()]) for r in (one, two))
        assert g1.norm() > 0.1
        assert (g1 - g2).norm() / g1.norm() < 1e-5, case
        assert one[case]["grad_norm"] == pytest.approx(two[case]["grad_norm"], rel=1e-5)  # clipping: >1, active
        # a logged loss is the minibatch's, not a rank's share of it (loss/total, GRPO's loss/kl, PPO's terms)
        assert "loss/total" in one[case]["losses"] and two[case]["losses"] == \
            pytest.approx(one[case]["losses"], rel=1e-5, abs=1e-6)
        # AdamW's first step is lr * g / (|g| + eps), eps 1e-8: where |g| is within a few orders of eps,
        # it magnifies the gradient's rounding noise
        d1, d2 = (torch.cat([v.flatten() for v in r[case]["delta"].values()]) for r in (one, two))
        clear = g1.abs() > 3e-5  # of a gradient clipped to norm 1
        assert clear.float().mean() > 0.5, case
        assert torch.allclose(d1[clear], d2[clear], rtol=1e-5, atol=0), case


def run_worker(out, *flags, processes: int = 1) -> dict:
    """tests/dist_worker.py OUT FLAGS in one process or under torchrun; rank 0's results."""
    if processes == 1:
        proc = subprocess.run([sys.executable, "tests/dist_worker.py", out, *flags], cwd=ROOT, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": pythonpath()})
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        proc = torchrun("tests/dist_worker.py", out, *flags)
        output = proc.communicate()[0]
        assert proc.returncode == 0, output[-3000:]
    return torch.load(out)


def whole_grad(result: dict, case: str) -> torch.Tensor:
    return torch.cat([g.flatten() for g in result[case]["grad"].values()])


def test_under_bf16_fsdp2_gathers_bf16_weights_and_two_processes_give_the_gradient_of_one(tmp_path):
    """--precision bf16 under FSDP2 is its mixed precision: each layer runs on bf16 weights gathered
    from the fp32 shards (autocast alone would gather fp32 and keep a bf16 copy of each for the
    backward), gradients reduced in fp32. One process keeps autocast over fp32 weights; the two
    agree to bf16 rounding (measured: 1.2% of the gradient's norm; bf16 against fp32: 0.7%)."""
    cases = ["grpo:token-mean", "ppo"]  # the policy, and PPO's critic with its units called alone
    one = run_worker(tmp_path / "one.pt", "--precision", "bf16", "--cases", *cases)
    two = run_worker(tmp_path / "two.pt", "--precision", "bf16", "--cases", *cases, processes=2)
    assert list(one["weight_dtypes"]) == ["torch.float32"]  # autocast casts inside each layer
    assert list(two["weight_dtypes"]) == ["torch.bfloat16"]  # every layer, the critic's head included
    for case in cases:
        g1, g2 = whole_grad(one, case), whole_grad(two, case)
        assert g1.dtype == g2.dtype == torch.float32  # the optimizer's gradient: fp32 shards
        assert g1.norm() > 0.1
        assert (g1 - g2).norm() / g1.norm() < 3e-2, case
        assert two[case]["grad_norm"] == pytest.approx(one[case]["grad_norm"], rel=3e-2)


def test_gradient_checkpointing_under_fsdp2_gives_the_gradient_without_it(tmp_path):
    """--gradient-checkpointing (the GPU recipe's) under 2 processes: the backward gathers each
    layer's weights again to recompute its forward, and the gradient is one process's without
    checkpointing to fp32 rounding, for the policy and PPO's critic."""
    cases = ["grpo:token-mean", "ppo"]
    one = run_worker(tmp_path / "one.pt", "--cases", *cases)
    two = run_worker(tmp_path / "two.pt", "--gradient-checkpointing", "--cases", *cases, processes=2)
    assert (one["recomputed"], two["recomputed"] > 0) == (0, True)  # the backward ran the layers again
    for case in cases:
        g1, g2 = whole_grad(one, case), whole_grad(two, case)
        assert g1.norm() > 0.1
        assert (g1 - g2).norm() / g1.norm() < 1e-5, case


@needs_vllm
def test_two_ranks_given_the_same_prompt_sample_different_completions(tmp_path):
    """vLLM samples with torch's global generator, which each script seeds after creating the engine:
    per rank (seed_everything(seed, rank)), or every rank would draw the same noise. One prompt on
    both ranks (tests/engine_worker.py): 8 completions each, not the same 8."""
    proc = torchrun("tests/engine_worker.py", "vllm", tmp_path / "out.pt")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    rank_0, rank_1 = torch.load(tmp_path / "out.pt")["completions"]
    assert len(set(map(tuple, rank_0))) > 1  # sampled, not one answer
    assert rank_0 != rank_1


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=needs_vllm), "transformers"])
def test_a_resumed_two_process_run_samples_as_the_uninterrupted_one(tmp_path, engine):
    """Each rank saves its own generators' state in a checkpoint and resumes it: step 2 of a run
    resumed from step 1 under 2 processes samples what the uninterrupted run sampled (the same
    rewards and lengths), rank 1 included, which a checkpoint of rank 0's state alone would not give;
    with either engine (the transformers engine seeds each sample by its place in the run's samples)."""
    flags = [*SMALL, "--temperature", "1.5", "--log-completions", "0", "--engine", engine]
    runs = [["grpo.py", "--steps", "2", "--save-every", "1", "--output-dir", tmp_path / "whole", *flags],
            ["grpo.py", "--resume", tmp_path / "whole" / "checkpoints" / "step_1", "--output-dir", tmp_path / "resumed"]]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([[str(x) for x in run] for run in runs]))
    proc = torchrun("tests/dist_runner.py", spec)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    whole, resumed = read_metrics(tmp_path / "whole")[2], read_metrics(tmp_path / "resumed")[0]
    assert resumed["step"] == 2
    for key in ("reward/mean", "reward/std", "response/length_mean", "loss/total"):
        assert resumed[key] == pytest.approx(whole[key], rel=1e-6), key
