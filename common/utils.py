"""Plumbing shared by all the scripts and belonging to no algorithm: the run's arguments
(checked, and restored on --resume), its folder (metrics, checkpoints, final model,
summary), seeding, and stopping cleanly on Ctrl-C or SIGTERM. Under torchrun rank 0 writes
the folder; checkpoints hold the optimizer state sharded (torch.distributed.checkpoint),
written by every rank, in the same layout for one process and for N."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

from common import dist
from common.curves import write_curves
from common.errors import ConfigError, RunError, need
from common.models import is_lora, merged_state_dict, save_model

# ---------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------

# Flags a resumed run may change (each change is printed). Every other flag defines the run
# (model, task, seed, batch shape, optimizer, algorithm) and is restored from the checkpoint;
# giving it again with another value is refused.
RESUMABLE_CHANGES = ("steps", "eval_every", "save_every", "micro_batch_size", "gradient_checkpointing",
                     "vllm_gpu_memory_utilization", "vllm_cpu_kv_cache_gib", "vllm_sleep", "tensorboard", "track",
                     "wandb_project", "log_completions")


def parse_args(Args, argv: list[str] | None = None):
    """tyro.cli(Args). With --resume, the run's saved arguments become the defaults: the run
    continues as it was started, whatever the command line leaves out. Flags given again
    with a new value are applied if they are in RESUMABLE_CHANGES, else refused."""
    import tyro

    args = tyro.cli(Args, args=argv)
    if args.resume is None:
        return args
    checkpoint = find_checkpoint(args.resume)
    saved = saved_args(Args, checkpoint)
    # a repeatable flag (--reward) given again replaces its saved value instead of adding to it
    given = [a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:])]  # --reward=X too
    saved = dataclasses.replace(saved, **{name: () for name in appended_fields(Args)
                                          if f"--{name.replace('_', '-')}" in given})
    args = tyro.cli(Args, args=argv, default=saved)
    args.resume = checkpoint  # --resume RUN_FOLDER means its latest checkpoint
    check_resume(args)
    for name in RESUMABLE_CHANGES:
        if hasattr(args, name) and getattr(args, name) != getattr(saved, name) and dist.is_main():
            print(f"resume: --{name.replace('_', '-')} {getattr(saved, name)} -> {getattr(args, name)}")
    return args


def appended_fields(Args) -> list[str]:
    """The fields given once per value (tyro.conf.UseAppendAction: --reward A --reward B)."""
    import tyro

    hints = typing.get_type_hints(Args, include_extras=True)
    return [name for name, hint in hints.items() if tyro.conf.UseAppendAction in getattr(hint, "__metadata__", ())]


def check_args(args, max_context: int, max_prompt_len: int, min_completions: int = 2) -> None:
    """One clear line for each bad value of the fields every script shares."""
    need(args.steps > 0, f"--steps must be positive, got {args.steps}")
    need(args.seed >= 0, f"--seed must be >= 0, got {args.seed}")
    need(args.lr > 0 and math.isfinite(args.lr), f"--lr must be positive, got {args.lr}")
    need(args.prompts_per_step > 0, f"--prompts-per-step must be positive, got {args.prompts_per_step}")
    need(args.completions_per_prompt >= min_completions,
         f"--completions-per-prompt must be >= {min_completions} (a group baseline compares the "
         f"completions of one prompt), got {args.completions_per_prompt}")
    need(args.max_new_tokens > 0, f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    need(max_prompt_len + args.max_new_tokens <= max_context,
         f"--max-new-tokens {args.max_new_tokens} plus the longest prompt ({max_prompt_len} tokens) "
         f"exceeds the model's context of {max_context} tokens")
    need(args.temperature > 0, f"--temperature must be positive, got {args.temperature}")
    need(args.micro_batch_size > 0, f"--micro-batch-size must be positive, got {args.micro_batch_size}")
    need(args.max_grad_norm > 0, f"--max-grad-norm must be positive, got {args.max_grad_norm}")
    need(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    need(args.eval_every >= 0, f"--eval-every must be >= 0 (0: only at start and end), got {args.eval_every}")
    need(args.save_every >= 0, f"--save-every must be >= 0 (0: only on Ctrl-C), got {args.save_every}")
    need(args.log_completions >= 0, f"--log-completions must be >= 0, got {args.log_completions}")
    need(args.vllm_cpu_kv_cache_gib >= 1, f"--vllm-cpu-kv-cache-gib must be >= 1, got {args.vllm_cpu_kv_cache_gib}")
    need(0 < args.vllm_gpu_memory_utilization <= 1,
         f"--vllm-gpu-memory-utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    if args.dtype == "bfloat16" and args.lr < 1e-4:
        print(f"warning: --dtype bfloat16 keeps ~3 significant digits per weight, so AdamW steps of about "
              f"--lr {args.lr} are mostly rounded away; --dtype float32 (the default) keeps fp32 master "
              f"weights", file=sys.stderr)
    world = dist.world_size()
    need(args.prompts_per_step % world == 0, f"--prompts-per-step {args.prompts_per_step} must be divisible by the "
                                             f"number of processes ({world}): each takes an equal share of the prompts")
    if hasattr(args, "num_minibatches"):  # scripts that reuse a rollout batch for several updates
        batch = args.prompts_per_step * args.completions_per_prompt // world
        need(args.num_minibatches > 0 and batch % args.num_minibatches == 0,
             f"--num-minibatches {args.num_minibatches} must divide the rollout batch "
             f"(prompts_per_step x completions_per_prompt = {batch}" + (f", per process of {world})" if world > 1
                                                                         else ")"))
        need(args.num_epochs > 0, f"--num-epochs must be positive, got {args.num_epochs}")


# ---------------------------------------------------------------------------------------
# resuming: which checkpoint, made by what
# ---------------------------------------------------------------------------------------

def script_name(Args) -> str:
    """The file that defines this Args class (grpo.py, ...): what made a checkpoint."""
    return os.path.basename(sys.modules[Args.__module__].__file__)


def check_script(info: dict, script: str, checkpoint: str) -> None:
    need(info["script"] == script,
         f"--resume {checkpoint!r}: this checkpoint was made by {info['script']} (model {info['args']['model']!r}), "
         f"not {script}; resume it with: python {info['script']} --resume {checkpoint}")


def find_checkpoint(path: str) -> str:
    """--resume's folder: a checkpoint (runs/X/checkpoints/step_N), or a run folder (its
    latest checkpoint). Anything else is one line."""
    path = os.path.expanduser(path.rstrip("/"))
    if path.endswith(".tmp"):
        raise ConfigError(f"--resume {path!r} is a half-written checkpoint (its save did not finish); "
                          f"resume from a complete one: {latest_checkpoint(os.path.dirname(os.path.dirname(path)))}")
    need(os.path.isdir(path), f"--resume {path!r}: no such folder")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        latest = latest_checkpoint(path)
        need(latest is not None, f"--resume {path!r}: this run folder has no checkpoint to resume from")
        return latest
    need(os.path.isfile(os.path.join(path, "trainer_state.pt")),
         f"--resume {path!r} is not a checkpoint folder (no trainer_state.pt)")
    need(os.path.isfile(os.path.join(path, "run.json")),
         f"--resume {path!r} was written by an older version of these scripts (no run.json): "
         f"its arguments are unknown, start a new run from its weights with --model {path}/policy")
    need(os.path.isdir(os.path.join(path, "optimizer")),
         f"--resume {path!r} was written by an older version of these scripts (no optimizer/ folder): "
         f"start a new run from its weights with --model {path}/policy")
    return path


def latest_checkpoint(run_dir: str) -> str | None:
    ckpts = sorted(Path(run_dir, "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name[5:]))
    return str(ckpts[-1]) if ckpts else None


def read_run_info(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "run.json")) as f:
        info = json.load(f)
    info["args"] = {k: tuple(v) if isinstance(v, list) else v for k, v in info["args"].items()}  # JSON has no tuples
    return info


def saved_args(Args, checkpoint: str):
    """The arguments a checkpoint's run was made with, as an Args, after checking that it
    was made by this script; resuming continues in the checkpoint's run folder."""
    info, script = read_run_info(checkpoint), script_name(Args)
    check_script(info, script, checkpoint)
    fields = {f.name for f in dataclasses.fields(Args)}
    unknown = sorted(set(info["args"]) - fields)
    need(not unknown, f"--resume {checkpoint!r}: the checkpoint has arguments this {script} does not know "
                      f"({', '.join(unknown)}): it was made by another version of the script")
    saved = Args(**info["args"])
    saved.resume = checkpoint
    saved.output_dir = run_folder_of(checkpoint)
    return saved


