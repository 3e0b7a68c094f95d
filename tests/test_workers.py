"""The user's code in worker processes (common/workers.py, issue 36): a reward or an environment
that misbehaves (its own SIGALRM handler, `except BaseException`, a C call that never checks for
signals, a never-ending thread, a crash) costs its call, counted, and never the run: the run
finishes its steps and leaves nothing running."""

import os
import subprocess
import sys

import pytest

from common.env import load_env
from common.rewards import load_reward
from common.tasks import load_task
from tests.conftest import ROOT
from tests.test_grpo_e2e import SMALL, read_metrics

# Each function answers at once on the answer itself (the start-up probe's completion) and
# misbehaves on anything else; each call writes its process id to PIDS.
HOSTILE = '''
import ctypes, hashlib, os, signal, threading, time

PIDS = {pids!r}


def called():
    with open(PIDS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")


def alarm_off(completion, example):
    """Switches a SIGALRM limit off (its own handler, alarm(0)), then spins."""
    called()
    signal.signal(signal.SIGALRM, lambda *_: None)
    signal.alarm(0)
    while completion != example["answer"]:
        pass
    return 1.0


def retries(completion, example):
    """A retry loop that catches everything, the limit's exception too."""
    called()
    while completion != example["answer"]:
        try:
            time.sleep(600)
        except BaseException:
            pass
    return 1.0


def c_call(completion, example):
    """One C call that never checks for signals (OpenSSL's loop; a huge integer power checks them):
    an hour of key derivation."""
    called()
    if completion != example["answer"]:
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2 ** 31 - 1)
    return 1.0


def leaves_a_thread(completion, example):
    """Returns at once, leaving a never-ending non-daemon thread behind."""
    called()
    threading.Thread(target=time.sleep, args=(10 ** 6,)).start()
    return 1.0


def exits(completion, example):
    called()
    if completion != example["answer"]:
        os._exit(3)
    return 1.0


def segfaults(completion, example):
    called()
    if completion != example["answer"]:
        ctypes.string_at(0)
    return 1.0


class Hangs:
    """An environment whose step catches everything and sleeps on any turn but the empty one."""
    stop = ("</call>",)

    def start(self, example):
        return {{"turns": 0}}

    def step(self, state, turn):
        from common.env import Step

        called()
        state["turns"] += 1
        while turn:
            try:
                time.sleep(600)
            except BaseException:
                pass
        return Step("ok " + str(state["turns"]))


def hangs():
    return Hangs()
'''
HANGING = ["alarm_off", "retries", "c_call"]


@pytest.fixture()
def hostile(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE.format(pids=str(tmp_path / "pids")))
    return path


def running(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(tmp_path) -> set[int]:
    return {int(line) for line in (tmp_path / "pids").read_text().split()}


@pytest.fixture()
def task(monkeypatch):
    monkeypatch.chdir(ROOT)
    return load_task("examples/my_task.py:make_task", seed=0)


@pytest.mark.parametrize("function", HANGING + ["exits", "segfaults"])
def test_a_call_that_defeats_an_in_process_limit_scores_zero_and_is_counted(task, hostile, function, capsys):
    reward = load_reward((f"{hostile}:{function}",), task, timeout=0.5)
    answer = task.train[0]["answer"]
    total, parts = reward([answer, "x", answer, "y"], [task.train[0]] * 4)
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0] and parts["timeouts"].tolist() == [0.0, 1.0, 0.0, 1.0]
    err = capsys.readouterr().err
    if function in HANGING:
        assert err == f"reward calls past --reward-timeout 0.5 s scored 0: {function} 2 of 4\n"
    else:  # a crash: a line of its own, counted as a timeout
        how = "exit code 3" if function == "exits" else "killed by SIGSEGV"
        assert err == f"reward '{hostile}:{function}': its worker died ({how}) on 2 of 4 completions " \
                      f"(the first: 'x'); they scored 0\n"


def test_an_env_step_past_the_limit_ends_its_episode_and_keeps_the_others_state(task, hostile):
    env = load_env(f"{hostile}:hangs", task, timeout=0.5)
    first, second = env.start(task.train[0]), env.start(task.train[0])
    assert env.step(first, "").observation == "ok 1"
    assert env.step(second, "<call>1</call>") is None  # killed with its worker: the episode ends
    assert env.step(first, "").observation == "ok 2"  # the state lives in the run, not in a worker


def test_a_run_with_hostile_rewards_finishes_counts_and_leaves_nothing_running(tmp_path, hostile):
    """The probe's four cases as --reward terms of one run: three calls that hang past the limit in
    ways SIGALRM cannot stop, and one that leaves a never-ending thread. Each term scores 1 on a
    completion that is the answer; the hanging ones time out on every other (counted: for each of
    the three, the batch less its right answers), and the run exits with its workers gone."""
    out = tmp_path / "run"
    rewards = [flag for f in HANGING + ["leaves_a_thread"] for flag in ("--reward", f"{hostile}:{f}")]
    proc = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--engine", "transformers",
                           "--task", "examples/my_task.py:make_task", *rewards, "--reward-timeout", "0.5",
                           "--steps", "2", "--eval-every", "0", "--output-dir", str(out), *SMALL,
                           "--prompts-per-step", "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)[1:]
    batch = 2 * 4  # prompts x completions
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        right = m["reward/leaves_a_thread_mean"] * batch  # the term that always answers: 1 each
        assert right == batch
        wrong = batch - m["reward/alarm_off_mean"] * batch
        assert all(m[f"reward/{f}_mean"] == m["reward/alarm_off_mean"] for f in HANGING)
        assert m["reward/timeouts"] == pytest.approx(3 * wrong)
    assert not [pid for pid in pids(tmp_path) if running(pid)]
