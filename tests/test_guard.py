"""The guards (common/guard.py). The non-finite guard: an optimizer step whose loss or gradient is
NaN or inf changes nothing and is counted, a few in a row stop the run in one line, and no
checkpoint or final model is saved with a non-finite weight. The sync guard: a run whose engine
no longer samples from the policy (its weight sync lost) stops in one line after a checkpoint; so
does a multi-turn run whose environment answered none of a step's or an evaluation's calls."""

import copy
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

import grpo
from common.errors import RunError
from common.engine import TransformersEngine
from common.guard import SYNC_MISMATCH_BOUNDS, SyncGuard, env_stalled, step_if_finite
from common.run import Run
from common.scripts import algorithm_scripts, load_script
from tests.test_grpo_e2e import SMALL, read_metrics
from tests.test_numerics import call_update, update_batch

SCRIPTS = algorithm_scripts()


def real_update(script, policy, tokenizer, monkeypatch, **flags):
    """The script's own update on one batch with a real AdamW (over the policy and PPO's critic, as
    its main makes it) and a warmup schedule: update(nan=True) makes compute_loss return loss * NaN."""
    module = load_script(script)
    batch, critic = update_batch(script, policy, tokenizer)
    models = [m for m in (policy, critic) if m is not None]
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))  # lr moves each step
    one_step = {"num_minibatches": 1} if hasattr(module.Args, "num_minibatches") else {}
    compute_loss = module.compute_loss

    def nan_loss(*args, **kwargs):
        loss, stats = compute_loss(*args, **kwargs)
        return loss * float("nan"), stats

    def update(nan: bool = False) -> dict:
        monkeypatch.setattr(module, "compute_loss", nan_loss if nan else compute_loss)
        return call_update(script, policy, critic, batch, optimizer, scheduler, micro_batch_size=2,
                           max_grad_norm=1.0, **one_step, **flags)

    return update, models, optimizer, scheduler


def snapshot(models, optimizer, scheduler) -> dict:
    return {"weights": [p.detach().clone() for m in models for p in m.parameters()],
            "optimizer": copy.deepcopy(optimizer.state_dict()), "scheduler": scheduler.state_dict()}


