"""A run is never lost or mixed: --resume restores the run's arguments, a used output folder
is refused, Ctrl-C and SIGTERM save, a failed save leaves the previous checkpoint and no fake
model, and bad paths or flags are one line before anything heavy starts."""

import errno
import io
import json
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
import time
import types
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError, RunError
from common.scripts import algorithm_scripts, load_script
import common.interrupt
from common.args import cli, parse_args, RESUMABLE_CHANGES
from common.run import LOCK_FILE, Run
from common.allocator import tcmalloc_path
from tests.conftest import ROOT, pythonpath, TINY_MODEL
from tests.test_grpo_e2e import SMALL, read_metrics

import grpo
import ppo


def fake_checkpoint(run_dir, step: int, script: str = "grpo.py", **flags) -> str:
    """A checkpoint folder as Run.save_checkpoint writes it, minus the weights (one tensor of
    optimizer state): enough for everything that is decided before a model is loaded."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import save as dcp_save

    Args = {"grpo.py": grpo.Args, "ppo.py": ppo.Args}[script]
    args = Args(**flags)
    args.output_dir = str(run_dir)
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    torch.save({"step": step}, path / "trainer_state.pt")
    dcp_save({"optimizer": {"exp_avg": torch.arange(4.0), "step": 3}}, checkpoint_id=str(path / "optimizer"))
    (path / "policy").mkdir()
    (path / "policy" / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, path / "policy" / "model.safetensors")
    info = {"script": script, "step": step, "accuracy_start": 0.25, "wall_time_s": 10.0, "args": vars(args)}
    (path / "run.json").write_text(json.dumps(info))
    return str(path)


# ------------------------------------------------------------------ --resume restores the run

def test_resume_restores_the_saved_arguments_not_the_defaults(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path / "run", 3, prompts_per_step=8, completions_per_prompt=4, eval_every=2,
                           steps=12, save_every=5, lr=1e-4)
    args = parse_args(grpo.Args, ["--resume", ckpt])
    assert (args.prompts_per_step, args.completions_per_prompt, args.eval_every, args.steps, args.save_every,
            args.lr) == (8, 4, 2, 12, 5, 1e-4)
    assert args.output_dir == str(tmp_path / "run") and args.resume == ckpt
    assert "resume:" not in capsys.readouterr().out  # nothing changed, nothing said

    args = parse_args(grpo.Args, ["--resume", ckpt, "--steps", "20", "--eval-every", "4"])
    assert (args.steps, args.eval_every, args.prompts_per_step) == (20, 4, 8)
    out = capsys.readouterr().out
    assert "resume: --steps 12 -> 20" in out and "resume: --eval-every 2 -> 4" in out


@pytest.mark.parametrize("flags,message", [
    (["--model", "other/model"], r"made with --model 'models/tiny-sort' \(you asked for 'other/model'\)"),
    (["--prompts-per-step", "16"], r"--prompts-per-step 8 \(you asked for 16\)"),
    (["--lr", "1e-3"], r"--lr 0.0001 \(you asked for 0.001\)"),
    (["--no-scale-rewards"], r"--scale-rewards True \(you asked for False\)"),
    (["--overwrite"], "--overwrite and --resume contradict each other"),
    (["--steps", "2"], r"--steps 2 is below the step of this checkpoint \(3\)"),  # the model has trained 3
])
def test_resume_refuses_flags_that_define_the_run(tmp_path, flags, message):
    ckpt = fake_checkpoint(tmp_path / "run", 3, prompts_per_step=8, lr=1e-4)
    with pytest.raises(ConfigError, match=message):
        parse_args(grpo.Args, ["--resume", ckpt, *flags])


def test_resumable_changes_are_flags_of_every_script():
    for script in algorithm_scripts():
        fields = vars(load_script(script).Args())
        assert all(name in fields for name in RESUMABLE_CHANGES), script


def test_resume_of_another_scripts_checkpoint_names_both(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 2, script="ppo.py")
    with pytest.raises(ConfigError, match=r"made by ppo.py \(model 'models/tiny-sort'\), not grpo.py; "
                                          r"resume it with: python ppo.py --resume"):
        parse_args(grpo.Args, ["--resume", ckpt])


def test_resume_finds_the_latest_checkpoint_of_a_run_folder_and_refuses_half_written_ones(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    latest = fake_checkpoint(run, 10)
    (run / "checkpoints" / "step_12.tmp").mkdir()  # a save that died
    assert parse_args(grpo.Args, ["--resume", str(run)]).resume == latest
    with pytest.raises(ConfigError, match=f"half-written checkpoint.*resume from a complete one: {latest}"):
        parse_args(grpo.Args, ["--resume", str(run / "checkpoints" / "step_12.tmp")])
    with pytest.raises(ConfigError, match="no such folder"):
        parse_args(grpo.Args, ["--resume", str(run / "checkpoints" / "step_99")])
    with pytest.raises(ConfigError, match="is not a checkpoint folder"):
        parse_args(grpo.Args, ["--resume", str(tmp_path)])
    shutil.rmtree(os.path.join(latest, "optimizer"))  # before torch.distributed.checkpoint: state in trainer_state.pt
    with pytest.raises(ConfigError, match=r"older version of these scripts \(no optimizer/ folder\)"):
        parse_args(grpo.Args, ["--resume", latest])
    os.remove(os.path.join(latest, "run.json"))
    with pytest.raises(ConfigError, match="older version of these scripts"):
        parse_args(grpo.Args, ["--resume", latest])


def cut(path, keep: int) -> None:
    """A file ends `keep` bytes from its start (negative: that many bytes fewer)."""
    os.truncate(path, keep if keep >= 0 else os.path.getsize(path) + keep)


def flip(path, at: float) -> None:
    """One byte, at this fraction of the file, inverted."""
    data = bytearray(Path(path).read_bytes())
    data[int(at * len(data))] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def distcp(checkpoint) -> str:
    return next(str(p) for p in Path(checkpoint, "optimizer").glob("*.distcp"))


@pytest.mark.parametrize("damage, message", [
    (lambda c: cut(f"{c}/policy/model.safetensors", 40), r"policy/model.safetensors: truncated: its header says \d+ "
                                                           r"bytes, the file has 32 after the length"),
    (lambda c: cut(f"{c}/policy/model.safetensors", -4), r"policy/model.safetensors: truncated: its tensors need 24 "
                                                           r"bytes of data, the file holds 20"),
    (lambda c: os.remove(f"{c}/policy/model.safetensors"), r"policy/: no weights file"),
    (lambda c: flip(distcp(c), 0.9), r"optimizer/__0_0.distcp: the item at byte \d+: not a whole zip \(\w+: "),
    (lambda c: cut(distcp(c), 100), r"optimizer/__0_0.distcp: truncated \(100 bytes, an item needs \d+\)"),
    (lambda c: cut(f"{c}/optimizer/.metadata", 50), r"optimizer/.metadata: does not load \(\w+\)"),
    (lambda c: cut(f"{c}/trainer_state.pt", 300), r"trainer_state.pt: not a whole zip"),
    (lambda c: flip(f"{c}/trainer_state.pt", 0.05), r"trainer_state.pt: not a whole zip \(BadZipFile: Bad CRC-32"),
    (lambda c: cut(f"{c}/run.json", 30), r"run.json: not JSON \(JSONDecodeError"),
], ids=["safetensors-header", "safetensors-data", "no-weights", "optimizer-shard-byte", "optimizer-shard-cut",
        "optimizer-metadata", "trainer-state-cut", "trainer-state-byte", "run-json"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_whole_one_before(tmp_path, damage, message):
    """Before any model loads: which file is damaged, and the latest whole checkpoint before it; a
    run folder whose latest is damaged resumes from that one, saying so."""
    run = tmp_path / "run"
    whole = fake_checkpoint(run, 2)
    damaged = fake_checkpoint(run, 4)
    assert parse_args(grpo.Args, ["--resume", damaged]).resume == damaged  # whole until damaged
    damage(damaged)
    with pytest.raises(ConfigError) as error:
        parse_args(grpo.Args, ["--resume", damaged])
    assert re.fullmatch(rf"--resume '{re.escape(damaged)}' is damaged: {message}.*; the latest whole checkpoint "
                        rf"before it: --resume {re.escape(whole)}", str(error.value)), str(error.value)


def test_a_run_folder_resumes_from_its_latest_whole_checkpoint(tmp_path, capsys):
    from common.args import latest_checkpoint

    run = tmp_path / "run"
    first, whole, damaged = (fake_checkpoint(run, step) for step in (2, 4, 6))
    cut(f"{damaged}/trainer_state.pt", 10)
    assert parse_args(grpo.Args, ["--resume", str(run)]).resume == whole == latest_checkpoint(str(run))
    assert (f"--resume '{run}': its latest checkpoint {damaged} is damaged (trainer_state.pt: not a whole zip "
            f"(BadZipFile: File is not a zip file)); resuming from {whole}, the latest whole one") in capsys.readouterr().err
    for c in (first, whole):
        cut(f"{c}/policy/model.safetensors", -1)
    with pytest.raises(ConfigError, match=rf"^--resume '{re.escape(str(run))}': every checkpoint of this run is "
                                          rf"damaged \(the latest, {re.escape(damaged)}: trainer_state.pt: .*\): "
                                          rf"start it again$"):
        parse_args(grpo.Args, ["--resume", str(run)])
    with pytest.raises(ConfigError, match="; no earlier checkpoint of its run is whole$"):
        parse_args(grpo.Args, ["--resume", whole])


def test_a_checkpoint_that_reads_back_damaged_is_never_recommended(tmp_path, tiny_policy, tokenizer, monkeypatch):
    """A save is read back before any line names it (Ctrl-C's "continue with --resume", a guard's stop):
    a checkpoint written damaged (a failing disk: here a byte lost after the save) is one line naming the
    latest whole one instead."""
    run = Run(grpo.Args(output_dir=str(tmp_path / "run")))
    optimizer = torch.optim.AdamW(tiny_policy.parameters())
    run.saved = ({"policy": tiny_policy}, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                 torch.Generator())
    run.llm, run.tokenizer = None, tokenizer
    first = run.save_step(1, {})
    real = run.save_checkpoint

    def save_then_lose_a_byte(*args):
        path = real(*args)
        cut(f"{path}/trainer_state.pt", -1)
        return path

    monkeypatch.setattr(run, "save_checkpoint", save_then_lose_a_byte)
    with pytest.raises(RunError, match=rf"^checkpoint .*step_2 reads back damaged \(trainer_state.pt: not a whole zip "
                                       rf".*\): is the disk failing\? The latest whole one: {re.escape(first)}$"):
        run.save_step(2, {})


def test_a_damaged_checkpoint_is_refused_before_vllm_starts(tmp_path):
    """From the command line: exit 1, one line, and nothing else started (no engine's log)."""
    checkpoint = fake_checkpoint(tmp_path / "run", 3)
    cut(distcp(checkpoint), 100)
    r = subprocess.run([sys.executable, "grpo.py", "--resume", checkpoint], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=300)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert re.fullmatch(rf"error: --resume '{re.escape(checkpoint)}' is damaged: optimizer/__0_0.distcp: truncated "
                        rf"\(100 bytes, an item needs \d+\); no earlier checkpoint of its run is whole\n", r.stderr), r.stderr


def test_resume_of_a_run_that_saved_no_checkpoint_says_so(tmp_path):
    run = tmp_path / "run"  # a run that ended (or died) before its first save: args.json, metrics, no checkpoints/
    run.mkdir()
    (run / "args.json").write_text(json.dumps(vars(grpo.Args(save_every=50))))
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    with pytest.raises(ConfigError, match=r"this run saved no checkpoint \(--save-every 50: every 50 steps and on "
                                          r"Ctrl-C or SIGTERM\), so there is nothing to resume"):
        parse_args(grpo.Args, ["--resume", str(run)])


# Rewards run in a pool of worker processes, so the count of evaluations lives in a file, not in a
# list that each worker would hold its own copy of.
FRAGILE_TASK = """
from pathlib import Path
from common.tasks import Task

def make_task():
    train = [{"prompt": f"sort {d}:", "answer": "".join(sorted(d))} for d in ("321", "54", "987", "6402")]
    evaluations = Path(__file__).with_suffix(".evaluations")

    def reward(completion, example):
        if example.get("held_out"):
            with evaluations.open("a") as f:
                f.write(".")
            if len(evaluations.read_text()) > 1:  # the start's evaluation passes, the next one fails
                raise ValueError("cannot read it")
        return float(completion.strip() == example["answer"])

    return Task("fragile", train, [{"prompt": "sort 531:", "answer": "135", "held_out": True}], reward)
"""


def test_a_verifier_failing_in_a_mid_run_evaluation_saves_the_step_first(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "fragile.py").write_text(FRAGILE_TASK)
    out = tmp_path / "run"
    args = parse_args(grpo.Args, ["--engine", "transformers", "--task", f"{tmp_path / 'fragile.py'}:make_task",
                                  "--steps", "3", "--eval-every", "1", "--save-every", "0", "--output-dir", str(out),
                                  *SMALL])
    with pytest.raises(RunError) as e:
        grpo.main(args)
    step_1 = out / "checkpoints" / "step_1"
    message = str(e.value)
    assert message.startswith("task 'fragile': reward function raised ValueError: cannot read it on completion '")
    assert message.endswith(f"(evaluating after step 1, which is saved: --resume {step_1})") and "\n" not in message
    assert (step_1 / "trainer_state.pt").is_file() and [m["step"] for m in read_metrics(out)] == [0, 1]


def test_main_refuses_a_mismatched_resume_too(tmp_path):
    """main() checks again, for callers that build Args themselves (without parse_args)."""
    ckpt = fake_checkpoint(tmp_path / "run", 3, prompts_per_step=8)
    with pytest.raises(ConfigError, match=r"--prompts-per-step 8 \(you asked for 32\)"):
        grpo.main(grpo.Args(resume=ckpt))


# ------------------------------------------------------------------ the output folder

def new_run(tmp_path, **flags) -> Run:
    run = Run(grpo.Args(output_dir=str(tmp_path / "run"), **flags))
    run.close()
    return run


def test_a_folder_holding_a_run_is_refused_and_overwrite_empties_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 4)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 4}\n')
    with pytest.raises(ConfigError, match="already holds a run .*resume it with --resume .*or pass --overwrite"):
        new_run(tmp_path)
    assert (run_dir / "checkpoints" / "step_4").is_dir()  # untouched
    run = new_run(tmp_path, overwrite=True)
    assert "--overwrite: emptying" in capsys.readouterr().out
    assert sorted(os.listdir(run.dir)) == ["args.json", "metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == ""


def test_a_run_that_died_while_starting_leaves_a_reusable_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "args.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.2}\n')
    assert new_run(tmp_path).dir == str(run_dir)


@pytest.mark.parametrize("make,message", [
    (lambda d: d.write_text("x"), "is a file, not a folder"),
    (lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine")), r"holds files that no run wrote \(notes.txt\)"),
])
def test_unusable_output_folders_are_one_line(tmp_path, make, message):
    make(tmp_path / "run")
    with pytest.raises(ConfigError, match=message):
        new_run(tmp_path, overwrite=True)


def test_an_unwritable_output_folder_is_one_line():
    with pytest.raises(ConfigError, match=r"--output-dir '/proc/rl-lm-test' is not usable"):
        Run(grpo.Args(output_dir="/proc/rl-lm-test"))


def test_default_run_folder_name_does_not_nest_a_task_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = Run(grpo.Args(task="jsonl:data/train.jsonl", seed=3))
    run.close()
    name = os.path.relpath(run.dir, tmp_path)
    assert name.startswith("runs/grpo__jsonl-data-train.jsonl__3__") and name.count("/") == 1


def test_a_running_run_holds_its_folder(tmp_path):
    """Two runs into one folder never mix it: while a run holds its folder's lock (flock: a second
    open of the lock file conflicts even in this one process), another run there is refused in one
    line naming the holder, be it new, --overwrite or --resume; once the holder ends it is free.
    The holder here has just started (args.json, step-0 metrics): what a run that died while
    starting leaves too, which is why the folder's content cannot tell the two apart."""
    run_dir = tmp_path / "run"
    first = Run(grpo.Args(output_dir=str(run_dir)))
    first.log(0, {"eval/accuracy": 0.5})
    holder = f"in use by another run \\(pid {os.getpid()} on {socket.gethostname()}\\)"
    for flags in ({}, {"overwrite": True}):
        with pytest.raises(ConfigError, match=holder):
            Run(grpo.Args(output_dir=str(run_dir), **flags))
    checkpoint = fake_checkpoint(run_dir, 1)  # as if the first run had saved one
    with pytest.raises(ConfigError, match=holder):
        Run(grpo.Args(resume=checkpoint))
    assert json.loads((run_dir / "metrics.jsonl").read_text()) == {"step": 0, "eval/accuracy": 0.5}  # untouched
    first.close()
    Run(grpo.Args(resume=checkpoint)).close()
    assert not [name for name in os.listdir(run_dir) if name.startswith(".")]  # the lock goes with its run


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
    """A run killed (SIGKILL: no cleanup) leaves its lock file, but the OS released its lock: the
    folder can be resumed (or reused) at once."""
    run_dir = tmp_path / "run"
    code = ("import os, sys, grpo; from common.run import Run; "
            "Run(grpo.Args(output_dir=sys.argv[1])); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (run_dir / LOCK_FILE).exists()
    fake_checkpoint(run_dir, 1)
    Run(grpo.Args(resume=str(run_dir))).close()
    new_run(tmp_path, overwrite=True)


def test_two_default_run_names_made_in_the_same_second_are_two_folders(tmp_path, monkeypatch):
    """The race of two runs started together: the other run made runs/NAME after this one looked
    for it (here: os.path.exists still says it is not there). Making the folder is what decides
    (os.mkdir fails on one that exists), so this run takes the next name, leaving the other's alone."""
    import common.run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common.run, "time", types.SimpleNamespace(time=lambda: 1.7e9, perf_counter=time.perf_counter))
    first = Run(grpo.Args())
    with monkeypatch.context() as m:
        m.setattr(os.path, "exists", lambda path: False)
        second = Run(grpo.Args())
    assert second.dir == first.dir + "_1"
    assert sorted(os.listdir(first.dir)) == sorted(os.listdir(second.dir))  # each its own args.json, metrics
    first.close()
    second.close()


@pytest.mark.parametrize("Args,field,value", [
    (grpo.Args, "model", "{run}/final"),
    (grpo.Args, "reward", ("{run}/checkpoints/step_4/score.py:score",)),  # FILE.py:FUNCTION
    (grpo.Args, "task", "jsonl:{run}/final/data.jsonl"),
    (ppo.Args, "critic_model", "run/checkpoints/step_4/policy"),  # relative to the working folder
])
def test_overwrite_refuses_to_empty_a_folder_holding_an_input_of_the_run(tmp_path, monkeypatch, Args, field, value):
    """--model runs/X/final --output-dir runs/X --overwrite would delete the model it is about to train:
    any flag whose value (or a part of it) is a path inside the folder is refused, in one line."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 4)
    for folder in ("final", "checkpoints/step_4/policy"):
        (run_dir / folder).mkdir(exist_ok=True)
    for file in ("final/data.jsonl", "checkpoints/step_4/score.py"):
        (run_dir / file).write_text("")
    value = tuple(v.format(run=run_dir) for v in value) if isinstance(value, tuple) else value.format(run=run_dir)
    flag = f"--{field.replace('_', '-')}"
    with pytest.raises(ConfigError, match=rf"^{flag} .* lies inside {run_dir}, which --overwrite would empty"):
        Run(Args(output_dir=str(run_dir), overwrite=True, **{field: value}))
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "final"]  # untouched


def later_saves(run_dir, steps=(1, 3), final_step=3) -> list[str]:
    """A run folder with fake checkpoints at steps, and final/ + summary.json made at final_step."""
    paths = [fake_checkpoint(run_dir, step, steps=final_step) for step in steps]
    (run_dir / "final").mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"steps": final_step}))
    return paths


def test_resume_in_place_from_an_earlier_checkpoint_keeps_later_saves_unless_asked(tmp_path, capsys):
    """One mistyped step number must not delete a final model: resuming a run in its own folder from
    before a later checkpoint or final/ is refused, naming them, unless --discard-later."""
    run_dir = tmp_path / "run"
    step_1, _ = later_saves(run_dir)
    with pytest.raises(ConfigError, match=r"^--resume .*step_1 would discard what the run saved after step 1 "
                                          r"\(checkpoints step_3, final/\): pass --discard-later to drop them, or "
                                          r"continue in a new folder with --output-dir"):
        Run(grpo.Args(resume=step_1, steps=3))
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "final", "summary.json"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_1", "step_3"]

    args = parse_args(grpo.Args, ["--resume", step_1, "--discard-later"])
    Run(args).close()
    assert "removing what the run wrote after step 1: final, step_3, summary.json" in capsys.readouterr().out
    assert sorted(os.listdir(run_dir)) == ["args.json", "checkpoints", "metrics.jsonl"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_1"]


def test_a_resume_restores_neither_overwrite_nor_discard_later(tmp_path):
    """What one command asked, not what defines the run: a run started with --overwrite resumes (it was
    refused: "--overwrite and --resume contradict each other"), and one resumed with --discard-later
    does not discard again at its next resume unless asked again."""
    checkpoint = fake_checkpoint(tmp_path / "run", 3, overwrite=True, discard_later=True)
    args = parse_args(grpo.Args, ["--resume", checkpoint])
    assert (args.overwrite, args.discard_later) == (False, False)


def test_an_ordinary_resume_needs_no_flag(tmp_path):
    """What a crash or Ctrl-C leaves after the latest checkpoint (metrics of a step not saved, a half
    written save) is dropped without asking, and a finished run whose final/ is its latest
    checkpoint's model may train on."""
    crashed = tmp_path / "crashed"
    fake_checkpoint(crashed, 2)
    (crashed / "checkpoints" / "step_3.tmp").mkdir()
    (crashed / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    Run(grpo.Args(resume=str(crashed))).close()
    assert [m["step"] for m in read_metrics(crashed)] == [0, 1, 2]
    assert sorted(os.listdir(crashed / "checkpoints")) == ["step_2"]

    finished = tmp_path / "finished"
    later_saves(finished)
    Run(grpo.Args(resume=str(finished), steps=5)).close()
    assert sorted(os.listdir(finished / "checkpoints")) == ["step_1", "step_3"]


# ------------------------------------------------------------------ saving

def test_a_full_disk_leaves_the_previous_checkpoint_and_says_so(tmp_path, tiny_policy, tokenizer, monkeypatch):
    run = Run(grpo.Args(output_dir=str(tmp_path / "run")))
    optimizer = torch.optim.AdamW(tiny_policy.parameters())
    first = run.save_checkpoint(2, {"policy": tiny_policy}, tokenizer, {}, optimizer)

    def half_then_full(obj, path, *a, **k):  # torch.save: to a file, or a buffer (the optimizer's shards)
        if isinstance(path, (str, os.PathLike)):
            open(path, "wb").write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(RunError, match=r"^no space left on .* while saving .*checkpoints/step_4$"):
        run.save_checkpoint(4, {"policy": tiny_policy}, tokenizer, {}, optimizer)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_2"]  # no step_4.tmp
    assert sorted(os.listdir(first)) == ["optimizer", "policy", "run.json", "trainer_state.pt"]

    # torch.save hides the errno ("iostream error"): a filesystem with no space left says it
    def iostream_error(obj, path, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . basic_ios::clear: iostream error")

    monkeypatch.setattr(torch, "save", iostream_error)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=0))
    with pytest.raises(RunError, match="no space left on"):
        run.save_checkpoint(4, {"policy": tiny_policy}, tokenizer, {}, optimizer)
    # the same error with space to spare is not called a full disk: it stays the error it is
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2**40))
    with pytest.raises(BaseException, match="iostream error") as error:  # as torch or its checkpoint writer says
        run.save_checkpoint(4, {"policy": tiny_policy}, tokenizer, {}, optimizer)
    assert not isinstance(error.value, RunError)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_2"]
    run.close()


