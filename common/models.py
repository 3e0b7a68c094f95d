"""Model loading: the trainer's policy and reference, the vLLM engine, and weight sync.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by each script before
vLLM is imported), so moving the trained weights into it is a plain in-memory copy.
"""

from __future__ import annotations

import copy
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.utils import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_model(name_or_path: str):
    """Fail fast with one clear line if the model can't be found; returns its config.

    A local folder is used as is; anything else is taken as a hub id (org/name)."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise ConfigError(f"model path {name_or_path!r} does not exist")
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(name_or_path))
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load model {name_or_path!r}: not a local folder with a "
                         f"config.json, nor a hub id that can be downloaded ({first_line})") from None


def load_tokenizer(name_or_path: str):
    """The tokenizer, left-padded (prompts end where completions start) with a pad token.

    A pad token equal to EOS would make padding masks hide real EOS tokens, so when the
    tokenizer has no pad token we add a new one instead of reusing EOS."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_policy(name_or_path: str, tokenizer, dtype: str = "float32", device: str | None = None,
                gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The trainable policy, in train mode (dropout off: these models have none enabled)."""
    model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(name_or_path),
                                                 dtype=DTYPES[dtype])
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token we added
    model.to(device or default_device())
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy (the reference policy pi_ref): eval mode, no gradients."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    if getattr(ref, "is_gradient_checkpointing", False):
        ref.gradient_checkpointing_disable()
    return ref


# ---------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------

def _keep_plain_cpu_weights() -> None:
    """CPU only: stop vLLM from packing linear weights into opaque kernels.

    vLLM's CPU backend replaces each linear layer's weight with a packed copy and an
    empty Parameter, after which load_weights() has nothing to write into. Dispatching
    every layer to a plain F.linear keeps ordinary weights that load_weights() updates."""
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


def create_engine(name_or_path: str, seed: int, max_model_len: int, dtype: str = "float32",
                  gpu_memory_utilization: float = 0.3, cpu_kv_cache_gib: int = 1):
    """An in-process vLLM engine for rollouts, seeded once (never per request).

    On CPU the KV cache is sized by cpu_kv_cache_gib (vLLM would take most of the RAM),
    and linear weights are kept plain so that sync_weights() can update them."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vllm: "
                           "weight sync needs the engine in this process")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set,
        # which would leave training in this process on one core.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        _keep_plain_cpu_weights()
    from vllm import LLM

    kwargs = {} if on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}
    return LLM(model=os.path.expanduser(name_or_path), seed=seed, dtype=dtype,
               max_model_len=max_model_len, enable_prefix_caching=True,
               logprobs_mode="processed_logprobs", **kwargs)


def engine_model(llm) -> torch.nn.Module:
    """The engine's own torch model (reachable because the engine is in-process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


@torch.no_grad()
def sync_weights(llm, model: PreTrainedModel) -> None:
    """Copy the trainer's current weights into vLLM in place, then drop cached prefixes
    (their KV entries were computed with the old weights)."""
    engine_model(llm).load_weights((name, p.detach()) for name, p in model.named_parameters())
    llm.reset_prefix_cache()
