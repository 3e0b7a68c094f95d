"""What every script does before its loop, the same way in each: load and check the task, the
reward, the tokenizer and every argument (one line each, before anything heavy), choose the
numerics, and size the rollout engine. The algorithm's own checks are its script's `check`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import dist
from common.errors import need
from common.games import pair_task
from common.args import check_args, vllm_installed
from common.models import check_lora_targets, check_model, encode_prompts, load_tokenizer
from common.ops import RolloutCorrection
from common.rewards import load_reward
from common.tasks import load_task


def prepare(args, check, min_completions: int = 2):
    """(task, reward_fn, tokenizer, max_prompt_len) after every check: the shared arguments
    (common/args.py check_args), then the algorithm's own (check(args)). min_completions: the
    smallest group the algorithm's advantage can use. --device and --engine auto become the ones that
    run (args.json records them: `choose_engine`)."""
    args.engine_choice = choose_engine(args)  # said first by common/run.py Run.start, once every check has passed
    config = check_model(args.model)
    if args.lora_rank:
        check_lora_targets(config, args.lora_target_modules)
    pair_task(args)  # --env textarena:GAME: the task is the game's (common/games.py)
    task = load_task(args.task, seed=args.seed)
    reward_fn = load_reward(args.reward, task, args.reward_timeout, transcript=hasattr(args, "env"))  # a probe call
    tokenizer = load_tokenizer(args.model)
    max_prompt_len = max(len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in task.train + task.eval],
                                                        args.chat_template, args.system_prompt))
    check_args(args, config.max_position_embeddings, max_prompt_len, min_completions)
    check(args)
    check_engine(args, config)  # last: it imports vLLM (seconds), which the engine then needs anyway
    return task, reward_fn, tokenizer, max_prompt_len


def choose_engine(args) -> str | None:
    """args.device and args.engine made concrete, in place: --device auto as common/dist.py pick_device
    finds it; --engine auto is vLLM where it is installed, else the transformers engine (the policy
    samples itself), always on an Apple GPU (mps: vLLM has no build for it). Returns the line that
    says which, for --engine auto (None for an engine asked for by name)."""
    args.device = dist.pick_device(args.device)
    if args.engine == "auto":
        installed = vllm_installed()
        args.engine = "vllm" if installed and args.device != "mps" else "transformers"
        why = ("vLLM is installed" if args.engine == "vllm" else "vLLM has no build for mps" if installed
               else "vLLM is not installed here: the policy samples itself")
        return f"--engine auto: {args.engine} ({why}), --device {args.device}"
    return None


def check_engine(args, config) -> None:
    """A model vLLM cannot run (common/engine.py vllm_cannot_run): --engine auto takes the transformers
    engine instead, saying why; --engine vllm is one line naming --engine transformers."""
    if args.engine != "vllm":
        return
    from common.engine import vllm_cannot_run

    why = vllm_cannot_run(config, args.device)
    if why and getattr(args, "engine_choice", None):  # --engine auto
        args.engine = "transformers"
        args.engine_choice = f"--engine auto: transformers ({why}), --device {args.device}"
        return
    need(not why, f"--engine vllm cannot run --model {args.model!r}: {why}; run it with --engine transformers")


@dataclass(frozen=True)
class Precision:
    """The run's numerics (--precision; auto: bf16 on CUDA, fp32 on CPU and on an Apple GPU).

    On mps, --precision bf16 runs the trainer (and the transformers engine) under bf16 autocast, which
    torch offers on mps and MPS computes in bf16 from macOS 14 on (refused before it); auto keeps fp32
    there, as on CPU, where bf16 has not been measured to pay (docs/gpu.md)."""
    autocast_dtype: torch.dtype | None  # the trainer's forward/backward under autocast, or none (fp32)
    frozen_dtype: str                   # PPO's reward model (forward only): bf16 halves it; the reference
                                        # takes the policy's dtype (common/models.py load_reference)
    engine_dtype: str                   # vLLM's weights
    rollout_correction: RolloutCorrection  # for the engine's numerics: token-truncate C 2 under bf16, off in fp32

    def autocast(self, device: str):
        """with precision.autocast(device): the block under bf16 autocast, or as it is (fp32)."""
        return torch.autocast(device, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @classmethod
    def of(cls, args, device: str) -> Precision:
        bf16 = args.precision == "bf16" or (args.precision == "auto" and device == "cuda")
        need(not (bf16 and device == "mps") or torch.backends.mps.is_macos_or_newer(14, 0),
             "--precision bf16 on an Apple GPU (mps) needs macOS 14 or newer: use --precision fp32")
        # vLLM and the trainer differ by ~1e-2 in bf16, ~1e-5 in fp32: --rollout-correction auto corrects bf16's
        mode = args.rollout_correction
        if mode == "auto":
            mode = "token-truncate" if bf16 else "off"
        correction = RolloutCorrection.of(mode, args.rollout_correction_cap, args.rollout_correction_low,
                                          args.rollout_correction_high)
        return cls(torch.bfloat16 if bf16 else None, "bfloat16" if bf16 else args.dtype,
                   "bfloat16" if bf16 else "float32", correction)


def engine_options(args, max_prompt_len: int, precision: Precision) -> dict:
    """create_engine's arguments for this run: long enough for the longest prompt and completion;
    vLLM seeded per rank (the transformers engine seeds each sample by its place in the whole batch)."""
    return dict(engine=args.engine, seed=args.seed + (dist.rank() if args.engine == "vllm" else 0),
                max_model_len=max_prompt_len + args.max_new_tokens, dtype=precision.engine_dtype,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization, cpu_kv_cache_gib=args.vllm_cpu_kv_cache_gib,
                sleep_mode=args.vllm_sleep)
