"""The run folder, belonging to no algorithm: args.json, metrics.jsonl, completions.jsonl,
checkpoints (the optimizer state sharded with torch.distributed.checkpoint, written by every
rank, in the same layout for one process and for N), final/ and summary.json, written by
rank 0 under torchrun; and the seeding and RNG state a checkpoint carries."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import random
import re
import shutil
import socket
import sys
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common import dist
from common.args import (check_resume, checkpoint_damage, find_checkpoint, forks, latest_checkpoint, read_run_info,
                         run_folder_of, script_name)
from common.allocator import allocator
from common.curves import write_curves
from common.engine import evaluate
from common.interrupt import GracefulInterrupt
from common.errors import ConfigError, RunError, need
from common.guard import SyncGuard, check_finite_weights, env_stalled
from common.models import is_lora, merged_state_dict, save_model

# torch.distributed.checkpoint warns that a save or load without a process group is one process's: as meant
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)


def seed_everything(seed: int, rank: int = 0) -> None:
    """Python's, NumPy's and torch's global generators, each rank's its own (rank_seed). vLLM samples with
    torch's global generator: ranks seeded alike would draw the same noise, and two ranks given the same
    prompt would sample the same completions."""
    seed = rank_seed(seed, rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Rank 0's seed is the run's (one process seeds as it always did); rank r's is drawn from (seed, r),
    not seed + r, which would be rank 0's of the run with seed + r. Below 2**32, as NumPy takes it."""
    return seed if rank == 0 else random.Random(f"{seed}:{rank}").getrandbits(32)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's GPU only: resumable on any number of GPUs
    if mps_rng():
        state["mps"] = torch.mps.get_rng_state()  # an Apple GPU's generator (dropout, sampling there)
    return state


def mps_rng() -> bool:
    """An Apple GPU whose generator torch can save and restore (torch.mps.get_rng_state)."""
    return torch.backends.mps.is_available() and hasattr(torch.mps, "get_rng_state")


def rng_states() -> list[dict]:
    """Every rank's rng_state(), in rank order (every rank calls it)."""
    return dist.all_gather_objects([rng_state()])


def set_rng_states(states: list[dict] | dict) -> None:
    """This rank's state of rng_states() (a checkpoint's); one a rank the saved run did not have keeps its own
    seeding. An older checkpoint holds rank 0's alone (a dict), which rank 0 takes."""
    states = [states] if isinstance(states, dict) else states
    if dist.rank() < len(states):
        set_rng_state(states[dist.rank()])


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") if torch.cuda.is_available() else None
    if isinstance(cuda, list):  # an older checkpoint's get_rng_state_all(): one state per visible GPU
        i = torch.cuda.current_device()
        cuda = cuda[i] if i < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)  # this process's GPU
    if state.get("mps") is not None and mps_rng():
        torch.mps.set_rng_state(state["mps"])


# ---------------------------------------------------------------------------------------
# the run folder
# ---------------------------------------------------------------------------------------

RUN_FILES = ("args.json", "metrics.jsonl", "completions.jsonl", "checkpoints", "final", "summary.json", "curves.png")
LOCK_FILE = ".lock"  # a running run's lock on its folder (lock_folder): no run's progress, never emptied


