"""Numerics that differ between the CPU in fp32 and a GPU in bf16: the truncated importance
weights that correct for vLLM's own numerics (every script), dropout switched off at load,
and the bf16 path (engine in bf16, trainer under bf16 autocast) run on the CPU."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import cispo
import grpo
import gspo
import ppo
import reinforce
import rloo

LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def policy_gradient(script, weights):
    """d loss / d logprobs of one micro-batch at ratio 1 (old = current), without a KL term."""
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    old = logprobs.detach()
    A = torch.tensor([0.5, -1.5])
    n_tokens, n_seqs = MASK.sum(), 2
    if script in (reinforce, rloo):
        args = script.Args(kl_coef=0.0, loss_agg="token-mean")
        loss, _ = script.compute_loss(logprobs, A.unsqueeze(1) * MASK, weights, MASK, args, n_tokens, n_seqs)
    elif script is ppo:
        args = ppo.Args(kl_coef=0.0, loss_agg="token-mean", vf_coef=0.0)
        zeros = torch.zeros_like(old)
        loss, _ = ppo.compute_loss(logprobs, old, A.unsqueeze(1) * MASK, zeros, zeros, zeros, weights, MASK, args,
                                   n_tokens, n_seqs)
    else:
        args = script.Args(kl_coef=0.0, loss_agg="token-mean")
        loss, _ = script.compute_loss(logprobs, old, None, A, weights, MASK, args, n_tokens, n_seqs)
    return torch.autograd.grad(loss, logprobs)[0]


def test_truncated_importance_weight_by_hand():
    """GRPO at ratio 1, token-mean over 5 tokens: loss = -sum_t w_t A_i / 5."""
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 2.0, 9.0]])  # the last one is padding
    grad = policy_gradient(grpo, w)
    expected = -torch.tensor([[2.0 * 0.5, 0.5 * 0.5, 1.0 * 0.5], [1.0 * -1.5, 2.0 * -1.5, 0.0]]) / 5
    assert torch.allclose(grad, expected)


@pytest.mark.parametrize("script", [grpo, cispo, reinforce, rloo, ppo], ids=lambda m: m.__name__)
def test_every_token_level_script_weights_its_policy_gradient(script):
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 1.7, 1.0]])
    unweighted = policy_gradient(script, torch.ones_like(w))
    assert unweighted.abs().sum() > 0
    assert torch.allclose(policy_gradient(script, w), w * unweighted)


def test_gspo_weights_a_sequence_by_the_geometric_mean_of_its_token_weights():
    w = torch.tensor([[2.0, 0.5, 4.0], [3.0, 3.0, 100.0]])  # padding's weight must not count
    seq_weight = torch.tensor([[(2.0 * 0.5 * 4.0) ** (1 / 3)], [3.0]])
    assert torch.allclose(policy_gradient(gspo, w), seq_weight * policy_gradient(gspo, torch.ones_like(w)))


def test_dropout_is_off_whatever_the_config_says(tmp_path, tokenizer):
    """A GPT-2 with every dropout at 0.5 (embeddings, attention, residuals): two passes of the
    loaded policy in train mode, and of ppo's critic, give identical outputs."""
    from common.models import load_policy
    from common.ops import forward_logprobs, make_batch

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, summary_first_dropout=0.5)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["attn_pdrop"] == 0.5
    ids = tokenizer("sort 3141:1134")["input_ids"]
    input_ids, attention_mask, _ = make_batch([ids[:8]], [ids[8:]], tokenizer.pad_token_id, "cpu")

    policy = load_policy(str(tmp_path / "gpt2"), tokenizer, "float32", "cpu").train()
    with torch.no_grad():
        first, second = (forward_logprobs(policy, input_ids, attention_mask, len(ids) - 8) for _ in range(2))
    assert torch.equal(first, second)

    critic = ppo.load_critic(str(tmp_path / "gpt2"), tokenizer, "float32", "cpu").train()
    with torch.no_grad():
        values = [ppo.forward_values(critic, input_ids, attention_mask, len(ids) - 8) for _ in range(2)]
    assert torch.equal(*values)

    # the check has teeth: the same model loaded plainly does drop out
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").train()
    with torch.no_grad():
        assert not torch.equal(plain(input_ids).logits, plain(input_ids).logits)