def test_a_failed_final_save_leaves_no_final_model(tmp_path, tiny_policy, tokenizer, monkeypatch):
    run = Run(grpo.Args(output_dir=str(tmp_path / "run")))

    def config_then_full(path, *a, **k):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "config.json"), "w").write("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny_policy, "save_pretrained", config_then_full)
    with pytest.raises(RunError, match=r"no space left on .* while saving .*/final$"):
        run.finish(tiny_policy, tokenizer, {"eval/accuracy": 0.5})
    # no final/, no final.tmp; the lock file stays while the run (here, its process) goes on
    assert sorted(os.listdir(tmp_path / "run")) == sorted(["args.json", "metrics.jsonl", LOCK_FILE])


# ------------------------------------------------------------------ whole runs, in this process

def test_resume_continues_the_run_and_carries_its_start(tmp_path, run_main, capsys, monkeypatch):
    """Three steps saved every step; resuming from step 1 with --discard-later abandons steps 2-3
    (checkpoints, final model, summary), continues with the saved batch shape, and summary.json still
    knows the run's true start accuracy and its whole wall time."""
    out = tmp_path / "run"
    run_main("grpo.py", "--steps", "3", "--save-every", "1", "--eval-every", "0", "--output-dir", out, *SMALL)
    first = json.loads((out / "summary.json").read_text())
    step_1 = out / "checkpoints" / "step_1"
    saved_wall_time = json.loads((step_1 / "run.json").read_text())["wall_time_s"]

    # the restarted policy is the checkpoint's: what its first weight sync (right after loading) sees
    from safetensors.torch import load_file

    synced = []

    def sync_weights(llm, model):
        synced.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real_sync(llm, model)

    real_sync = grpo.sync_weights
    monkeypatch.setattr(grpo, "sync_weights", sync_weights)
    args = run_main("grpo.py", "--resume", step_1, "--steps", "2", "--discard-later")
    assert (args.prompts_per_step, args.micro_batch_size) == (4, 3)  # SMALL, not the defaults
    saved = load_file(step_1 / "policy" / "model.safetensors")
    restarted = {k: v for k, v in synced[0].items() if k in saved}
    assert len(restarted) == len(saved) > 0
    assert all(torch.equal(restarted[k], saved[k]) for k in saved)
    assert not all(torch.equal(synced[-1][k], saved[k]) for k in saved)  # and it trained on from there
    printed = capsys.readouterr().out
    assert "resume: --steps 3 -> 2" in printed
    assert "removing what the run wrote after step 1: curves.png, final, step_2, step_3, summary.json" in printed
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/accuracy_start"] == first["eval/accuracy_start"] == metrics[0]["eval/accuracy"]
    assert summary["wall_time_s"] > saved_wall_time
    assert f"held-out accuracy {metrics[0]['eval/accuracy']:.3f} -> " in printed
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]
    assert json.loads((out / "args.json").read_text())["steps"] == 2
    assert (out / "curves.png").exists()  # removed with what the run wrote after step 1, then drawn again