def run_folder_of(checkpoint: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))


def forks(args) -> bool:
    """Whether a resume continues in another folder than its checkpoint's (a fork of the run)."""
    return args.output_dir is not None and os.path.abspath(args.output_dir) != run_folder_of(args.resume)


def check_resume(args) -> None:
    """Refuse a resume whose arguments define another run than the checkpoint's."""
    info = read_run_info(args.resume)
    check_script(info, script_name(type(args)), args.resume)
    need(not args.overwrite or forks(args), "--overwrite and --resume contradict each other: a resumed run "
                                            "continues in its own folder (or give a new --output-dir)")
    saved = info["args"]
    refused = [f"--{k.replace('_', '-')} {saved[k]!r} (you asked for {getattr(args, k)!r})"
               for k in saved if k not in RESUMABLE_CHANGES + ("resume", "output_dir", "overwrite")
               and getattr(args, k) != saved[k]]
    need(not refused, f"--resume {args.resume!r}: this run was made with {'; '.join(refused)}. A resumed run "
                      f"keeps the flags that define it; those that may change: "
                      f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE_CHANGES if hasattr(args, k))}")


# ---------------------------------------------------------------------------------------
# seeding
# ---------------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------
# the run folder
# ---------------------------------------------------------------------------------------

RUN_FILES = ("args.json", "metrics.jsonl", "completions.jsonl", "checkpoints", "final", "summary.json", "curves.png")