class Run:
    """The run folder, checked before anything heavy starts:

        args.json  metrics.jsonl  completions.jsonl  checkpoints/step_N/  final/  summary.json  curves.png

    A new run needs a new or empty folder (--overwrite empties an earlier run's folder). A
    resumed run continues in its checkpoint's folder, from that checkpoint's step, and drops
    what the abandoned continuation wrote after it; with another --output-dir it continues
    in that (new or empty) folder instead and leaves the original alone. Start accuracy and
    wall time are carried across resumes, so summary.json describes the whole run. The run
    holds its folder's lock (LOCK_FILE) until close(): no other run starts, empties or resumes
    there meanwhile."""

    def __init__(self, args):
        self.args, self.script = args, script_name(type(args))
        self.t_start = time.perf_counter()
        self.lock = None  # rank 0's, once it has the folder
        try:
            # rank 0 checks and writes the folder; the others learn where it is (or its error)
            self.dir, self.start_step, self.accuracy_start, self.wall_time_before = dist.on_main(self._open, args)
            args.output_dir = self.dir  # args.json and checkpoints record where the run lives
            check_shared_folder(self.dir)  # every rank writes its checkpoint shard into it
        except BaseException:
            self.unlock()  # a run refused at its start leaves no lock file behind
            raise
        args.resume = dist.broadcast(args.resume)  # rank 0's checkpoint, whatever another node's working folder
        self.launch = {"world_size": dist.processes(), "device": dist.pick_device(args.device),
                       "allocator": allocator()}
        self.logger = MetricsLogger(self.dir, args, self.start_step, args.tensorboard, args.track, args.wandb_project,
                                    self.launch) if dist.is_main() else None

    def _open(self, args):
        if not args.resume:
            return self._new_folder(args), 0, None, 0.0
        args.resume = find_checkpoint(args.resume)
        check_resume(args)
        info = read_run_info(args.resume)
        if forks(args):  # a new folder, whose metrics start after the checkpoint's step
            folder = self._new_folder(args)
            print(f"resume: continuing {args.resume} in a new run folder, {folder}")
        else:
            folder = run_folder_of(args.resume)
            self.lock = lock_folder(folder)
            self._drop_after(folder, info["step"], args.discard_later)
        return folder, info["step"], info["accuracy_start"], info["wall_time_s"]

    def _new_folder(self, args) -> str:
        path = default_folder(args) if args.output_dir is None else os.path.abspath(os.path.expanduser(args.output_dir))
        need(not os.path.exists(path) or os.path.isdir(path), f"--output-dir {path!r} is a file, not a folder")
        entries = os.listdir(path) if os.path.isdir(path) else []
        foreign = sorted(e for e in set(entries) - set(RUN_FILES) - {LOCK_FILE, "tensorboard", "wandb"}
                         if not e.startswith(SHARED_MARKER))  # one a killed start left
        need(not foreign, f"--output-dir {path!r} holds files that no run wrote ({', '.join(foreign[:4])}): "
                          f"choose a new or empty folder")
        try:  # a folder we cannot write to fails here, in one line, not at the first metric
            os.makedirs(path, exist_ok=True)
            self.lock = lock_folder(path)  # from here on no other run writes there: look again
            entries = [e for e in os.listdir(path) if e != LOCK_FILE]
            if holds_progress(path):
                need(args.overwrite, f"--output-dir {path!r} already holds a run ({', '.join(sorted(entries))}): "
                                     f"resume it with --resume {path}, choose another folder, or pass --overwrite "
                                     f"to replace it")
                inside = inputs_inside(args, path)
                need(not inside, f"{'; '.join(inside)} lies inside {path}, which --overwrite would empty: move it "
                                 f"out first, or choose another --output-dir")
                print(f"--overwrite: emptying {path}")
            for entry in entries:  # an earlier run's (--overwrite), or one that died before its first step
                full = os.path.join(path, entry)
                shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.remove(full)
            probe = os.path.join(path, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--output-dir {path!r} is not usable: {e.strerror or e}") from None
        return path

    @staticmethod
    def _drop_after(folder: str, step: int, discard_later: bool) -> None:
        """Resuming in place abandons what the run wrote after the checkpoint: what a crash or
        Ctrl-C left (half-written saves; metrics, see open_until) at once, but later checkpoints
        or a later final model only with --discard-later (a mistyped step must not delete them)."""
        later = [p for p in Path(folder, "checkpoints").glob("step_*")
                 if not p.name[5:].isdigit() or int(p.name[5:]) > step]
        for name in ("final", "final.tmp", "summary.json", "curves.png"):
            if os.path.exists(os.path.join(folder, name)):
                later.append(Path(folder, name))
        later_steps = sorted(int(p.name[5:]) for p in later if p.name[5:].isdigit())
        lost = [f"checkpoints {', '.join(f'step_{s}' for s in later_steps)}"] if later_steps else []
        if os.path.isdir(os.path.join(folder, "final")) and final_step(folder) != step:  # else the checkpoint's model
            lost.append("final/")
        need(not lost or discard_later,
             f"--resume {os.path.join(folder, 'checkpoints', f'step_{step}')} would discard what the run saved "
             f"after step {step} ({', '.join(lost)}): pass --discard-later to drop them, or continue in a new "
             f"folder with --output-dir NEW (this one stays as it is)")
        if later:
            print(f"resume: removing what the run wrote after step {step}: {', '.join(sorted(p.name for p in later))}")
        for p in later:
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def log(self, step: int, metrics: dict) -> None:
        if step == 0 and "eval/accuracy" in metrics:
            self.accuracy_start = float(metrics["eval/accuracy"])
        if self.logger is not None:  # rank 0
            self.logger.log(step, metrics)

    def log_completions(self, step: int, prompts: list[str], completions: list[str], rewards, reward_parts: dict,
                        advantages) -> None:
        """The first --log-completions completions of the step (the G of the first prompt, then
        the next prompt's) as records of completions.jsonl: prompt, completion, reward, each
        reward term and the advantage (per-token advantages: the first token's)."""
        n = min(self.args.log_completions, len(completions))
        if n == 0 or self.logger is None:  # rank 0's share: the batch's first prompts
            return
        G = len(completions) // len(prompts)
        advantages = advantages if advantages.dim() == 1 else advantages[:, 0]
        records = [{"step": step, "prompt": prompts[i // G], "completion": completions[i],
                    "reward": float(rewards[i]), **{f"reward/{k}": float(v[i]) for k, v in reward_parts.items()},
                    "advantage": float(advantages[i])} for i in range(n)]
        self.logger.log_completions(step, records)

    def start(self, llm, tokenizer, task, episodes=None) -> None:
        """Says what runs where, and evaluates the starting policy on the held-out split (step 0
        of a new run's metrics). The engine, tokenizer and task are kept for the evaluations;
        episodes: a multi-turn script's rollout, which they use (common/engine.py evaluate)."""
        self.llm, self.tokenizer, self.task, self.episodes = llm, tokenizer, task, episodes
        a = self.args
        self.sync_guard = SyncGuard.of(a, llm)  # end_step stops a run whose engine no longer samples the policy
        if getattr(a, "engine_choice", None):  # --engine auto: which one, and why (common/setup.py choose_engine)
            print(a.engine_choice)
        print(f"{a.exp_name}: {a.model} on {a.task} ({self.launch['device']}, {a.engine} rollouts), {a.steps} "
              f"steps of {a.prompts_per_step} prompts x {a.completions_per_prompt} completions -> {self.dir}")
        self.eval_metrics = self.evaluate()
        if self.start_step == 0:
            self.log(0, self.eval_metrics)
        stalled = env_stalled(a, self.eval_metrics, "evaluating the starting policy")
        if stalled:
            raise RunError(f"{stalled}; stopped before step {self.start_step + 1}")
        if self.engine_calls is not None:  # the transformers engine seeds each sample by its call count:
            llm.calls = self.engine_calls  # a resumed run samples what the uninterrupted run sampled

    def evaluate(self) -> dict:
        """Greedy held-out accuracy and reward (rank 0's, on every rank), prompts as in training."""
        a = self.args
        return evaluate(self.llm, self.tokenizer, self.task, a.max_new_tokens, a.chat_template, a.system_prompt,
                        a.reward_timeout, self.episodes)

    def restore(self, models: dict, optimizer, scheduler, prompt_sampler) -> dict:
        """Keeps what a checkpoint holds (models by name, the optimizer, the learning-rate schedule,
        the prompt sampler) and, on --resume, loads the checkpoint's state into them (the models
        load from its folders themselves). Returns the checkpoint's trainer state, whose entries
        include the algorithm's own (end_step's keyword arguments); {} for a new run."""
        self.saved = models, optimizer, scheduler, prompt_sampler
        self.engine_calls = None
        if not self.args.resume:
            return {}
        state = self.load_checkpoint(models, optimizer)
        self.engine_calls = state.get("engine_calls")
        scheduler.load_state_dict(state["scheduler"])
        prompt_sampler.set_state(state["prompt_sampler"])
        return state

    def steps(self):
        """for step in run.steps(): the steps left, under a progress bar (rank 0), with Ctrl-C and
        SIGTERM caught: the first one lets the step finish, and end_step saves and exits."""
        a = self.args
        # end_step moves the bar: it shows the steps ended, also the one a stop saves
        self.progress = tqdm(initial=self.start_step, total=a.steps, desc=a.exp_name, disable=not dist.is_main())
        with self.progress, GracefulInterrupt() as self.interrupt:
            yield from range(self.start_step, a.steps)

    def end_step(self, step: int, metrics: dict, **algorithm_state) -> None:
        """After step `step`: the metrics averaged over ranks, the held-out evaluation when due
        (--eval-every, and the last step), the logs and the progress bar; then a checkpoint when
        due (--save-every) or when Ctrl-C / SIGTERM asked to stop (algorithm_state goes into it),
        and in that case the exit (130, 143: not a finished run). --max-unsynced-steps steps in a
        row whose engine did not sample from the policy (common/guard.py SyncGuard), or a step or
        evaluation whose environment answered none of its calls (env_stalled), are a RunError, after
        a checkpoint."""
        a = self.args
        metrics = dist.mean_over_ranks(metrics)
        unsynced = self.sync_guard.check(float(metrics["rollout/logprob_mismatch"]))
        if (a.eval_every and step % a.eval_every == 0) or step == a.steps:
            try:
                self.eval_metrics = self.evaluate()
            except RunError as e:  # the task's reward failed on a held-out completion: the step is kept first
                self.log(step, metrics)
                path = self.save_step(step, algorithm_state)
                raise RunError(f"{e} (evaluating after step {step}, which is saved: --resume {path})") from None
            metrics.update(self.eval_metrics)
        self.log(step, metrics)
        self.progress.n = step
        self.progress.set_postfix(reward=f"{float(metrics['reward/mean']):.3f}",
                                  eval_acc=f"{self.eval_metrics['eval/accuracy']:.3f}",
                                  kl=f"{float(metrics.get('kl/ref', 0.0)):.4f}")
        stalled = env_stalled(a, metrics, f"in step {step}") or \
            env_stalled(a, metrics, f"evaluating after step {step}")
        if unsynced or stalled:  # the step is kept: resuming it with a fixed sync or environment loses nothing
            path = self.save_step(step, algorithm_state)
            raise RunError(f"{unsynced or stalled}; stopped after step {step}, saved: --resume {path}")
        stop = self.interrupt.stop()  # under torchrun every rank stops after the same step
        if (a.save_every and step % a.save_every == 0) or stop:
            path = self.save_step(step, algorithm_state)
            if stop:
                self.progress.close()  # its line ends before this one
                print(f"saved checkpoint {path}; continue with --resume {path}")
                self.close()
                sys.exit(self.interrupt.exit_code)

    def save_step(self, step: int, algorithm_state: dict) -> str:
        """checkpoints/step_N of what restore() keeps, and algorithm_state; returns its path, once it
        reads back whole (common/checkpoints.py): no line recommends resuming from a damaged one."""
        models, optimizer, scheduler, prompt_sampler = self.saved
        state = {"scheduler": scheduler.state_dict(), "prompt_sampler": prompt_sampler.get_state(),
                 "engine_calls": getattr(self.llm, "calls", None), **algorithm_state}
        path = self.save_checkpoint(step, models, self.tokenizer, state, optimizer)
        why = dist.on_main(checkpoint_damage, path)
        if why:
            raise RunError(f"checkpoint {path} reads back damaged ({why}): is the disk failing? The latest whole "
                           f"one: {latest_checkpoint(self.dir, before=step) or 'none'}")
        return path

    def say(self, message: str) -> None:
        """One line on stderr, of its own above the progress bar; rank 0's (the ranks decide alike)."""
        if dist.is_main():
            tqdm.write(message, file=sys.stderr)

    def wall_time(self) -> float:
        return self.wall_time_before + time.perf_counter() - self.t_start

    def save_checkpoint(self, step: int, models: dict, tokenizer, state: dict, optimizer) -> str:
        """checkpoints/step_N: each model in models (e.g. {"policy": policy}) as a save_pretrained
        folder, optimizer/ (the optimizer's state, written by every rank, each its own shard:
        torch.distributed.checkpoint), trainer_state.pt (step, scheduler, each rank's RNG, ...) and run.json
        (script, arguments, step, start accuracy, wall time, world size). Written atomically."""
        from torch.distributed.checkpoint import save as dcp_save

        path = os.path.join(self.dir, "checkpoints", f"step_{step}")
        info = {"script": self.script, "step": step, "accuracy_start": self.accuracy_start,
                "wall_time_s": self.wall_time(), **self.launch, "args": dataclasses.asdict(self.args)}
        weights = {name: dist.full_state_dict(model) for name, model in models.items()}  # whole on rank 0
        dist.on_main(check_finite_weights, models, weights, f"checkpoint {path}")  # every rank stops alike
        optimizer_state = {"optimizer": dist.optimizer_state_dict(models, optimizer)}
        rng = rng_states()  # each rank's generators, resumed by that rank
        with atomic_folder(path) if dist.is_main() else contextlib.nullcontext(path + ".tmp") as tmp:
            dist.barrier()  # rank 0 made the folder
            dcp_save(optimizer_state, checkpoint_id=os.path.join(tmp, "optimizer"))  # every rank writes its shard
            if dist.is_main():
                for name, model in models.items():
                    model.save_pretrained(os.path.join(tmp, name), state_dict=weights[name])
                    tokenizer.save_pretrained(os.path.join(tmp, name))
                torch.save({**state, "step": step, "rng": rng}, os.path.join(tmp, "trainer_state.pt"))
                write_json(os.path.join(tmp, "run.json"), info)
        dist.barrier()  # the checkpoint is complete for every rank
        return path

    def load_checkpoint(self, models: dict, optimizer) -> dict:
        """The resumed checkpoint's optimizer state into optimizer (resharded to this run's
        world size), and its trainer state (models load from its folders); restores RNG."""
        from torch.distributed.checkpoint import load as dcp_load

        state = torch.load(os.path.join(self.args.resume, "trainer_state.pt"), weights_only=False)
        set_rng_states(state["rng"])
        optimizer_state = {"optimizer": dist.optimizer_state_dict(models, optimizer)}
        dcp_load(optimizer_state, checkpoint_id=os.path.join(self.args.resume, "optimizer"))
        dist.load_optimizer_state_dict(models, optimizer, optimizer_state["optimizer"])
        return state

    def finish(self, model, tokenizer, eval_metrics: dict) -> None:
        """final/ (a model folder, merged under LoRA, written atomically) and summary.json."""
        final_dir = os.path.join(self.dir, "final")
        weights = dist.full_state_dict(model)  # every rank takes part; whole on rank 0
        dist.on_main(check_finite_weights, {"policy": model}, {"policy": weights}, final_dir)  # every rank stops alike
        # LoRA under FSDP: the merged weights gathered a tensor at a time (a sharded model cannot merge in place)
        merged = merged_state_dict(model) if is_lora(model) and dist.world_size() > 1 else None
        if dist.is_main():
            with atomic_folder(final_dir) as tmp:
                save_model(model, tokenizer, tmp, weights, merged)
            summary = {"eval/accuracy_start": self.accuracy_start, "eval/accuracy_end": eval_metrics["eval/accuracy"],
                       "steps": self.args.steps, "wall_time_s": self.wall_time(), **self.launch}
            write_json(os.path.join(self.dir, "summary.json"), summary)
        self.close()
        start = "n/a" if self.accuracy_start is None else f"{self.accuracy_start:.3f}"
        print(f"done: held-out accuracy {start} -> {eval_metrics['eval/accuracy']:.3f}; final model in {final_dir}")

    def close(self) -> None:
        """Closes the logs, draws curves.png from metrics.jsonl (at the end and on Ctrl-C) and
        releases the folder."""
        if self.logger is not None:
            self.logger.close()
            write_curves(self.dir)
        self.unlock()

    def unlock(self) -> None:
        if self.lock is not None:
            os.remove(self.lock.name)  # while locked: a run waiting on this file retries (lock_folder)
            self.lock.close()
            self.lock = None


SHARED_MARKER = ".rank0-made-this-"


def check_shared_folder(path: str) -> None:
    """Under torchrun, that every rank sees the run folder rank 0 opened: each writes its shard of
    the optimizer's state there, so across nodes it must be on a filesystem they all share. Rank 0
    leaves a marker file of a fresh name there, every rank looks for it, and every rank raises the
    same RunError when one does not see it: one line, before anything heavy (not a checkpoint
    without some ranks' shards, a traceback or a hang later)."""
    if dist.world_size() == 1:
        return

    def write_marker():
        marker = os.path.join(path, SHARED_MARKER + uuid.uuid4().hex[:12])  # no earlier run's
        try:
            open(marker, "w").close()
        except OSError as e:
            raise RunError(f"cannot write to the run folder {path}: {e.strerror or e}") from None
        return marker

    marker = dist.on_main(write_marker)
    views = dist.all_gather_objects([(os.path.isfile(marker), socket.gethostname())])  # every rank has looked
    if dist.is_main():
        os.remove(marker)
    blind = [f"rank {r} (on {host})" for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        raise RunError(f"{', '.join(blind)} cannot see the run folder {path} that rank 0 (on {views[0][1]}) "
                       f"made: every rank writes its checkpoint shard there, so put --output-dir on a "
                       f"filesystem that every node shares")


def default_folder(args) -> str:
    """runs/EXP_NAME__TASK__SEED__TIME, made here: os.mkdir fails on a folder that exists, so of two
    runs started in the same second each makes its own (the second one's name ends in _1)."""
    task = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.task).strip("-")  # jsonl:PATH must not nest folders
    base = os.path.abspath(os.path.join("runs", f"{args.exp_name}__{task}__{args.seed}__{int(time.time())}"))
    path, n = base, 1
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
        while True:
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                path, n = f"{base}_{n}", n + 1
    except OSError as e:
        raise ConfigError(f"cannot make the run folder {path!r}: {e.strerror or e}; give --output-dir") from None


def lock_folder(path: str):
    """Locks the run folder path for this process: an exclusive flock on path/LOCK_FILE, which says
    who holds it (pid, host). Released by Run.unlock, or by the OS when the process ends however it
    ends, so a crashed run's folder is free at once. Another process's lock is one line."""
    lock_path = os.path.join(path, LOCK_FILE)
    while True:
        lock = open(lock_path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "starting"
            lock.close()
            raise ConfigError(f"the run folder {path} is in use by another run ({holder}): wait for it to end, or "
                              f"choose another --output-dir") from None
        try:  # the file its holder removed while releasing it (Run.unlock) locks nothing: open it again
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(lock_path)):
                break
        except FileNotFoundError:
            pass
        lock.close()
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def inputs_inside(args, folder: str) -> list[str]:
    """The flags, any of them (models, task and reward files, the checkpoint), whose value or a part
    of it (FILE.py:FUNCTION, jsonl:PATH) is an existing path inside folder: "--model 'runs/X/final'"."""
    folder = os.path.realpath(folder)
    found = []
    for field in dataclasses.fields(args):
        values = getattr(args, field.name)
        for value in values if isinstance(values, tuple) else (values,):
            paths = (value, *value.split(":")) if isinstance(value, str) and field.name != "output_dir" else ()
            if any(os.path.exists(p) and os.path.commonpath([os.path.realpath(p), folder]) == folder for p in paths):
                found.append(f"--{field.name.replace('_', '-')} {value!r}")
    return found


def final_step(folder: str) -> int | None:
    """The step a run folder's final/ was saved at (summary.json, written right after it); None if unknown."""
    try:
        with open(os.path.join(folder, "summary.json")) as f:
            return int(json.load(f)["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holds_progress(path: str) -> bool:
    """Whether a folder holds a run worth keeping: a checkpoint, a final model, or metrics of
    a trained step. A run that died while starting (only args.json and its step-0 metrics)
    holds nothing, and its folder is reused."""
    if any(os.path.exists(os.path.join(path, name)) for name in ("checkpoints", "final", "summary.json")):
        return True
    try:
        with open(os.path.join(path, "metrics.jsonl")) as f:
            return any(json.loads(line)["step"] > 0 for line in f if line.strip())
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError):
        return True  # unreadable metrics: keep them


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)


@contextlib.contextmanager
def atomic_folder(path: str):
    """with atomic_folder(path) as tmp: write into tmp; it becomes path only when the block
    completes. A failed save leaves no half folder (the previous one at path stays), and a
    full disk is said in one line."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        yield tmp
    except BaseException as e:
        disk_full = no_space_left(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full:
            raise RunError(f"no space left on {filesystem_of(path)} while saving {path}") from None
        raise
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def no_space_left(error: BaseException, path: str) -> bool:
    """ENOSPC / EDQUOT, or an error from a writer that hides the errno (torch.save says
    "iostream error") while the filesystem has (almost) no space left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(error):
        return True
    from torch.distributed.checkpoint.api import CheckpointException  # wraps the optimizer's writers' errors

    try:
        return isinstance(error, (OSError, RuntimeError, CheckpointException)) and shutil.disk_usage(path).free < 2**20
    except OSError:
        return False


def filesystem_of(path: str) -> str:
    """The device and mount point that hold path, e.g. "/dev/sdb1 (mounted at /data)"."""
    mount = os.path.abspath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        with open("/proc/mounts") as f:
            devices = {fields[1]: fields[0] for fields in (line.split() for line in f) if len(fields) > 1}
    except OSError:
        devices = {}
    return f"{devices[mount]} (mounted at {mount})" if mount in devices else mount


# ---------------------------------------------------------------------------------------
# metrics: a JSONL file always; TensorBoard and Weights & Biases when asked
# ---------------------------------------------------------------------------------------

def open_until(path: str, step: int):
    """A JSONL log of {"step": N, ...} lines, opened for appending: a resumed run (step > 0)
    keeps the lines up to its checkpoint's step and drops those written after it, and a line a crash
    cut short while writing it (the last, written after the checkpoint)."""
    kept = []
    if step > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if whole_line(line) and json.loads(line)["step"] <= step]
    f = open(path, "w")
    f.writelines(kept)
    return f


def whole_line(line: str) -> bool:
    """Whether a JSONL line was written whole (a crash can cut the last one short)."""
    try:
        return line.endswith("\n") and isinstance(json.loads(line), dict)
    except ValueError:
        return False


class MetricsLogger:
    def __init__(self, output_dir: str, args, start_step: int = 0, tensorboard: bool = False,
                 track: bool = False, wandb_project: str = "rl-lm", launch: dict | None = None):
        """start_step > 0 (a resumed run) keeps the lines of metrics.jsonl up to that step
        and drops those the interrupted run wrote after its checkpoint. launch (world size,
        device) is written into args.json beside the arguments: how the run was made."""
        self.file = open_until(os.path.join(output_dir, "metrics.jsonl"), start_step)
        self.completions_path = os.path.join(output_dir, "completions.jsonl")  # written from its first record
        self.completions = open_until(self.completions_path, start_step) if os.path.exists(self.completions_path) \
            else None
        self.tb = self.wandb = None
        config = dataclasses.asdict(args)
        write_json(os.path.join(output_dir, "args.json"), {**config, **(launch or {})})
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if track:
            import wandb  # optional: pip install wandb

            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(output_dir),
                                    config=config, dir=output_dir)

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def log_completions(self, step: int, records: list[dict]) -> None:
        if self.completions is None:
            self.completions = open(self.completions_path, "w")
        self.completions.writelines(json.dumps(r) + "\n" for r in records)
        self.completions.flush()
        if self.wandb is not None:
            import wandb

            columns = list(records[0])
            table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])
            self.wandb.log({"completions": table}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.completions is not None:
            self.completions.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
