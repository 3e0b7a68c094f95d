"""Plumbing shared by all six scripts and belonging to no algorithm: argument checks,
seeding, metric sinks, greedy evaluation, checkpoints and a graceful Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import resource
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch


# ---------------------------------------------------------------------------------------
# arguments and seeding
# ---------------------------------------------------------------------------------------

class ConfigError(ValueError):
    """Bad input from the user (flags, model path, task, reward function): the scripts
    print its message as one line and exit, instead of a traceback."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_args(args, max_context: int, max_prompt_len: int, min_completions: int = 2) -> None:
    """One clear line for each bad value of the fields every script shares."""

    need(args.steps > 0, f"--steps must be positive, got {args.steps}")
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
    if hasattr(args, "num_minibatches"):  # scripts that reuse a rollout batch for several updates
        batch = args.prompts_per_step * args.completions_per_prompt
        need(args.num_minibatches > 0 and batch % args.num_minibatches == 0,
             f"--num-minibatches {args.num_minibatches} must divide the rollout batch "
             f"(prompts_per_step x completions_per_prompt = {batch})")
        need(args.num_epochs > 0, f"--num-epochs must be positive, got {args.num_epochs}")


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
# metrics: a JSONL file always; TensorBoard and Weights & Biases when asked
# ---------------------------------------------------------------------------------------

class MetricsLogger:
    def __init__(self, output_dir: str, args, start_step: int = 0, tensorboard: bool = False,
                 track: bool = False, wandb_project: str = "rl-lm"):
        """start_step > 0 (a resumed run) keeps the lines of metrics.jsonl before that step
        and drops those the interrupted run wrote after its checkpoint."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start_step]
        self.file = open(path, "w")
        self.file.writelines(kept)
        self.tb = self.wandb = None
        config = dataclasses.asdict(args)
        with open(os.path.join(output_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
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

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ---------------------------------------------------------------------------------------
# evaluation: greedy decoding on the held-out split
# ---------------------------------------------------------------------------------------

def evaluate(llm, tokenizer, task, max_new_tokens: int, chat_template: bool = True,
             system_prompt: str | None = None) -> dict:
    """Greedy accuracy (reward >= 1) and mean reward on the task's eval split, through vLLM.

    Prompts are encoded and completions stopped as in training: pass the same
    chat_template / system_prompt as to encode_prompts (stop tokens: stop_token_ids)."""
    from vllm import SamplingParams

    from common.tasks import encode_prompts, stop_token_ids

    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in task.eval], chat_template, system_prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
    rewards = [task.reward(o.outputs[0].text, e) for o, e in zip(outputs, task.eval)]
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards)}


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------

def save_checkpoint(path: str, models: dict, tokenizer, state: dict) -> None:
    """Each model in models (e.g. {"policy": policy}) as a save_pretrained folder, plus
    trainer_state.pt (step, optimizer, scheduler, RNG, ...). Written to a temporary folder
    and renamed, so a crash while saving never leaves a half-written checkpoint."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in models.items():
        model.save_pretrained(os.path.join(tmp, name))
        tokenizer.save_pretrained(os.path.join(tmp, name))
    torch.save({**state, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    """The trainer state of a checkpoint (models are loaded from its folders); restores RNG."""
    file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(file):
        raise ConfigError(f"--resume {path!r} is not a checkpoint folder (no trainer_state.pt)")
    state = torch.load(file, weights_only=False)
    set_rng_state(state["rng"])
    return state


def latest_checkpoint(output_dir: str) -> str | None:
    ckpts = sorted(Path(output_dir, "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name[5:]))
    return str(ckpts[-1]) if ckpts else None


class GracefulInterrupt:
    """First Ctrl-C asks the loop to stop after the current step (which then saves a
    checkpoint); a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False


@contextlib.contextmanager
def timed(times: dict, name: str):
    """with timed(times, "rollout"): ...  stores the section's wall time in times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0


def peak_memory_gib() -> float:
    """Peak GPU memory allocated by torch on CUDA; peak resident memory of the process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