def test_resume_restores_the_algorithms_own_state(tmp_path, run_main):
    """An algorithm's state beyond the optimizer (REINFORCE's moving-average baseline) goes into the
    checkpoint and comes back: step 2's baseline is step 1's carried state (the moving average uses
    past batches only), so the resumed step 2 logs the uninterrupted run's value, not its own batch mean."""
    flags = ["--baseline", "moving-average", "--prompts-per-step", "4", "--completions-per-prompt", "4",
             "--micro-batch-size", "8", "--max-new-tokens", "10", "--eval-every", "0"]
    out = tmp_path / "run"
    run_main("reinforce.py", "--steps", "2", "--save-every", "1", "--output-dir", out, *flags)
    again = tmp_path / "again"
    run_main("reinforce.py", "--resume", out / "checkpoints" / "step_1", "--output-dir", again)
    first, resumed = read_metrics(out)[2], read_metrics(again)[0]
    assert resumed["step"] == 2
    assert resumed["reward/baseline"] == pytest.approx(first["reward/baseline"], rel=1e-6)
    assert resumed["reward/baseline"] != pytest.approx(resumed["reward/mean"])  # not this batch's own mean


def shown_lines(console: str) -> list[str]:
    """What a terminal shows of stdout and stderr written in turn: each line's text after its last
    carriage return (the progress bar redraws itself after one)."""
    return [line.rsplit("\r", 1)[-1] for line in console.split("\n")]