def assert_same(before: dict, after: dict) -> None:
    """Bit for bit: every weight, AdamW's step count and moments of every parameter, the schedule."""
    assert all(torch.equal(a, b) for a, b in zip(before["weights"], after["weights"]))
    states = before["optimizer"]["state"], after["optimizer"]["state"]
    assert states[0].keys() == states[1].keys() and len(states[0]) > 0
    assert all(torch.equal(states[0][i][k], states[1][i][k]) for i in states[0] for k in states[0][i])
    assert before["scheduler"] == after["scheduler"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_nan_loss_skips_the_optimizer_step_and_counts_it(script, tiny_policy, tokenizer, monkeypatch, capsys):
    update, models, optimizer, scheduler = real_update(script, tiny_policy, tokenizer, monkeypatch)
    finite = update()  # a finite step first: AdamW has moments and a step count to keep
    before = snapshot(models, optimizer, scheduler)
    stats = update(nan=True)
    assert_same(before, snapshot(models, optimizer, scheduler))
    assert all(p.grad is None for m in models for p in m.parameters())  # the gradient is dropped
    assert finite["optim/skipped_steps"] == [0]
    assert stats["optim/skipped_steps"] == [1] and math.isnan(stats["loss/total"][0])
    assert capsys.readouterr().err.count("skipped an optimizer step: loss nan") == 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_max_nonfinite_steps_in_a_row_stop_the_run_in_one_line(script, tiny_policy, tokenizer, monkeypatch):
    update, models, optimizer, scheduler = real_update(script, tiny_policy, tokenizer, monkeypatch,
                                                       max_nonfinite_steps=2)
    update()
    before = snapshot(models, optimizer, scheduler)
    update(nan=True)
    with pytest.raises(RunError, match=r"^stopping: 2 optimizer steps in a row had a non-finite loss") as error:
        update(nan=True)
    assert "\n" not in str(error.value)
    assert_same(before, snapshot(models, optimizer, scheduler))  # nothing non-finite to save


def test_a_finite_step_after_a_skipped_one_resets_the_count(tiny_policy, tokenizer, monkeypatch):
    update, models, optimizer, scheduler = real_update("grpo.py", tiny_policy, tokenizer, monkeypatch,
                                                       max_nonfinite_steps=2)
    assert update(nan=True)["optim/skipped_steps"] == [1]
    before = snapshot(models, optimizer, scheduler)["weights"]
    assert update()["optim/skipped_steps"] == [0]
    assert not torch.equal(before[0], next(tiny_policy.parameters()))  # that step was taken
    assert scheduler.last_epoch == 1  # the schedule counts the steps taken
    assert update(nan=True)["optim/skipped_steps"] == [1]  # 1 in a row again, not 2: no stop
    with pytest.raises(RunError, match="2 optimizer steps in a row"):
        update(nan=True)


def test_any_nonfinite_gradient_norm_skips_the_step():
    """PPO passes the critic's gradient norm beside the policy's: either one non-finite skips the
    joint step (one AdamW over both), with a finite loss too."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    stats = {}
    for norms, stepped in [((1.0, float("inf")), False), ((float("nan"), 1.0), False), ((1.0, 2.0), True)]:
        weight.grad = torch.ones(2)
        assert step_if_finite(optimizer, scheduler, stats, 3, 0.5, *map(torch.tensor, norms)) == stepped
        assert torch.equal(weight.detach(), torch.ones(2)) != stepped
    assert stats["optim/skipped_steps"] == [2]


def test_a_checkpoint_or_final_model_with_a_nonfinite_weight_is_refused(tmp_path, tiny_policy, tokenizer):
    run = Run(grpo.Args(output_dir=str(tmp_path / "run")))
    optimizer = torch.optim.AdamW(tiny_policy.parameters())
    name, weight = list(tiny_policy.named_parameters())[-1]
    with torch.no_grad():
        weight.view(-1)[0] = float("inf")
    with pytest.raises(RunError, match=rf"^not saving checkpoint .*step_1: the policy's weight {name} is not finite"):
        run.save_checkpoint(1, {"policy": tiny_policy}, tokenizer, {}, optimizer)
    with pytest.raises(RunError, match=rf"^not saving .*final: the policy's weight {name} is not finite"):
        run.finish(tiny_policy, tokenizer, {"eval/accuracy": 0.5})
    assert not {"checkpoints", "final", "final.tmp", "summary.json"} & set(os.listdir(tmp_path / "run"))


# ------------------------------------------------------------------ the sync guard

def test_the_sync_guard_stops_after_max_in_a_row_steps_above_the_bound():
    guard = SyncGuard(2, "fp32")
    assert guard.bound == SYNC_MISMATCH_BOUNDS["fp32"] == 1e-3
    # a working sync (~3e-7), one step above the bound, a good one (the count restarts), then two above
    assert [guard.check(m) for m in (3e-7, 0.1, 3e-7, 0.1)] == [None] * 4
    line = guard.check(0.2)
    assert line == ("the engine is not sampling from the policy: weights not synchronized? Its log-probs of its "
                    "samples were 2 steps in a row far from the policy's (rollout/logprob_mismatch 0.2, above the "
                    "0.001 that fp32 numerics explain; --max-unsynced-steps 0 turns this check off)")
    assert SyncGuard(2, "bf16").check(0.09) is None and SyncGuard(1, "bf16").check(0.2) is not None


def test_the_sync_guard_is_off_for_the_transformers_engine_and_with_max_unsynced_steps_0(tiny_policy):
    """The transformers engine samples from the policy itself: no sync to lose, whatever its numerics."""
    for precision in ("fp32", "bf16"):
        args = grpo.Args(precision=precision, device="cpu")
        assert SyncGuard.of(args, TransformersEngine("models/tiny-sort", 0, "float32")).bound is None
        assert SyncGuard.of(args, object()).numerics == precision  # any other engine: vLLM
    assert SyncGuard.of(grpo.Args(precision="fp32", dtype="bfloat16", device="cpu"), object()).numerics == "bf16"
    off = SyncGuard.of(grpo.Args(max_unsynced_steps=0, device="cpu"), object())
    assert off.bound is None and off.check(10.0) is None


def lose_syncs_after_the_first(monkeypatch, module) -> None:
    """The script's sync_weights does nothing after the first (main's, into the fresh engine): the
    bug the guard is for (TRL, verl, ms-swift each shipped one)."""
    sync_weights, calls = module.sync_weights, []

    def lost(llm, policy):
        calls.append(1)
        if len(calls) == 1:
            sync_weights(llm, policy)

    monkeypatch.setattr(module, "sync_weights", lost)


@pytest.mark.parametrize("lora", [[], ["--lora-rank", "8"]], ids=["full", "lora"])
def test_a_run_whose_sync_is_lost_stops_after_a_checkpoint(lora, run_main, tmp_path, monkeypatch):
    """vLLM's engine (skipped where vLLM is absent: the transformers engine has no sync to lose). Step 1 samples from the synced start; steps 2 and 3 from it too, while the policy has moved
    (under LoRA too, where it moves less): --max-unsynced-steps 2 stops after step 3, saved."""
    lose_syncs_after_the_first(monkeypatch, load_script("grpo.py"))
    out = tmp_path / "run"
    with pytest.raises(RunError) as error:
        run_main("grpo.py", "--engine", "vllm", "--steps", "5", "--eval-every", "0", "--save-every", "0",
                 "--output-dir", out, *lora, *SMALL)
    checkpoint = out / "checkpoints" / "step_3"
    assert str(error.value).startswith("the engine is not sampling from the policy: weights not synchronized? ")
    assert str(error.value).endswith(f"; stopped after step 3, saved: --resume {checkpoint}")
    assert "\n" not in str(error.value) and (checkpoint / "trainer_state.pt").is_file()
    mismatch = [m["rollout/logprob_mismatch"] for m in read_metrics(out)[1:]]
    assert len(mismatch) == 3 and mismatch[0] < 1e-5 and min(mismatch[1:]) > SYNC_MISMATCH_BOUNDS["fp32"]
    assert f"rollout/logprob_mismatch {mismatch[2]:.3g}, above the 0.001 that fp32" in str(error.value)


def test_a_normal_run_and_a_resumed_lora_run_never_trip_it(run_main, tmp_path):
    """A working sync keeps every step's gap below the bound: full fine-tuning, LoRA, and LoRA resumed
    (ms-swift's adapters came back doubled after a resume); each run would stop otherwise."""
    run_main("grpo.py", "--engine", "vllm", "--steps", "3", "--eval-every", "0", "--output-dir", tmp_path / "full",
             *SMALL)
    lora = tmp_path / "lora"
    run_main("grpo.py", "--engine", "vllm", "--steps", "2", "--eval-every", "0", "--save-every", "2",
             "--lora-rank", "8", "--output-dir", lora, *SMALL)
    run_main("grpo.py", "--resume", lora / "checkpoints" / "step_2", "--steps", "4")
    for run in (tmp_path / "full", lora):
        assert all(m["rollout/logprob_mismatch"] < 1e-5 for m in read_metrics(run)[1:])
    assert [m["step"] for m in read_metrics(lora)] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------ an environment that answers nothing

def test_a_step_or_evaluation_whose_every_env_call_timed_out_is_a_stop():
    args = SimpleNamespace(env="my.py:env", env_timeout=10.0)
    assert env_stalled(args, {"env/calls": 8.0, "env/timeouts": 8.0}, "in step 3") == (
        "--env 'my.py:env': every one of its 8 calls in step 3 ran past --env-timeout 10 s (or its worker died)")
    assert env_stalled(args, {"env/calls": 8.0, "env/timeouts": 7.0}, "in step 3") is None  # one answered
    assert env_stalled(args, {"env/calls": 0.0, "env/timeouts": 0.0}, "in step 3") is None  # turns cut by limits
    assert env_stalled(args, {"reward/mean": 1.0}, "in step 3") is None  # a single-turn script
    evaluated = {"env/calls": 8.0, "env/timeouts": 1.0, "eval/env/calls": 4.0, "eval/env/timeouts": 4.0}
    assert env_stalled(args, evaluated, "in step 3") is None
    assert env_stalled(args, evaluated, "evaluating after step 3").startswith("--env 'my.py:env': every one of its 4 ")


class TimesOut:
    """The environment as run_episodes sees it when every call runs past --env-timeout."""

    def __init__(self, env):
        self.stop, self.start, self.max_turns = env.stop, env.start, env.max_turns

    def steps(self, states, turns):
        return [None] * len(turns)


MULTITURN = ["--engine", "transformers", "--task", "sort", "--env", "examples/my_env.py:retry", "--max-new-tokens",
             "40", "--max-turn-tokens", "12", "--prompts-per-step", "2", "--completions-per-prompt", "4",
             "--num-minibatches", "2", "--micro-batch-size", "4", "--save-every", "0", "--eval-every", "0"]


@pytest.mark.parametrize("when", ["training", "evaluation"])
def test_a_multiturn_run_whose_env_answers_nothing_stops_in_one_line(when, run_main, tmp_path, monkeypatch):
    """Every call of step 1's rollouts (or of the starting evaluation's) past the limit: the run stops
    after step 1, saved, instead of paying the limit for every call of every step that follows."""
    module = load_script("grpo_multiturn.py")
    real = module.run_episodes

    def run_episodes(llm, env, tokenizer, prompt_ids, examples, args, temperature):
        hangs = temperature > 0 if when == "training" else temperature == 0
        return real(llm, TimesOut(env) if hangs else env, tokenizer, prompt_ids, examples, args, temperature)

    monkeypatch.setattr(module, "run_episodes", run_episodes)
    out = tmp_path / "run"
    with pytest.raises(RunError) as error:
        run_main("grpo_multiturn.py", "--steps", "3", "--output-dir", out, *MULTITURN)
    message = str(error.value)
    assert "\n" not in message
    if when == "training":
        checkpoint = out / "checkpoints" / "step_1"
        assert re.fullmatch(r"--env 'examples/my_env.py:retry': every one of its \d+ calls in step 1 ran past "
                            rf"--env-timeout 10 s \(or its worker died\); stopped after step 1, saved: --resume "
                            rf"{re.escape(str(checkpoint))}", message), message
        assert (checkpoint / "trainer_state.pt").is_file() and [m["step"] for m in read_metrics(out)] == [0, 1]
    else:
        assert re.fullmatch(r"--env 'examples/my_env.py:retry': every one of its \d+ calls evaluating the starting "
                            r"policy ran past --env-timeout 10 s \(or its worker died\); stopped before step 1",
                            message), message
