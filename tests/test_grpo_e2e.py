"""grpo.py end to end through real vLLM on CPU: outputs, resume, Ctrl-C, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, TINY_MODEL

SMALL = ["--prompts-per-step", "4", "--completions-per-prompt", "4", "--num-minibatches", "2",
         "--micro-batch-size", "3", "--max-new-tokens", "10"]
STEP_METRICS = ["reward/mean", "reward/std", "response/length_mean", "kl/ref", "loss/total", "policy/clip_frac",
                "policy/entropy", "optim/grad_norm", "optim/lr", "time/rollout", "time/train", "time/sync",
                "throughput/tokens_per_s", "rollout/logprob_mismatch"]


def run_script(script: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / script), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_outputs_and_resume(tmp_path):
    out = tmp_path / "run"
    r = run_script("grpo.py", "--steps", "3", "--eval-every", "2", "--save-every", "2",
                   "--output-dir", str(out), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[2] and "eval/accuracy" in metrics[3]
    for m in metrics[1:]:
        assert all(k in m and math.isfinite(m[k]) for k in STEP_METRICS), m
        assert m["rollout/logprob_mismatch"] < 1e-3  # vLLM and the trainer agree on CPU in float32
    assert (out / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/accuracy_end"] == metrics[3]["eval/accuracy"]

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = final.state_dict()["model.layers.0.mlp.down_proj.weight"]
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(trained, initial), "three steps of training must change the weights"

    # resume from step 2: continues at step 3, the run's metrics keep one line per step
    r = run_script("grpo.py", "--steps", "4", "--resume", str(out / "checkpoints" / "step_2"), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3, 4]
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["optimizer"]["state"], "optimizer moments are saved"

    # the final model is a regular model folder that vLLM (and transformers) load
    r = run_script("grpo.py", "--model", str(out / "final"), "--steps", "1", "--output-dir", str(tmp_path / "again"),
                   *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]


def test_truncated_completions_masked_out_give_no_nan(tmp_path):
    """max_new_tokens 2: every completion is truncated (no EOS) and masked out of the loss."""
    out = tmp_path / "run"
    r = run_script("grpo.py", "--steps", "2", "--output-dir", str(out), "--mask-truncated-completions",
                   *SMALL[:-2], "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    for m in read_metrics(out)[1:]:
        assert m["response/truncated_frac"] == 1.0
        assert all(math.isfinite(v) for v in m.values())
        assert m["loss/total"] == 0.0 and m["optim/grad_norm"] == 0.0


def test_ctrl_c_saves_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "grpo.py"), "--steps", "1000", "--save-every", "0",
                             "--output-dir", str(out), *SMALL], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 2:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    checkpoints = list((out / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.pt").exists()
    assert f"--resume {checkpoints[0]}" in output
    step = int(checkpoints[0].name.removeprefix("step_"))
    assert read_metrics(out)[-1]["step"] == step


@pytest.mark.parametrize("flags,message", [
    (["--model", "no/such/model/dir"], "model path 'no/such/model/dir' does not exist"),
    (["--model", "./missing"], "does not exist"),
    (["--task", "nope"], "unknown task 'nope'; known tasks: basic_arithmetic, countdown, gsm8k, sort"),
    (["--completions-per-prompt", "1"], "--completions-per-prompt must be >= 2"),
    (["--max-new-tokens", "500"], "exceeds the model's context of 128 tokens"),
    (["--lr", "0"], "--lr must be positive"),
    (["--steps", "0"], "--steps must be positive"),
    (["--num-minibatches", "3"], "--num-minibatches 3 must divide the rollout batch"),
    (["--resume", "/tmp"], "is not a checkpoint folder"),
])
def test_bad_input_gives_one_line_error(flags, message):
    from common.utils import ConfigError
    from grpo import Args, main
    import tyro

    args = tyro.cli(Args, args=flags)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(args)


def test_bad_input_from_the_command_line_prints_no_traceback():
    r = run_script("grpo.py", "--task", "nope", timeout=300)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: unknown task 'nope'; known tasks: basic_arithmetic")
    assert "Traceback" not in r.stderr