def test_sigint_in_process_saves_and_exits_130(tmp_path, run_main, monkeypatch):
    """The first Ctrl-C finishes the step, saves, and exits 130 (not 0: the run did not finish).
    What it says is on lines of their own, not glued to the progress bar, which ends at the step
    saved."""
    from common.engine import sync_weights

    syncs = []

    def sync_and_interrupt(llm, policy):
        sync_weights(llm, policy)
        syncs.append(1)
        if len(syncs) == 3:  # the initial sync, then one per step: Ctrl-C arrives during step 2
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(grpo, "sync_weights", sync_and_interrupt)
    out = tmp_path / "run"
    console = io.StringIO()  # stdout and stderr in one stream, in the order a terminal gets them
    with pytest.raises(SystemExit) as exit_info, redirect_stdout(console), redirect_stderr(console):
        run_main("grpo.py", "--steps", "100", "--save-every", "0", "--output-dir", out, *SMALL)
    assert exit_info.value.code == 130
    assert os.listdir(out / "checkpoints") == ["step_2"]
    lines = shown_lines(console.getvalue())
    assert "Ctrl-C: finishing this step, then saving a checkpoint (again to abort)" in lines
    saved = [i for i, line in enumerate(lines) if "saved checkpoint" in line]
    assert len(saved) == 1 and lines[saved[0]].startswith("saved checkpoint"), lines[saved[0]]
    assert "| 2/100 [" in lines[saved[0] - 1], lines[saved[0] - 1]  # the bar, ended at the step saved
    assert read_metrics(out)[-1]["step"] == 2 and not (out / "final").exists()
    assert (out / "curves.png").stat().st_size > 0  # the picture of the run so far
    # stopped in its last step, a run resumes with nothing left to train: --steps equal to the checkpoint's
    # step is allowed, and writes the final model and summary
    run_main("grpo.py", "--resume", out, "--steps", "2")
    assert (out / "final").is_dir() and json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_leaves_no_half_checkpoint(tmp_path, run_main,
                                                                                  monkeypatch):
    """Ctrl-C during step 2 (saved every step) asks for its checkpoint; a second Ctrl-C while that
    checkpoint is half written stops at once, through cli as `python grpo.py` runs: exit 130, no
    traceback, the half checkpoint gone, and one line naming the last complete one."""
    import torch.distributed.checkpoint as dcp

    from common.engine import sync_weights

    monkeypatch.setattr(common.interrupt, "SAME_REQUEST_S", 0.0)  # as if seconds had passed since the first
    syncs, saves, dcp_save = [], [], dcp.save

    def sync_and_interrupt(llm, policy):
        sync_weights(llm, policy)
        syncs.append(1)
        if len(syncs) == 3:  # the initial sync, then one per step: during step 2
            os.kill(os.getpid(), signal.SIGINT)

    def save_and_interrupt(*args, **kwargs):  # the optimizer's part of a checkpoint, written first
        dcp_save(*args, **kwargs)
        saves.append(kwargs["checkpoint_id"])
        if len(saves) == 2:  # step 2's checkpoint, half written
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(grpo, "sync_weights", sync_and_interrupt)
    monkeypatch.setattr(dcp, "save", save_and_interrupt)
    out = tmp_path / "run"
    flags = ["--steps", "100", "--save-every", "1", "--output-dir", str(out), *SMALL]
    console = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, redirect_stdout(console), redirect_stderr(console):
        cli(lambda args: run_main("grpo.py", *flags), grpo.Args, flags)
    assert exit_info.value.code == 130
    assert saves[1] == str(out / "checkpoints" / "step_2.tmp" / "optimizer")  # written, then
    assert os.listdir(out / "checkpoints") == ["step_1"]  # removed: no step_2, no step_2.tmp
    assert "Traceback" not in console.getvalue()
    lines = [line for line in shown_lines(console.getvalue()) if line.startswith("Ctrl-C")]
    assert lines == ["Ctrl-C: finishing this step, then saving a checkpoint (again to abort)",
                     f"Ctrl-C: stopped; continue from the last checkpoint with --resume {out}/checkpoints/step_1"]
    assert shown_lines(console.getvalue())[-2:] == [lines[-1], ""]  # the last line, of its own


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_the_training_loop_is_one_line(tmp_path, signum):
    """Ctrl-C or SIGTERM while the run starts (args.json is written, then vLLM starts, the policy
    loads and the first evaluation runs): one line and exit 130 or 143, no traceback."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "grpo.py"), "--steps", "1", "--output-dir", str(out),
                             *SMALL], cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath()},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (out / "args.json").exists():  # the run folder is made first: start-up has begun
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "no start"
        time.sleep(0.05)
    proc.send_signal(signum)
    output = proc.communicate(timeout=300)[0]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert proc.returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output and output.strip().splitlines()[-1] == f"{name}: stopped; no checkpoint was saved"


def wait_for_steps(proc, run_dir, steps: int, timeout_s: int = 600) -> None:
    """Until metrics.jsonl has `steps` trained steps (a safety timeout only)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if read_metrics(run_dir)[-1]["step"] >= steps:
                return
        except (OSError, IndexError, ValueError):  # not written yet, or a line half written
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "no progress"
        time.sleep(0.5)


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    """What schedulers and `timeout` send: handled like the first Ctrl-C (a real signal to a
    real process; waits for steps in metrics.jsonl, not for a time)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, str(ROOT / "grpo.py"), "--steps", "1000", "--save-every", "0",
                             "--output-dir", str(out), *SMALL], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, output[-3000:]
    checkpoints = list((out / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.pt").exists()
    assert "SIGTERM: finishing this step" in output and f"--resume {checkpoints[0]}" in output
    assert read_metrics(out)[-1]["step"] == int(checkpoints[0].name.removeprefix("step_"))
    # the script re-ran itself with tcmalloc where it is installed (common/allocator.py): the signal still reached it
    assert json.loads((out / "args.json").read_text())["allocator"] == ("tcmalloc" if tcmalloc_path() else
                                                                         "system")


# ------------------------------------------------------------------ offline

@pytest.fixture()
def hub_unreachable(monkeypatch):
    """The hub's TCP port refuses, whatever this machine's network is; restored after."""
    from huggingface_hub import constants

    from common import hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    monkeypatch.setattr(hub.socket, "create_connection", refuse)
    hub.hub_reachable.cache_clear()
    yield
    hub.hub_reachable.cache_clear()


def test_an_unreachable_hub_is_said_at_once(hub_unreachable):
    from common.models import check_model
    from common.tasks import load_task

    with pytest.raises(ConfigError, match="'no-such-org/no-such-model' is not a local folder, and the Hugging Face "
                                          "hub is unreachable from here"):
        check_model("no-such-org/no-such-model")
    with pytest.raises(ConfigError, match="gsm8k: cannot load 'openai/gsm8k' .*hub is unreachable from here"):
        load_task("gsm8k")
    assert check_model(TINY_MODEL).model_type == "qwen2"  # local folders need no hub


def test_each_rank_seeds_and_resumes_its_own_generators(monkeypatch):
    """Rank 0 seeds as one process always did, rank 1 otherwise (and not as the run with seed + 1);
    a checkpoint's list of every rank's states restores this rank's, an older checkpoint's single
    state rank 0's, and a rank the saved run did not have keeps its own."""
    from common import dist, run

    run.seed_everything(3)
    alone = torch.rand(4)
    run.seed_everything(3, 0)
    assert torch.equal(torch.rand(4), alone)
    run.seed_everything(3, 1)
    rank_1 = torch.rand(4)
    run.seed_everything(4)
    assert not torch.equal(rank_1, alone) and not torch.equal(rank_1, torch.rand(4))
    states = []
    for rank in (0, 1):
        run.seed_everything(3, rank)
        states.append(run.rng_state())
    for rank, saved, expected in ((1, states, rank_1), (0, states[0], alone)):  # list of ranks' / older: rank 0's
        monkeypatch.setattr(dist, "rank", lambda: rank)
        run.set_rng_states(saved)
        assert torch.equal(torch.rand(4), expected)
    run.seed_everything(3, 2)
    own = torch.rand(4)
    monkeypatch.setattr(dist, "rank", lambda: 2)
    run.seed_everything(3, 2)
    run.set_rng_states(states)  # none of rank 2's: its own seeding stays
    assert torch.equal(torch.rand(4), own)


