"""The non-finite guard (common/guard.py): an optimizer step whose loss or gradient is NaN or inf
changes nothing and is counted, a few in a row stop the run in one line, and no checkpoint or
final model is saved with a non-finite weight."""

import copy
import math
import os

import pytest
import torch

import grpo
from common.errors import RunError
from common.guard import step_if_finite
from common.run import Run
from common.scripts import algorithm_scripts, load_script
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
