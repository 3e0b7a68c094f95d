"""The rollout engine: an in-process vLLM engine (its creation, the CPU patches, sleep mode),
moving the trainer's weights into it, and greedy evaluation through it.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by each script before
vLLM is imported), so moving the trained weights into it is a plain in-memory copy.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import PreTrainedModel

from common import dist
from common.models import encode_prompts, merged_weights, resolve_model, stop_token_ids


def _keep_cpu_weights() -> None:
    """CPU only: let vLLM pack its linear weights into fast kernels, but keep the weights too.

    vLLM's CPU backend replaces each linear layer's weight with a packed copy (oneDNN) and an
    empty Parameter, after which load_weights() has nothing to write into. Packing with
    remove_weight=False keeps the Parameter that load_weights() updates; each layer gets a
    repack() that sync_weights() calls to pack the new weights. Against a plain F.linear the
    rollout of benchmarks/README.md's step-time table went 22.8 -> 15.7 s (SmolLM2-135M,
    float32, 2 cores), for a second copy of the linear weights and +0.5 s a sync."""
    import vllm.model_executor.layers.utils as layer_utils

    pack = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(pack, "keeps_weights", False):  # patched by an earlier engine
        return

    def pack_keeping_weights(layer, remove_weight):
        pack(layer, remove_weight=False)
        layer.repack = lambda: pack(layer, remove_weight=False)

    pack_keeping_weights.keeps_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = pack_keeping_weights


def _eager_token_ranks() -> None:
    """CPU only: count a sampled token's rank eagerly instead of through torch.compile.

    With log-probs asked for, vLLM's sampler also ranks each sampled token with a
    torch.compile'd helper (batched_count_greater_than, compiled to save GPU memory); the first
    sampled rollout of every run compiled it. On CPU the same count is done eagerly: the tiny
    job's first rollout went 2.76 -> 0.59 s, the later ones did not change (benchmarks/README.md,
    step time; benchmarks/first_rollout.py)."""
    import vllm.v1.sample.sampler as sampler

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    sampler.batched_count_greater_than = batched_count_greater_than


def create_engine(name_or_path: str, seed: int, max_model_len: int, dtype: str = "float32",
                  gpu_memory_utilization: float = 0.3, cpu_kv_cache_gib: int = 1,
                  enforce_eager: bool | None = None, sleep_mode: bool = True):
    """An in-process vLLM engine for rollouts, seeded once (never per request).

    On CPU the KV cache is sized by cpu_kv_cache_gib (vLLM would take most of the RAM),
    linear weights are kept beside their packed copies so that sync_weights() can update
    them, and sampled tokens are ranked without torch.compile (_eager_token_ranks).
    enforce_eager skips vLLM's torch.compile warm-up; the default is eager on CPU, where the
    compiled graphs are never reused across runs (vLLM recompiles every start): that saves
    ~8 s of start-up for the tiny model and ~40-55 s for SmolLM2-135M on 2 cores, for ~10-20%
    slower generation. On GPU vLLM compiles.
    sleep_mode (CUDA only; vLLM has none on CPU): see awake()."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vllm: "
                           "weight sync needs the engine in this process")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set,
        # which would leave training in this process on one core.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        _keep_cpu_weights()
        _eager_token_ranks()
    from vllm import LLM

    kwargs = {} if on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}
    if dist.world_size() > 1:
        # under torchrun: an engine per rank, on the rank's own device (LOCAL_RANK), vLLM's groups made
        # within the ranks' process group (the default in-process executor would put every engine on cuda:0)
        kwargs["distributed_executor_backend"] = "external_launcher"
    enforce_eager = on_cpu if enforce_eager is None else enforce_eager
    before = memory_in_use()
    llm = LLM(model=resolve_model(name_or_path), seed=seed, dtype=dtype,
              max_model_len=max_model_len, enable_prefix_caching=True, enable_sleep_mode=sleep_mode and not on_cpu,
              logprobs_mode="processed_logprobs", enforce_eager=enforce_eager, **kwargs)
    llm.memory = {k: after - before[k] for k, after in memory_in_use().items()}  # the engine's share
    llm.sleeps, llm.asleep = sleep_mode and not on_cpu, set()
    return llm


