"""Your own task and rewards on the command line (common/rewards.py, --task FILE.py:FUNCTION,
--reward), and the completions a run writes to read."""

import json
import math

import pytest

from common.errors import ConfigError, RunError
from common.rewards import format_reward, load_reward, parse_reward_spec
from common.tasks import load_task
from common.args import parse_args
from tests.test_grpo_e2e import read_metrics
from tests.test_runs import fake_checkpoint

import grpo

TASK = "examples/my_task.py:make_task"
CORRECT, SAME_DIGITS = "examples/my_rewards.py:correct", "examples/my_rewards.py:same_digits"


@pytest.fixture()
def in_root(monkeypatch):
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # the examples' paths are relative to the project's root


@pytest.fixture()
def task(in_root):
    return load_task(TASK, seed=0)


def test_task_from_a_file_is_seeded_and_held_out(task):
    assert task.name == "short-sort" and len(task.eval) == 50
    assert load_task(TASK, seed=0).train == task.train and load_task(TASK, seed=1).train != task.train
    assert not {e["prompt"] for e in task.eval} & {e["prompt"] for e in task.train}
    assert task.reward(" 0123", {"answer": "0123"}) == 1.0


def test_weighted_sum_of_terms_hand_computed(task):
    reward = load_reward((CORRECT, f"{SAME_DIGITS}:0.5", "format:-0.25"), task)
    completions = ["123", "321", "12", "<answer>123</answer>"]
    total, parts = reward(completions, [{"answer": "123"}] * 4)
    assert parts["correct"].tolist() == [1, 0, 0, 0]
    assert parts["same_digits"].tolist() == [1, 1, 0, 0]
    assert parts["format"].tolist() == [0, 0, 0, 1]
    assert total.tolist() == [1.5, 0.5, 0.0, -0.25]


def test_default_is_the_tasks_own_reward(task):
    total, parts = load_reward((), task)(["123", "12"], [{"answer": "123"}] * 2)
    assert list(parts) == ["correct"] and total.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("spec, parsed", [("format", ("format", 1.0)), ("format:0.2", ("format", 0.2)),
                                          ("my.py:fn", ("my.py:fn", 1.0)), ("my.py:fn:-1", ("my.py:fn", -1.0)),
                                          ("pkg.mod:fn:2e-1", ("pkg.mod:fn", 0.2))])
def test_parse_reward_spec(spec, parsed):
    assert parse_reward_spec(spec) == parsed


def test_format_reward():
    assert format_reward("so <answer>4</answer>", {}) == 1.0
    assert format_reward("the answer is \\boxed{4}.", {}) == 1.0
    assert format_reward("<answer>4", {}) == 0.0 and format_reward("4", {}) == 0.0
    assert format_reward("put it within \\boxed{} within \\boxed{ }", {}) == 0.0  # empty: no answer
    assert format_reward("<answer> </answer>", {}) == 0.0
    assert format_reward("\\boxed{\\frac{1}{2}}", {}) == 1.0


USER_CODE = '''
import math
from common.tasks import Task

def nan(completion, example): return math.nan
def text(completion, example): return "1"
def boom(completion, example): raise KeyError("score")
def late_boom(completion, example):
    if completion == "x": raise ValueError("cannot read x")
    return 0.0
def one_argument(completion): return 1.0
def not_a_task(): return [1, 2]
def empty_task(seed): return Task("t", [], [{"prompt": "p"}], late_boom)
def two_args(a, b): return None
'''


@pytest.mark.parametrize("spec, message", [
    ("missing.py:fn", "file 'missing.py' does not exist"),
    ("USER:nope", "has no function 'nope' (it has: boom, empty_task, late_boom, nan, not_a_task, one_argument, "
                  "text, two_args)"),
    ("USER:one_argument", "takes (completion, example), one_argument has the signature (completion)"),
    ("USER:nan", "returned nan"),
    ("USER:text", "returned '1'"),
    ("USER:boom", "raised KeyError: 'score'"),
    ("format:1e999", "the weight must be a finite number"),
    ("no_such_module:fn", "cannot import module 'no_such_module'"),
])
def test_bad_reward_is_one_line_naming_file_and_function(task, tmp_path, spec, message):
    user = tmp_path / "user_rewards.py"
    user.write_text(USER_CODE)
    spec = spec.replace("USER", str(user))
    with pytest.raises(ConfigError) as e:
        load_reward((spec,), task)
    assert message in str(e.value) and spec in str(e.value) and "\n" not in str(e.value)


