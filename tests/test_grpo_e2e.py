"""grpo.py end to end through real vLLM on CPU: outputs, resume, bad input."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.scripts import algorithm_scripts
from tests.conftest import ROOT, pythonpath, TINY_MODEL, logprob_tolerance, read_optimizer_state

SMALL = ["--prompts-per-step", "4", "--completions-per-prompt", "4", "--num-minibatches", "2",
         "--micro-batch-size", "3", "--max-new-tokens", "10"]
STEP_METRICS = ["reward/mean", "reward/std", "response/length_mean", "kl/ref", "loss/total", "policy/clip_frac",
                "policy/entropy", "optim/grad_norm", "optim/lr", "time/rollout", "time/train", "time/sync",
                "throughput/tokens_per_s", "rollout/logprob_mismatch", "rollout/is_weight_mean",
                "rollout/is_ratio_min", "rollout/is_truncated_frac", "rollout/is_seq_masked_frac", "memory/peak_gib", "memory/engine_gib"]


def run_script(script: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.run([sys.executable, str(ROOT / script), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_outputs_and_resume(tmp_path, run_main):
    out = tmp_path / "run"
    args = run_main("grpo.py", "--steps", "3", "--eval-every", "2", "--save-every", "2", "--output-dir", out, *SMALL)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[2] and "eval/accuracy" in metrics[3]
    for m in metrics[1:]:
        assert all(k in m and math.isfinite(m[k]) for k in STEP_METRICS), m
        assert m["rollout/logprob_mismatch"] < logprob_tolerance(args)  # vLLM samples the trained policy
    assert (out / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/accuracy_end"] == metrics[3]["eval/accuracy"]
    assert summary["eval/accuracy_start"] == metrics[0]["eval/accuracy"]

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = final.state_dict()["model.layers.0.mlp.down_proj.weight"]
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(trained, initial), "three steps of training must change the weights"

    # resume from step 2 (the run's own flags are restored): continues at step 3, one line per step
    run_main("grpo.py", "--steps", "4", "--resume", out / "checkpoints" / "step_2", "--discard-later")  # final/: 3
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3, 4]
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and read_optimizer_state(out / "checkpoints" / "step_2")["state"], \
        "optimizer moments are saved"

    # the final model is a regular model folder that vLLM (a new engine) and transformers load
    run_main("grpo.py", "--model", out / "final", "--steps", "1", "--output-dir", tmp_path / "again", *SMALL)
    assert [m["step"] for m in read_metrics(tmp_path / "again")] == [0, 1]


def test_truncated_completions_masked_out_give_no_nan(tmp_path, run_main):
    """max_new_tokens 2: every completion is truncated (no EOS) and masked out of the loss."""
    out = tmp_path / "run"
    run_main("grpo.py", "--steps", "2", "--output-dir", out, "--mask-truncated-completions",
             *SMALL[:-2], "--max-new-tokens", "2")
    for m in read_metrics(out)[1:]:
        assert m["response/truncated_frac"] == 1.0
        assert all(math.isfinite(v) for v in m.values())
        assert m["loss/total"] == 0.0 and m["optim/grad_norm"] == 0.0


@pytest.mark.parametrize("flags,message", [
    (["--model", "no/such/model/dir"], "model path 'no/such/model/dir' does not exist"),
    (["--model", "./missing"], "does not exist"),
    (["--model", "models/tiny-sortt"], "model path 'models/tiny-sortt' does not exist (no such folder)"),
    (["--model", "models/tiny-sort/config.json"], "is a file, not a model folder"),
    (["--task", "nope"], "unknown task 'nope'; known tasks: arithmetic, basic_arithmetic, countdown, gsm8k, multiply, sort"),
    (["--completions-per-prompt", "1"], "--completions-per-prompt must be >= 2"),
    (["--max-new-tokens", "500"], "exceeds the model's context of 128 tokens"),
    (["--lr", "0"], "--lr must be positive"),
    (["--steps", "0"], "--steps must be positive"),
    (["--num-minibatches", "3"], "--num-minibatches 3 must divide the rollout batch"),
    (["--resume", "/tmp"], "is not a checkpoint folder"),
    (["--eval-every", "-1"], "--eval-every must be >= 0 (0: only at start and end), got -1"),
    (["--save-every", "-1"], "--save-every must be >= 0 (0: only on Ctrl-C), got -1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--vllm-cpu-kv-cache-gib", "0"], "--vllm-cpu-kv-cache-gib must be >= 1, got 0"),
    (["--eps-low", "1.5"], "--eps-low must be in [0, 1), got 1.5"),
    (["--output-dir", "/proc/rl-lm-test"], "--output-dir '/proc/rl-lm-test' is not usable"),
])
def test_bad_input_gives_one_line_error(flags, message, monkeypatch):
    """Each is found before the engine starts (create_engine would fail the test)."""
    import grpo
    from common.errors import ConfigError
    from common.args import parse_args

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(grpo, "create_engine", lambda *a, **k: pytest.fail("the engine started"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        grpo.main(parse_args(grpo.Args, flags))


def test_bad_input_from_the_command_line_prints_no_traceback():
    r = run_script("grpo.py", "--task", "nope", timeout=300)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: unknown task 'nope'; known tasks: arithmetic, basic_arithmetic")
    assert "Traceback" not in r.stderr


def test_a_vllm_start_prints_none_of_its_warnings(tmp_path):
    """vLLM's warnings (on CPU ~18 a start, about the settings this code chose or the build lacks;
    in bf16 18 more a weight sync) and its loading bar are not the run's output (common/engine.py)."""
    r = run_script("grpo.py", "--steps", "1", "--eval-every", "0", "--output-dir", str(tmp_path / "run"), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.search(r"WARNING|FutureWarning|Triton|Loading safetensors", r.stdout + r.stderr), r.stderr
    assert r.stdout.splitlines()[-1].startswith("done: held-out accuracy")


@pytest.mark.parametrize("num_minibatches, passes", [(1, 0), (2, 2)])
def test_one_update_per_batch_takes_old_logprobs_from_the_update(tmp_path, run_main, monkeypatch, num_minibatches,
                                                                passes):
    """With one epoch of one minibatch there is no separate old-log-prob pass (no reference either,
    --kl-coef 0), yet old_logprobs are the trainer's: vLLM's agree with them as closely as ever."""
    import grpo
    from common import ops

    calls = []
    monkeypatch.setattr(grpo, "batched_logprobs", lambda *a, **k: calls.append(1) or ops.batched_logprobs(*a, **k))
    out = tmp_path / "run"
    args = run_main("grpo.py", "--steps", "2", "--kl-coef", "0", "--eval-every", "0", "--save-every", "0",
                    "--output-dir", out, *SMALL, "--num-minibatches", num_minibatches)
    assert len(calls) == passes
    for m in read_metrics(out)[1:]:
        assert 0 < m["rollout/logprob_mismatch"] < logprob_tolerance(args)
        assert m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=10 * logprob_tolerance(args))