@contextlib.contextmanager
def awake(llm):
    """with awake(llm): llm.generate(...). With sleep mode the engine wakes for the block and
    sleeps again after it (level 1: its KV cache is freed and its weights wait in CPU memory),
    so the trainer has the GPU to itself between rollouts. Without, it does nothing."""
    wake(llm, "weights", "kv_cache")
    try:
        yield llm
    finally:
        if llm.sleeps:
            llm.sleep(level=1)
            llm.asleep = {"weights", "kv_cache"}


def wake(llm, *tags: str) -> None:
    """Wake the parts of a sleeping engine named by tags ("weights", "kv_cache")."""
    tags = sorted(set(tags) & llm.asleep)
    if tags:
        llm.wake_up(tags=tags)
        llm.asleep -= set(tags)


def memory_in_use() -> dict:
    """Bytes in use now: on CUDA, the device's (all allocators) and torch's allocated tensors;
    on CPU, the process's resident memory."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"device": total - free, "allocated": torch.cuda.memory_allocated()}
    import psutil  # a dependency of vLLM

    return {"device": psutil.Process().memory_info().rss, "allocated": 0}


def engine_model(llm) -> torch.nn.Module:
    """The engine's own torch model (reachable because the engine is in-process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


@torch.no_grad()
def sync_weights(llm, model: PreTrainedModel) -> None:
    """Copy the trainer's current weights into vLLM in place (merged, under LoRA), then drop
    cached prefixes (their KV entries were computed with the old weights). A sleeping
    engine's weights are woken first: loading into released memory would be lost silently."""
    wake(llm, "weights")
    engine = engine_model(llm)
    engine.load_weights(merged_weights(model))
    for layer in engine.modules():
        if hasattr(layer, "repack"):  # CPU: vLLM's packed copies made again from the new weights
            layer.repack()
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------
# evaluation: greedy decoding on the held-out split
# ---------------------------------------------------------------------------------------

def evaluate(llm, tokenizer, task, max_new_tokens: int, chat_template: bool = True,
             system_prompt: str | None = None) -> dict:
    """Greedy accuracy (reward >= 1) and mean reward on the task's eval split, through vLLM.

    Prompts are encoded and completions stopped as in training: pass the same
    chat_template / system_prompt as to encode_prompts (stop tokens: stop_token_ids).
    Under torchrun rank 0 evaluates (the numbers of one process) and every rank gets them."""
    return dist.on_main(_evaluate, llm, tokenizer, task, max_new_tokens, chat_template, system_prompt)


def _evaluate(llm, tokenizer, task, max_new_tokens: int, chat_template: bool, system_prompt: str | None) -> dict:
    from vllm import SamplingParams  # imported here: the tasks themselves need no vLLM

    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in task.eval], chat_template, system_prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    with awake(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
    rewards = [task.reward(o.outputs[0].text, e) for o, e in zip(outputs, task.eval)]
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards)}


def sampled_logprobs(completions, num_completion_tokens: int, device) -> torch.Tensor:
    """vLLM's own log-probs of the tokens it sampled (processed: after temperature), [B, C], 0 on padding."""
    out = torch.zeros(len(completions), num_completion_tokens, device=device)
    for i, c in enumerate(completions):
        out[i, :len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return out


def sampling_params(args, tokenizer):
    """The rollout's vLLM sampling: n = --completions-per-prompt completions of each prompt at
    --temperature, at most --max-new-tokens, with the sampled token's log-prob; a completion ends
    at EOS or at the chat template's end-of-turn token (which stays in its loss mask). Never a
    per-request seed: the engine is seeded once."""
    from vllm import SamplingParams

    return SamplingParams(n=args.completions_per_prompt, temperature=args.temperature,
                          max_tokens=args.max_new_tokens, logprobs=0, stop_token_ids=stop_token_ids(tokenizer))