def test_reward_failing_during_training_names_it(task, tmp_path):
    user = tmp_path / "late.py"
    user.write_text(USER_CODE)
    reward = load_reward((f"{user}:late_boom",), task)  # the probe passes
    with pytest.raises(RunError, match="late_boom' raised ValueError: cannot read x on completion 'x'"):
        reward(["y", "x"], [{}, {}])


@pytest.mark.parametrize("function, message", [
    ("not_a_task", "returned list, not a Task"),
    ("empty_task", "Task.train must be a non-empty list"),
    ("two_args", "a task function takes no argument or `seed`"),
])
def test_bad_task_is_one_line(tmp_path, function, message):
    user = tmp_path / "user_task.py"
    user.write_text(USER_CODE)
    with pytest.raises(ConfigError, match=message):
        load_task(f"{user}:{function}")


def test_repeated_flag_on_resume_replaces_the_saved_terms(tmp_path, in_root):
    checkpoint = fake_checkpoint(tmp_path / "run", 1, task=TASK, reward=(CORRECT, f"{SAME_DIGITS}:0.5"))
    args = parse_args(grpo.Args, ["--resume", checkpoint])
    assert args.reward == (CORRECT, f"{SAME_DIGITS}:0.5")
    # the same command line again is the same run, not four terms
    args = parse_args(grpo.Args, ["--resume", checkpoint, f"--reward={CORRECT}", f"--reward={SAME_DIGITS}:0.5"])
    assert args.reward == (CORRECT, f"{SAME_DIGITS}:0.5")
    with pytest.raises(ConfigError, match="--reward"):
        parse_args(grpo.Args, ["--resume", checkpoint, "--reward", CORRECT])


@pytest.mark.parametrize("script", ["grpo.py", "reinforce.py"])
def test_own_task_and_rewards_train_and_write_completions(tmp_path, run_main, script):
    out = tmp_path / "run"
    run_main(script, "--task", TASK, "--reward", CORRECT, "--reward", f"{SAME_DIGITS}:0.5", "--steps", "3",
             "--prompts-per-step", "8", "--completions-per-prompt", "4", "--log-completions", "6", "--lr", "1e-3",
             "--save-every", "2", "--eval-every", "0", "--output-dir", out)
    metrics = read_metrics(out)
    for m in metrics[1:]:
        assert math.isclose(m["reward/mean"], m["reward/correct_mean"] + 0.5 * m["reward/same_digits_mean"],
                            rel_tol=1e-5, abs_tol=1e-6)
    assert any(m["reward/correct_mean"] > 0 for m in metrics[1:]), "the tiny model sorts some of these"

    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 6 + [2] * 6 + [3] * 6
    for r in records:
        assert r["prompt"].startswith("sort ") and isinstance(r["completion"], str)
        assert r["reward"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/same_digits"])
    # the first 4 records are one prompt's group, the next 2 the next prompt's
    assert len({r["prompt"] for r in records[:4]}) == 1
    if script == "grpo.py":  # group-normalized advantages: centered within the group
        assert sum(r["advantage"] for r in records[:4]) == pytest.approx(0, abs=1e-4)

    # resuming from step 2 drops step 3's records and writes it again
    run_main(script, "--resume", out / "checkpoints" / "step_2", "--steps", "3")
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 6 + [2] * 6 + [3] * 6



def test_completions_go_to_a_wandb_table_with_track(tmp_path, monkeypatch):
    import sys
    import types

    import torch

    from common.run import Run

    logged = []
    fake = types.SimpleNamespace(Table=lambda columns, data: ("table", columns, data),
                                 init=lambda **kw: types.SimpleNamespace(log=lambda d, step: logged.append((step, d)),
                                                                         finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = Run(grpo.Args(output_dir=str(tmp_path / "run"), track=True, log_completions=3))
    rewards, parts = torch.tensor([1.0, 0.0, 0.5, 1.0]), {"correct": torch.tensor([1.0, 0.0, 0.0, 1.0])}
    advantages = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [1.0, 0.0], [2.0, 0.0]])  # per token: the first's
    run.log_completions(7, ["p", "q"], ["a", "b", "c", "d"], rewards, parts, advantages)
    run.logger.close()
    (step, data), = logged
    kind, columns, rows = data["completions"]
    assert step == 7 and columns == ["step", "prompt", "completion", "reward", "reward/correct", "advantage"]
    assert rows == [[7, "p", "a", 1.0, 1.0, 0.5], [7, "p", "b", 0.0, 0.0, -0.5], [7, "q", "c", 0.5, 0.0, 1.0]]