@pytest.mark.parametrize("script", algorithm_scripts())
def test_top_k_top_p_the_trainer_scores_what_the_engine_sampled(tmp_path, run_main, monkeypatch, script):
    """Under --top-k / --top-p every script's log-probs are those of the engine's truncated sampler
    (its processed log-probs): the mismatch stays at the precision's size. Scored over the full
    vocabulary instead (the truncation off in the trainer only), the same run's tokens disagree by
    far more. And every log-prob the script computes (old, reference, the update's) is of the truncation."""
    import inspect

    import common.ops
    from common.scripts import load_script

    module, truncations = load_script(script), []
    for name in ("forward_logprobs", "batched_logprobs"):
        def recorded(*a, _fn=getattr(common.ops, name), **k):
            bound = inspect.signature(_fn).bind(*a, **k)
            bound.apply_defaults()
            truncations.append((_fn.__name__, bound.arguments["top_k"], bound.arguments["top_p"]))
            return _fn(*a, **k)
        monkeypatch.setattr(module, name, recorded)
    flags = ["--steps", "1", "--eval-every", "0", "--save-every", "0", "--prompts-per-step", "4",
             "--completions-per-prompt", "4", "--max-new-tokens", "10", "--temperature", "1.5", "--top-k", "4",
             "--top-p", "0.8"]  # the flags every script has
    args = run_main(script, *flags, "--output-dir", tmp_path / "truncated")
    assert read_metrics(tmp_path / "truncated")[-1]["rollout/logprob_mismatch"] < logprob_tolerance(args)
    assert {"forward_logprobs"} <= {name for name, _, _ in truncations}  # the update's own
    assert {(k, p) for _, k, p in truncations} == {(4, 0.8)}
    monkeypatch.setattr(common.ops, "top_k_top_p_mask", lambda logits, top_k, top_p: torch.ones_like(logits, dtype=bool))
    run_main(script, *flags, "--output-dir", tmp_path / "full")
    assert read_metrics(tmp_path / "full")[-1]["rollout/logprob_mismatch"] > 0.05
