"""Your own task and rewards on the command line (common/rewards.py, --task FILE.py:FUNCTION,
--reward), and the completions a run writes to read."""

import json
import math
import signal
import time

import pytest

from common.errors import ConfigError, RunError
from common.rewards import Reward, RewardTerm, format_reward, load_reward, parse_reward_spec
from common.tasks import load_task
from common.args import parse_args
from tests.test_grpo_e2e import SMALL, read_metrics
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
    assert list(parts) == ["correct", "timeouts"] and total.tolist() == [1.0, 0.0]


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
    ("correct:nan", "the weight must be a finite number, got 'nan'"),
    ("correct:inf", "the weight must be a finite number, got 'inf'"),
    ("correct:abc", "the weight 'abc' is not a number"),
    ("USER:boom:abc", "the weight 'abc' is not a number"),
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


HOSTILE_CODE = '''
import sys

def above_float32(completion, example): return 1e39
def far_above(completion, example): return 1e300
def huge_int(completion, example): return 10**400
def near_max(completion, example): return 3e38
def timeouts(completion, example): return 0.0
'''


@pytest.fixture()
def hostile(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_CODE)
    return str(path)


@pytest.mark.parametrize("function, shown", [("above_float32", "1e+39"), ("far_above", "1e+300"),
                                             ("huge_int", "an integer of about 10^400")])
def test_a_reward_beyond_float32_is_one_line_naming_it(task, hostile, function, shown):
    """1e39 passes as a Python float but is inf in the float32 reward tensor (then NaN advantages
    and a NaN model); 10**400 does not even convert (OverflowError)."""
    with pytest.raises(ConfigError) as e:
        load_reward((f"{hostile}:{function}",), task)
    assert f"{function}' returned {shown} for completion" in str(e.value) and "float32" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_weighted_total_beyond_float32_is_one_line(task, hostile):
    reward = load_reward((f"{hostile}:near_max:2",), task)  # 3e38 fits float32, twice that does not
    with pytest.raises(ConfigError, match=r"weighted sum of the reward terms \(2 x near_max 3e\+38\) is beyond "
                                          r"float32's range for completion 'x'"):
        reward(["x"], [{}])


def test_a_term_may_not_take_the_name_of_the_timeout_count(task, hostile):
    with pytest.raises(ConfigError, match="the name 'timeouts' is taken"):
        load_reward((f"{hostile}:timeouts",), task)


def test_a_reward_file_that_exits_while_imported_is_one_line(task, tmp_path):
    user = tmp_path / "exits.py"
    user.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"importing '.*exits.py' failed \(SystemExit: 3\)"):
        load_reward((f"{user}:fn",), task)


def sleeps(completion: str, example: dict) -> float:
    """Far past any limit of these tests, unless the completion is the answer."""
    if completion != example["answer"]:
        time.sleep(600)
    return 1.0


def spins(completion: str, example: dict) -> float:
    """A pure-Python infinite loop that even catches what it can."""
    while True:
        try:
            pass
        except Exception:
            pass


def test_a_call_past_the_time_limit_scores_zero_is_counted_and_said(capsys):
    reward = Reward([RewardTerm("sleeps", sleeps, 1.0, "sleeps"), RewardTerm("spins", spins, 0.5, "spins")],
                    timeout=0.2)
    total, parts = reward(["123", "321"], [{"answer": "123"}] * 2)
    assert parts["sleeps"].tolist() == [1.0, 0.0] and parts["spins"].tolist() == [0.0, 0.0]
    assert parts["timeouts"].tolist() == [1.0, 2.0] and total.tolist() == [1.0, 0.0]
    assert capsys.readouterr().err == "reward calls past --reward-timeout 0.2 s scored 0: sleeps 1 of 2, spins 2 of 2\n"
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_math_verify_inside_a_reward_keeps_the_time_limit(capsys):
    """math-verify times itself out with signal.alarm, which would replace the limit's timer and
    cancel it on return: within a limit it has no timeout of its own, and the limit bounds the call."""
    from common.tasks import math_reward

    def verifies_then_sleeps(completion, example):
        math_reward(completion, example)
        time.sleep(5)  # without the limit the call returns after this, timed out or not
        return 1.0

    assert math_reward("\\boxed{3}", {"answer": "3"}) == 1.0  # math-verify imported before the limit
    _, parts = Reward([RewardTerm("verifies", verifies_then_sleeps, 1.0, "verifies")], timeout=0.3)(
        ["\\boxed{3}"], [{"answer": "3"}])
    assert parts["timeouts"].tolist() == [1.0]
    assert "Timeout is disabled" not in capsys.readouterr().err  # math-verify's warning: the limit is its timeout


def test_a_reward_that_hangs_on_the_probe_is_refused_before_training(task, tmp_path):
    user = tmp_path / "hangs.py"
    user.write_text("import time\ndef hangs(completion, example):\n    time.sleep(600)\n")
    with pytest.raises(ConfigError, match=r"reward '.*hangs' ran past --reward-timeout 0.2 s on a probe call"):
        load_reward((f"{user}:hangs",), task, timeout=0.2)


def test_a_run_scores_slow_calls_zero_counts_them_and_goes_on(tmp_path, in_root, capsys):
    """Each completion is the answer (the term returns at once) or sleeps past the limit: the two
    add up to the batch in every step's metrics, and stderr says so once a step that had any."""
    out = tmp_path / "run"
    grpo.main(parse_args(grpo.Args, ["--engine", "transformers", "--task", TASK, "--reward", "tests.test_rewards:sleeps",
                                     "--reward-timeout", "0.2", "--steps", "2", "--eval-every", "0",
                                     "--output-dir", str(out), *SMALL, "--prompts-per-step", "2"]))
    metrics = read_metrics(out)[1:]
    batch = 2 * 4  # prompts x completions
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/sleeps_mean"] * batch + m["reward/timeouts"] == pytest.approx(batch)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("reward calls past")]
    assert len(said) == sum(m["reward/timeouts"] > 0 for m in metrics)


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
    run_main(script, "--resume", out / "checkpoints" / "step_2", "--steps", "3", "--discard-later")  # final/: 3
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