def test_metrics_over_ranks_average_the_means_and_sum_the_counts(monkeypatch):
    """Under torchrun a step's metrics are the whole batch's: a mean is the ranks' average, a count of
    timeouts (reward calls, environment steps) or of environment calls their sum (3 and 3 calls past the
    limit are 6, not 3); a mean of calls (env/tool_calls_mean) is a mean."""
    from common import dist

    ranks = [{"reward/mean": 0.25, "reward/timeouts": 3.0, "env/timeouts": 1.0, "env/calls": 4.0,
              "env/tool_calls_mean": 1.0},
             {"reward/mean": 0.75, "reward/timeouts": 3.0, "env/timeouts": 0.0, "env/calls": 2.0,
              "env/tool_calls_mean": 0.0}]
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_sum", lambda x: sum(torch.tensor([r[k] for k in sorted(r)], dtype=torch.float64)
                                                        for r in ranks))  # what the two ranks' reduction gives
    assert dist.mean_over_ranks(ranks[0]) == {"reward/mean": 0.5, "reward/timeouts": 6.0, "env/timeouts": 1.0,
                                              "env/calls": 6.0, "env/tool_calls_mean": 0.5}


def test_a_resume_drops_a_metrics_line_a_crash_cut_short(tmp_path):
    """A crash while a line of metrics.jsonl was being written leaves half of it: the resumed run keeps
    the whole lines up to its checkpoint and drops that one (json.loads of it raised before)."""
    from common.run import open_until

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.6}\n{"step": 3, "rew')
    open_until(path, 2).close()
    assert path.read_text() == '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.6}\n'