class Run:
    """The run folder, checked before anything heavy starts:

        args.json  metrics.jsonl  completions.jsonl  checkpoints/step_N/  final/  summary.json  curves.png

    A new run needs a new or empty folder (--overwrite empties an earlier run's folder). A
    resumed run continues in its checkpoint's folder, from that checkpoint's step, and drops
    what the abandoned continuation wrote after it; with another --output-dir it continues
    in that (new or empty) folder instead and leaves the original alone. Start accuracy and
    wall time are carried across resumes, so summary.json describes the whole run."""

    def __init__(self, args):
        self.args, self.script = args, script_name(type(args))
        self.t_start = time.perf_counter()
        # rank 0 checks and writes the folder; the others learn where it is (or its error)
        self.dir, self.start_step, self.accuracy_start, self.wall_time_before = dist.on_main(self._open, args)
        args.output_dir = self.dir  # args.json and checkpoints record where the run lives
        if not dist.is_main():
            args.resume = args.resume and find_checkpoint(args.resume)
        self.launch = {"world_size": dist.world_size(), "device": "cuda" if torch.cuda.is_available() else "cpu"}
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
            self._drop_after(folder, info["step"])
        return folder, info["step"], info["accuracy_start"], info["wall_time_s"]

    def _new_folder(self, args) -> str:
        if args.output_dir is None:
            task = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.task).strip("-")  # jsonl:PATH must not nest folders
            base = os.path.join("runs", f"{args.exp_name}__{task}__{args.seed}__{int(time.time())}")
            path, n = base, 1
            while os.path.exists(path):  # two runs started in the same second
                path, n = f"{base}_{n}", n + 1
        else:
            path = os.path.expanduser(args.output_dir)
        path = os.path.abspath(path)
        need(not os.path.exists(path) or os.path.isdir(path), f"--output-dir {path!r} is a file, not a folder")
        entries = os.listdir(path) if os.path.isdir(path) else []
        foreign = sorted(set(entries) - set(RUN_FILES) - {"tensorboard", "wandb"})
        need(not foreign, f"--output-dir {path!r} holds files that no run wrote ({', '.join(foreign[:4])}): "
                          f"choose a new or empty folder")
        if holds_progress(path):
            need(args.overwrite, f"--output-dir {path!r} already holds a run ({', '.join(sorted(entries))}): "
                                 f"resume it with --resume {path}, choose another folder, or pass --overwrite "
                                 f"to replace it")
            print(f"--overwrite: emptying {path}")
        try:  # a folder we cannot write to fails here, in one line, not at the first metric
            for entry in entries:  # an earlier run's (--overwrite), or one that died before its first step
                full = os.path.join(path, entry)
                shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.remove(full)
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--output-dir {path!r} is not usable: {e.strerror or e}") from None
        return path

    @staticmethod
    def _drop_after(folder: str, step: int) -> None:
        """Resuming from an earlier checkpoint abandons what the run wrote after it."""
        later = [p for p in Path(folder, "checkpoints").glob("step_*")
                 if not p.name[5:].isdigit() or int(p.name[5:]) > step]
        for name in ("final", "final.tmp", "summary.json", "curves.png"):
            if os.path.exists(os.path.join(folder, name)):
                later.append(Path(folder, name))
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

    def wall_time(self) -> float:
        return self.wall_time_before + time.perf_counter() - self.t_start

    def save_checkpoint(self, step: int, models: dict, tokenizer, state: dict, optimizer) -> str:
        """checkpoints/step_N: each model in models (e.g. {"policy": policy}) as a save_pretrained
        folder, optimizer/ (the optimizer's state, written by every rank, each its own shard:
        torch.distributed.checkpoint), trainer_state.pt (step, scheduler, RNG, ...) and run.json
        (script, arguments, step, start accuracy, wall time, world size). Written atomically."""
        from torch.distributed.checkpoint import save as dcp_save

        path = os.path.join(self.dir, "checkpoints", f"step_{step}")
        info = {"script": self.script, "step": step, "accuracy_start": self.accuracy_start,
                "wall_time_s": self.wall_time(), **self.launch, "args": dataclasses.asdict(self.args)}
        weights = {name: dist.full_state_dict(model) for name, model in models.items()}  # whole on rank 0
        optimizer_state = {"optimizer": dist.optimizer_state_dict(models, optimizer)}
        with atomic_folder(path) if dist.is_main() else contextlib.nullcontext(path + ".tmp") as tmp:
            dist.barrier()  # rank 0 made the folder
            dcp_save(optimizer_state, checkpoint_id=os.path.join(tmp, "optimizer"))  # every rank writes its shard
            if dist.is_main():
                for name, model in models.items():
                    model.save_pretrained(os.path.join(tmp, name), state_dict=weights[name])
                    tokenizer.save_pretrained(os.path.join(tmp, name))
                torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
                write_json(os.path.join(tmp, "run.json"), info)
        dist.barrier()  # the checkpoint is complete for every rank
        return path

    def load_checkpoint(self, models: dict, optimizer) -> dict:
        """The resumed checkpoint's optimizer state into optimizer (resharded to this run's
        world size), and its trainer state (models load from its folders); restores RNG."""
        from torch.distributed.checkpoint import load as dcp_load

        state = torch.load(os.path.join(self.args.resume, "trainer_state.pt"), weights_only=False)
        set_rng_state(state["rng"])
        optimizer_state = {"optimizer": dist.optimizer_state_dict(models, optimizer)}
        dcp_load(optimizer_state, checkpoint_id=os.path.join(self.args.resume, "optimizer"))
        dist.load_optimizer_state_dict(models, optimizer, optimizer_state["optimizer"])
        return state

    def finish(self, model, tokenizer, eval_metrics: dict) -> None:
        """final/ (a model folder, merged under LoRA, written atomically) and summary.json."""
        final_dir = os.path.join(self.dir, "final")
        weights = dist.full_state_dict(model)  # every rank takes part; whole on rank 0
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
        """Closes the logs and draws curves.png from metrics.jsonl (at the end and on Ctrl-C)."""
        if self.logger is not None:
            self.logger.close()
            write_curves(self.dir)


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
    keeps the lines up to its checkpoint's step and drops those written after it."""
    kept = []
    if step > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
    f = open(path, "w")
    f.writelines(kept)
    return f


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


