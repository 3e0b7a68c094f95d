"""Models beyond Llama/Qwen: LoRA's default targets (peft's all-linear) on GPT-NeoX and Phi-3's
names, fused layers included; and the models vLLM cannot run, refused (or, under --engine auto,
given to the transformers engine) before anything starts, in one line naming --engine transformers."""

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from common.errors import ConfigError
from common.models import load_policy
from common.setup import check_engine
from tests.conftest import ROOT, TINY_MODEL, needs_vllm, pythonpath


def tiny(tmp_path, config) -> str:
    """A random-weight model of this config with the tiny tokenizer, saved as a model folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path / config.model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY_MODEL, name), path / name)
    return str(path)


def neox(vocab_size: int):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, max_position_embeddings=128, architectures=["GPTNeoXForCausalLM"])


def phi3(vocab_size: int):
    from transformers import Phi3Config

    return Phi3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0,
                      architectures=["Phi3ForCausalLM"])


@pytest.mark.parametrize("config, adapted", [
    (neox, ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]),
    (phi3, ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),
], ids=["gpt-neox", "phi-3"])
def test_lora_adapts_every_linear_layer_of_the_blocks_by_default(tmp_path, tokenizer, capsys, config, adapted):
    """The default --lora-target-modules, all-linear: GPT-NeoX's names (the Llama names were refused) and
    Phi-3's fused qkv_proj / gate_up_proj (the Llama names put adapters on o_proj and down_proj only);
    never the output layer; the start says which modules and how many parameters train."""
    import grpo

    path = tiny(tmp_path, config(len(tokenizer)))
    policy = load_policy(path, tokenizer, lora_rank=4, lora_target_modules=grpo.Args().lora_target_modules)
    names = [name for name, m in policy.named_modules() if hasattr(m, "lora_A")]
    assert sorted({n.rpartition(".")[2] for n in names}) == adapted and len(names) == 2 * len(adapted)
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert trained == sum(4 * (m.in_features + m.out_features) for _, m in policy.named_modules()
                          if hasattr(m, "lora_A") for m in [m.base_layer])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"LoRA: adapters on {', '.join(adapted)} ({len(names)} layers); {trained:,} of ")


def config_of(arch: str, **fields):
    from transformers import AutoConfig

    model_type = {"GPTNeoXForCausalLM": "gpt_neox", "Olmo2ForCausalLM": "olmo2", "CTRLLMHeadModel": "ctrl",
                  "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[arch]
    return AutoConfig.for_model(model_type, architectures=[arch], **fields)


@needs_vllm
@pytest.mark.parametrize("arch", ["GPTNeoXForCausalLM", "Olmo2ForCausalLM", "CTRLLMHeadModel"])
def test_a_model_vllm_runs_only_through_its_transformers_backend_is_refused(arch):
    args = SimpleNamespace(engine="vllm", engine_choice=None, model="m", device="cpu")
    with pytest.raises(ConfigError, match=rf"^--engine vllm cannot run --model 'm': vLLM has no implementation of "
                                          rf"its own for {arch} \(its Transformers backend breaks the trainer's "
                                          rf"model\); run it with --engine transformers$"):
        check_engine(args, config_of(arch))
    auto = SimpleNamespace(engine="vllm", engine_choice="--engine auto: vllm (vLLM is installed), --device cpu",
                           model="m", device="cpu")
    check_engine(auto, config_of(arch))
    assert auto.engine == "transformers" and auto.engine_choice.startswith(
        f"--engine auto: transformers (vLLM has no implementation of its own for {arch} ")


@needs_vllm
def test_a_head_size_vllms_cpu_attention_lacks_is_refused_on_cpu_only():
    """head_dim 16 (64 / 4 heads): vLLM's CPU backend would fail after start-up; CUDA's kernels take it."""
    small_heads = config_of("LlamaForCausalLM", hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    args = SimpleNamespace(engine="vllm", engine_choice=None, model="m", device="cpu")
    with pytest.raises(ConfigError, match=r"^--engine vllm cannot run --model 'm': vLLM's CPU attention has no head "
                                          r"size 16 \(it has 32, 64, .*\); run it with --engine transformers$"):
        check_engine(args, small_heads)
    check_engine(SimpleNamespace(**{**vars(args), "device": "cuda"}), small_heads)
    check_engine(args, config_of("Qwen2ForCausalLM", hidden_size=128, num_attention_heads=2))  # head 64: runs
    check_engine(SimpleNamespace(**{**vars(args), "engine": "transformers"}), small_heads)  # no vLLM: no check


@needs_vllm
def test_from_the_command_line_refused_in_one_line_before_vllm_starts_and_auto_runs_it(tmp_path, tokenizer):
    path = tiny(tmp_path, neox(len(tokenizer)))
    flags = ["--model", path, "--steps", "1", "--prompts-per-step", "2", "--completions-per-prompt", "2",
             "--num-minibatches", "1", "--eval-every", "0", "--save-every", "0"]
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    r = subprocess.run([sys.executable, "grpo.py", "--engine", "vllm", *flags, "--output-dir", str(tmp_path / "a")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"error: --engine vllm cannot run --model {path!r}: vLLM has no implementation of its own for "
        "GPTNeoXForCausalLM (its Transformers backend breaks the trainer's model); run it with --engine transformers")
    assert not (tmp_path / "a").exists()
    r = subprocess.run([sys.executable, "grpo.py", *flags, "--output-dir", str(tmp_path / "b")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "--engine auto: transformers (vLLM has no implementation of its own for GPTNeoXForCausalLM" in r.stdout
    assert (tmp_path / "b" / "final").is_dir()