@pytest.mark.slow
def test_bf16_path_learns_on_the_cpu_with_a_bf16_sized_mismatch(tmp_path):
    """--precision bf16 on the CPU: vLLM in bfloat16, the trainer under bfloat16 autocast
    (fp32 weights), truncated importance sampling on by default: what a GPU runs, as close as
    this machine gets. It learns, and vLLM's log-probs differ from the trainer's by a bf16
    amount (fp32: ~1e-6), which the importance weights then carry."""
    from tests.test_grpo_e2e import read_metrics, run_script

    out = tmp_path / "run"
    r = run_script("grpo.py", "--precision", "bf16", "--steps", "4", "--eval-every", "4", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out)
    mismatch = [m["rollout/logprob_mismatch"] for m in metrics[1:]]
    assert all(1e-4 < x < 0.1 for x in mismatch), mismatch
    assert all(m["rollout/is_weight_mean"] != 1.0 for m in metrics[1:])  # TIS is on: weights differ from 1
    assert metrics[-1]["eval/accuracy"] >= metrics[0]["eval/accuracy"] + 0.3, (metrics[0], metrics[-1])



def update_gradient(script, policy, batch, vllm_logprobs, advantages, old_logprobs=None):
    """One minibatch of the scripts' update over micro-batches of 2, as the scripts write it: with
    old_logprobs from a pass of their own, or (None) from the update's own forward, detached.
    Returns the summed loss and the flattened gradient."""
    from common.ops import forward_logprobs, micro_batches, truncated_is_weights

    input_ids, attention_mask, mask = batch
    B, C = mask.shape
    reuse_forward = old_logprobs is None
    old_logprobs = torch.zeros(B, C) if reuse_forward else old_logprobs
    args = script.Args(loss_agg="token-mean", kl_coef=0.0)
    policy.zero_grad()
    total = 0.0
    for micro, cols, c in micro_batches(torch.randperm(B, generator=torch.Generator().manual_seed(0)),
                                        input_ids, attention_mask, C, 2):
        logprobs = forward_logprobs(policy, input_ids[micro, cols], attention_mask[micro, cols], c, 1.0)
        if reuse_forward:
            old_logprobs[micro, :c] = logprobs.detach()
        weights = truncated_is_weights(old_logprobs[micro, :c], vllm_logprobs[micro, :c], 2.0)
        if script is reinforce:
            loss, _ = script.compute_loss(logprobs, advantages[micro].unsqueeze(1) * mask[micro, :c], weights,
                                          mask[micro, :c], args, mask.sum(), B)
        else:
            loss, _ = script.compute_loss(logprobs, old_logprobs[micro, :c], None, advantages[micro], weights,
                                          mask[micro, :c], args, mask.sum(), B)
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


@pytest.mark.parametrize("script", [grpo, gspo, cispo, reinforce], ids=lambda m: m.__name__)
def test_old_logprobs_from_the_updates_own_forward_give_todays_loss_and_gradient(script, tiny_policy):
    """One epoch, one minibatch: old log-probs taken from the update's forward (detached) instead of
    a pass of their own (batched_logprobs, other micro-batches) give the same loss and gradient, up
    to fp32 rounding (other micro-batches cut the padding elsewhere: ~1e-6 apart)."""
    from common.ops import batched_logprobs, make_batch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (3, 5, 4, 6, 2, 5)]
    completions = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 5, 2)]
    batch = make_batch(prompts, completions, 0, "cpu")
    input_ids, attention_mask, mask = batch
    old_logprobs = batched_logprobs(tiny_policy, input_ids, attention_mask, mask.shape[1], 1.0, 4)
    vllm_logprobs = old_logprobs + 0.3 * torch.randn(old_logprobs.shape, generator=g)  # some weights capped at 2
    advantages = torch.randn(6, generator=g)
    loss, grad = update_gradient(script, tiny_policy, batch, vllm_logprobs, advantages, old_logprobs)
    reused_loss, reused_grad = update_gradient(script, tiny_policy, batch, vllm_logprobs, advantages)
    assert grad.abs().sum() > 0
    assert reused_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert (reused_grad - grad).norm() < 1e-5 * grad.norm()