# ---------------------------------------------------------------------------------------
# stopping cleanly, timing, memory
# ---------------------------------------------------------------------------------------

class GracefulInterrupt:
    """The first Ctrl-C or SIGTERM (what schedulers and `timeout` send) asks the loop to stop
    after the current step, which then saves a checkpoint and exits with 128 + the signal's
    number (130, 143), so a wrapper can tell it from a finished run. A second one stops at once."""

    def __init__(self):
        self.requested, self.exit_code = False, 0

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.exit_code = True, 128 + signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # stderr: under torchrun only rank 0's stdout is shown, and the signal may reach another rank
        print(f"\n{name}: finishing this step, then saving a checkpoint (again to abort)", file=sys.stderr, flush=True)

    def stop(self) -> bool:
        """Whether to save and stop after this step. Every rank calls it once per step: under
        torchrun a signal that reached one rank stops them all after the same step, with one
        checkpoint, and the same exit code."""
        if dist.world_size() > 1:
            self.exit_code = int(dist.all_gather(torch.tensor([self.exit_code])).max())
            self.requested = self.exit_code > 0
        return self.requested

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False


@contextlib.contextmanager
def timed(times: dict, name: str):
    """with timed(times, "rollout"): ...  stores the section's wall time in times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0


def memory_metrics(llm) -> dict:
    """memory/engine_gib: what the vLLM engine took when it started (weights and KV cache; on
    CPU the process memory it added). memory/peak_gib: the trainer's peak since the previous
    call, i.e. this step, on CUDA (torch's peak allocation, less the engine's tensors); on CPU
    the process's peak resident memory so far, engine included (it cannot be reset there)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() - llm.memory["allocated"]
        torch.cuda.reset_peak_memory_stats()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"memory/peak_gib": peak / 2**30, "memory/engine_gib": llm.memory["device"] / 2**30}
