"""The run's arguments: parsed with tyro, checked in one line each, and on --resume restored
from the checkpoint (which also says which script and run made it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import signal
import sys
import typing
from pathlib import Path

from common import dist
from common.checkpoints import damage
from common.errors import ConfigError, RunError, need
from common.interrupt import StopAtOnce, signal_name
from common.ops import CORRECTION_DEFAULTS


# Flags a resumed run may change (each change is printed). Every other flag defines the run
# (model, task, seed, batch shape, optimizer, algorithm) and is restored from the checkpoint;
# giving it again with another value is refused.
RESUMABLE_CHANGES = ("steps", "eval_every", "save_every", "micro_batch_size", "gradient_checkpointing", "engine",
                     "device", "vllm_gpu_memory_utilization", "vllm_cpu_kv_cache_gib", "vllm_sleep", "tensorboard", "track",
                     "wandb_project", "log_completions", "max_nonfinite_steps", "max_unsynced_steps",
                     "reward_timeout")


def parse_args(Args, argv: list[str] | None = None):
    """tyro.cli(Args). With --resume, the run's saved arguments become the defaults: the run
    continues as it was started, whatever the command line leaves out. Flags given again
    with a new value are applied if they are in RESUMABLE_CHANGES, else refused."""
    import tyro

    refuse_replaced_flags(argv if argv is not None else sys.argv[1:])
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


def cli(main, Args, argv: list[str] | None = None) -> None:
    """if __name__ == "__main__": cli(main, Args): main(the parsed arguments), and what ends it early
    said in one line instead of a traceback: a RunError (bad input, a failed run; exit status 1), or a
    Ctrl-C or SIGTERM that stops it at once (exit 130, 143): one outside the training loop, or a
    second one in it (common/interrupt.py). Checkpoints are written atomically: a stop mid-save
    leaves the previous one, which the line names."""
    args = None
    try:
        with StopAtOnce():
            args = parse_args(Args, argv)
            main(args)
    except RunError as e:
        end_progress_bars()
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:  # Interrupted (a bare one: a Ctrl-C that came before StopAtOnce)
        end_progress_bars()
        signum = getattr(e, "signum", signal.SIGINT)
        checkpoint = args and args.output_dir and latest_checkpoint(args.output_dir)
        saved = f"continue from the last checkpoint with --resume {checkpoint}" if checkpoint else \
            "no checkpoint was saved"
        print(f"{signal_name(signum)}: stopped; {saved}", file=sys.stderr)
        sys.exit(128 + signum)


def end_progress_bars() -> None:
    """Ends the line of a progress bar that an error or a stop left open, so that cli's line is
    one of its own (tqdm keeps its open bars in tqdm._instances)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


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
    need(0 < args.top_p <= 1, f"--top-p must be in (0, 1] (1: off), got {args.top_p}")
    need(args.top_k >= 0, f"--top-k must be >= 0 (0: off), got {args.top_k}")
    need(args.micro_batch_size > 0, f"--micro-batch-size must be positive, got {args.micro_batch_size}")
    need(args.max_grad_norm > 0, f"--max-grad-norm must be positive, got {args.max_grad_norm}")
    need(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    need(args.eval_every >= 0, f"--eval-every must be >= 0 (0: only at start and end), got {args.eval_every}")
    need(args.save_every >= 0, f"--save-every must be >= 0 (0: only on Ctrl-C), got {args.save_every}")
    need(args.max_nonfinite_steps >= 1, f"--max-nonfinite-steps must be >= 1, got {args.max_nonfinite_steps}")
    need(args.max_unsynced_steps >= 0, f"--max-unsynced-steps must be >= 0 (0: off), got {args.max_unsynced_steps}")
    need(args.log_completions >= 0, f"--log-completions must be >= 0, got {args.log_completions}")
    need(args.engine != "vllm" or vllm_installed(),
         "vLLM is not installed here: run with --engine transformers (the policy samples itself), or install vLLM")
    need(args.vllm_cpu_kv_cache_gib >= 1, f"--vllm-cpu-kv-cache-gib must be >= 1, got {args.vllm_cpu_kv_cache_gib}")
    need(0 < args.vllm_gpu_memory_utilization <= 1,
         f"--vllm-gpu-memory-utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    need(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    check_rollout_correction(args)
    need(args.lora_rank >= 0 and args.lora_alpha > 0, f"--lora-rank must be >= 0 and --lora-alpha > 0, got "
                                                      f"{args.lora_rank} and {args.lora_alpha}")
    need(not (getattr(args, "ref_update_every", 0) and args.lora_rank),
         "--ref-update-every needs full fine-tuning (--lora-rank 0): under LoRA the reference is the base model")
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


def check_rollout_correction(args) -> None:
    """--rollout-correction's thresholds: each one given only to a mode that uses it, and in range."""
    uses = CORRECTION_DEFAULTS.get(args.rollout_correction, {})
    for name in ("cap", "low", "high"):
        value = getattr(args, f"rollout_correction_{name}")
        users = " or ".join(m for m, d in CORRECTION_DEFAULTS.items() if name in d)
        need(value is None or name in uses, f"--rollout-correction-{name} is a threshold of --rollout-correction "
                                            f"{users}, not {args.rollout_correction}")
    cap, low, high = args.rollout_correction_cap, args.rollout_correction_low, args.rollout_correction_high
    need(cap is None or cap > 0, f"--rollout-correction-cap must be positive, got {cap}")
    low, high = low if low is not None else uses.get("low"), high if high is not None else uses.get("high")
    need(low is None or 0 <= low <= 1 <= high, f"--rollout-correction-low and -high must have 0 <= low <= 1 <= high "
                                              f"(a ratio of 1 is on-policy: kept), got [{low}, {high}]")


# Flags that are gone: one line naming what replaced them (instead of tyro's usage error)
REPLACED_FLAGS = {"--vllm-is-cap": "--rollout-correction token-truncate --rollout-correction-cap C "
                                   "(0: --rollout-correction off; see --help)"}


def refuse_replaced_flags(argv: list[str]) -> None:
    for flag, replacement in REPLACED_FLAGS.items():
        need(not any(a.split("=", 1)[0] == flag for a in argv), f"{flag} is replaced by {replacement}")


def upgrade_saved_args(saved: dict) -> dict:
    """A run's saved arguments in today's flags: an older run's --vllm-is-cap C is --rollout-correction
    token-truncate with cap C (None: auto, 0: off), so that run still resumes."""
    if "vllm_is_cap" not in saved:
        return saved
    saved = dict(saved)
    cap = saved.pop("vllm_is_cap")
    saved.setdefault("rollout_correction", "auto" if cap is None else "off" if cap == 0 else "token-truncate")
    saved.setdefault("rollout_correction_cap", cap or None)
    return saved


def vllm_installed() -> bool:
    """Whether `import vllm` would find it (without importing it: seconds). A finder that refuses it
    (tests/conftest.py's RL_LM_HIDE_VLLM) counts as absent."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except ImportError:
        return False


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
    """--resume's folder: a checkpoint (runs/X/checkpoints/step_N), or a run folder (its latest
    whole checkpoint; a damaged later one is said and skipped). Anything else, a damaged checkpoint
    included (common/checkpoints.py damage: before any model loads), is one line."""
    path = os.path.expanduser(path.rstrip("/"))
    if path.endswith(".tmp"):
        raise ConfigError(f"--resume {path!r} is a half-written checkpoint (its save did not finish); "
                          f"resume from a complete one: {latest_checkpoint(run_folder_of(path))}")
    need(os.path.isdir(path), f"--resume {path!r}: no such folder")
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(os.path.join(path, "args.json")):
        saved = checkpoints(path)  # a run folder (args.json: also one that never saved)
        need(saved, f"--resume {path!r}: this run saved no checkpoint ({when_saved(path)}), so there "
                    f"is nothing to resume: start it again")
        latest = latest_checkpoint(path)
        need(latest is not None, f"--resume {path!r}: every checkpoint of this run is damaged (the latest, "
                                 f"{saved[-1]}: {checkpoint_damage(saved[-1])}): start it again")
        if latest != saved[-1] and dist.is_main():
            print(f"--resume {path!r}: its latest checkpoint {saved[-1]} is damaged "
                  f"({checkpoint_damage(saved[-1])}); resuming from {latest}, the latest whole one", file=sys.stderr)
        return latest
    need(os.path.isfile(os.path.join(path, "trainer_state.pt")),
         f"--resume {path!r} is not a checkpoint folder (no trainer_state.pt)")
    need(os.path.isfile(os.path.join(path, "run.json")),
         f"--resume {path!r} was written by an older version of these scripts (no run.json): "
         f"its arguments are unknown, start a new run from its weights with --model {path}/policy")
    need(os.path.isdir(os.path.join(path, "optimizer")),
         f"--resume {path!r} was written by an older version of these scripts (no optimizer/ folder): "
         f"start a new run from its weights with --model {path}/policy")
    why = checkpoint_damage(path)
    if why:
        earlier = latest_checkpoint(run_folder_of(path), before=step_of(path))
        raise ConfigError(f"--resume {path!r} is damaged: {why}; " + (
            f"the latest whole checkpoint before it: --resume {earlier}" if earlier else
            "no earlier checkpoint of its run is whole"))
    return path


def checkpoint_damage(path: str) -> str | None:
    """common/checkpoints.py damage(path), once per checkpoint and process while its files stay as
    they are (--resume asks twice)."""
    key = (os.path.abspath(path), *sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                          for p in Path(path).rglob("*") if p.is_file()))
    if key not in _DAMAGE:
        _DAMAGE[key] = damage(path)
    return _DAMAGE[key]


_DAMAGE: dict = {}


def when_saved(run_dir: str) -> str:
    """When the run in run_dir saves a checkpoint, from its args.json: "--save-every 50: every 50 steps, ..."."""
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            every = int(json.load(f)["save_every"])
    except (OSError, ValueError, KeyError, TypeError):
        return "see --save-every"
    return f"--save-every {every}: " + (f"every {every} steps and on Ctrl-C or SIGTERM" if every else
                                        "on Ctrl-C or SIGTERM only")


def checkpoints(run_dir: str) -> list[str]:
    """The run's checkpoints, oldest first (not a save that died: step_N.tmp)."""
    return [str(p) for p in sorted(Path(run_dir, "checkpoints").glob("step_*[0-9]"), key=lambda p: step_of(p))]


def step_of(checkpoint) -> int:
    return int(Path(checkpoint).name[len("step_"):])


def latest_checkpoint(run_dir: str, before: int | None = None) -> str | None:
    """The run's latest whole checkpoint (checkpoint_damage), of a step below `before` if given."""
    return next((c for c in reversed(checkpoints(run_dir)) if (before is None or step_of(c) < before)
                 and checkpoint_damage(c) is None), None)


def read_run_info(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "run.json")) as f:
        info = json.load(f)
    info["args"] = {k: tuple(v) if isinstance(v, list) else v for k, v in info["args"].items()}  # JSON has no tuples
    info["args"] = upgrade_saved_args(info["args"])
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
    saved.overwrite = saved.discard_later = False  # what one command asked, not the run: never restored
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
    need(args.steps >= info["step"], f"--resume {args.resume!r}: --steps {args.steps} is below the step of this "
                                     f"checkpoint ({info['step']}): give --steps {info['step']} or more (as many: "
                                     f"no more training, only the final model and summary.json)")
    saved = info["args"]
    refused = [f"--{k.replace('_', '-')} {saved[k]!r} (you asked for {getattr(args, k)!r})"
               for k in saved if k not in RESUMABLE_CHANGES + ("resume", "output_dir", "overwrite", "discard_later")
               and getattr(args, k) != saved[k]]
    need(not refused, f"--resume {args.resume!r}: this run was made with {'; '.join(refused)}. A resumed run "
                      f"keeps the flags that define it; those that may change: "
                      f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE_CHANGES if hasattr(args, k))}")
