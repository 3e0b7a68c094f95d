"""LoRA (--lora-rank): only the adapters train, the reference is the base model with the
adapters off (no second copy), vLLM gets the merged weights W + scale * B A, checkpoints hold
the adapters and final/ is a merged model plus the adapter folder."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.engine import sync_weights
from common.models import AdaptersOff, load_policy, load_reference, merged_weights
from tests.conftest import TINY_MODEL, read_optimizer_state
from tests.test_grpo_e2e import SMALL, read_metrics
from tests.test_sync import trainer_logprobs, vllm_prompt_logprobs

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_policy(tokenizer, rank=4):
    torch.manual_seed(0)
    policy = load_policy(TINY_MODEL, tokenizer, "float32", "cpu", lora_rank=rank, lora_alpha=8.0,
                         lora_target_modules=TARGETS)
    with torch.no_grad():  # B starts at 0 (the adapters add nothing): give them something to add
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return policy


def test_only_adapters_are_trainable_and_the_merged_weights_are_w_plus_scaled_ba(tokenizer):
    policy = lora_policy(tokenizer)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
    merged = dict(merged_weights(policy))
    assert set(merged) == {n for n, _ in AutoModelForCausalLM.from_pretrained(TINY_MODEL).named_parameters()}
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + (8.0 / 4) * B @ A)
    assert torch.equal(layer.base_layer.weight, base[name])  # merging for vLLM leaves the trainer's W alone
    name = "model.embed_tokens.weight"  # not adapted: as it is
    assert torch.equal(merged[name], base[name])


def test_sync_with_lora_makes_vllm_match_the_trainer(llm, tokenizer):
    policy = lora_policy(tokenizer)
    ids = tokenizer("sort 52813:12358")["input_ids"] + [tokenizer.eos_token_id]
    plain = load_policy(TINY_MODEL, tokenizer, "float32", "cpu")
    sync_weights(llm, plain)
    assert (vllm_prompt_logprobs(llm, ids) - trainer_logprobs(policy, ids)).abs().max() > 0.05  # adapters matter
    sync_weights(llm, policy)
    assert (vllm_prompt_logprobs(llm, ids) - trainer_logprobs(policy, ids)).abs().max() < 1e-4


def test_the_reference_is_the_base_model_without_a_copy(tokenizer):
    policy = lora_policy(tokenizer)
    ref = load_reference(TINY_MODEL, tokenizer, "float32", "cpu", policy)
    assert isinstance(ref, AdaptersOff) and not list(ref.parameters())  # no weights of its own
    ids = tokenizer("sort 52813:12358")["input_ids"]
    base = trainer_logprobs(load_policy(TINY_MODEL, tokenizer, "float32", "cpu"), ids)
    torch.testing.assert_close(trainer_logprobs(ref, ids), base, atol=1e-6, rtol=1e-6)
    assert (trainer_logprobs(policy, ids) - base).abs().max() > 0.05  # and the policy is not the base


def test_a_lora_run_trains_adapters_saves_them_and_a_merged_final_model(tmp_path, run_main):
    out = tmp_path / "run"
    lora = ["--lora-rank", "8", "--lr", "2e-3"]
    run_main("grpo.py", "--steps", "2", "--save-every", "1", "--eval-every", "0", "--output-dir", out, *lora, *SMALL)
    step_1 = out / "checkpoints" / "step_1"
    assert sorted(p for p in os.listdir(step_1 / "policy") if "adapter" in p) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    assert not (step_1 / "policy" / "model.safetensors").exists()  # the base weights are args.model's
    layers = AutoModelForCausalLM.from_pretrained(TINY_MODEL).config.num_hidden_layers
    lora_tensors = 2 * len(TARGETS) * layers  # A and B of each target module
    moments = read_optimizer_state(step_1)["state"]
    assert len(moments) == lora_tensors and all("lora_" in name for name in moments)  # the adapters' only

    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
    assert json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert set(final) == set(base)  # a plain merged model: no adapter names left
    assert not torch.equal(final["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted

    # resuming loads the adapters from the checkpoint onto the base model
    run_main("grpo.py", "--resume", step_1, "--output-dir", tmp_path / "again")
    metrics = read_metrics(tmp_path / "again")
    assert [m["step"] for m in metrics] == [2] and metrics[0]["kl/ref"] > 0  # adapted from the start


@pytest.mark.slow
def test_a_lora_run_learns_the_default_task(tmp_path, run_main):
    """Rank 16 at lr 2e-3 (full fine-tuning: 2e-4): 0.22 -> 0.93 after 4 steps, measured on the
    project's CPU on 2026-11-30."""
    out = tmp_path / "run"
    run_main("grpo.py", "--lora-rank", "16", "--lr", "2e-3", "--steps", "6", "--eval-every", "6", "--output-dir", out)
    metrics = read_metrics(out)
    assert metrics[-1]["eval/accuracy"] >= metrics[0]["eval/accuracy"] + 0.3, (metrics[0], metrics[-1])


def test_target_modules_that_match_nothing_are_one_line_before_anything_heavy():
    import grpo
    from common.args import parse_args
    from common.errors import ConfigError
    from common.setup import prepare

    args = parse_args(grpo.Args, ["--model", TINY_MODEL, "--lora-rank", "4", "--lora-target-modules", "c_attn", "c_fc"])
    with pytest.raises(ConfigError, match=r"--lora-target-modules c_attn c_fc: Target modules .* not found in the "
                                          r"base model.* linear layers: .*q_proj"):
        prepare(args, grpo.check)
    prepare(parse_args(grpo.Args, ["--model", TINY_MODEL, "--lora-rank", "4"]), grpo.check)  # the defaults match


def test_the_reference_is_the_base_model_also_through_an_adapted_output_layer(tokenizer):
    """forward_logprobs applies the output layer itself (a chunk of positions at a time): the reference of
    a LoRA run (AdaptersOff) must give the base model's log-probs there too, with lm_head adapted as well."""
    from common.ops import forward_logprobs

    torch.manual_seed(0)
    policy = load_policy(TINY_MODEL, tokenizer, "float32", "cpu", lora_rank=4, lora_alpha=8.0,
                         lora_target_modules=(*TARGETS, "lm_head"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    reference, base = load_reference(TINY_MODEL, tokenizer, "float32", "cpu", policy), load_policy(
        TINY_MODEL, tokenizer, "float32", "cpu")
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref, want, adapted = (forward_logprobs(m, ids, mask, 6) for m in (reference, base, policy))
    assert torch.allclose(ref, want, atol=1e-5)
    assert (adapted - want).abs().max() > 1e-2  # the adapters do change the policy
