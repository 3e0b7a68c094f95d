"""grpo.py's algorithm: group advantages, the clipped surrogate in its six cases, k3 KL."""

import math

import pytest
import torch

from grpo import Args, compute_advantages, compute_loss


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,    # group 1: mean 0.5, std (unbiased) sqrt(1/3)
                            0.5, 0.5, 0.5, 0.5])   # group 2: all equal
    adv = compute_advantages(rewards, group_size=4, scale_rewards=True, eps=1e-4)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert torch.isfinite(adv).all()


def test_dr_grpo_advantages_are_centered_only():
    rewards = torch.tensor([3.0, 1.0, 2.0, 7.0, 7.0, 7.0])
    adv = compute_advantages(rewards, group_size=3, scale_rewards=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]))


def one_token_loss(ratio: float, advantage: float, eps_low=0.2, eps_high=0.28):
    """Loss and d loss / d logprob for one token with the given ratio and advantage."""
    args = Args(eps_low=eps_low, eps_high=eps_high, kl_coef=0.0, loss_agg="token-mean")
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    loss, stats = compute_loss(logprobs, old, None, torch.tensor([advantage]), 1.0, torch.ones(1, 1), args, 1, 1)
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats["policy/clip_frac"].item()


@pytest.mark.parametrize("ratio,adv,expected_loss,grad_is_zero", [
    # A > 0: the objective is capped above at (1 + eps_high) A
    (0.5, +1.0, -0.5, False),       # below the range: unclipped, gradient pushes the ratio up
    (1.1, +1.0, -1.1, False),       # inside
    (1.5, +1.0, -1.28, True),       # above 1 + eps_high: clipped, no gradient
    # A < 0: the objective is capped at (1 - eps_low) A
    (0.5, -1.0, 0.8, True),         # below 1 - eps_low: clipped, no gradient
    (0.9, -1.0, 0.9, False),        # inside
    (1.5, -1.0, 1.5, False),        # above: unclipped (pessimistic bound), gradient pushes down
])
def test_clipped_surrogate_six_cases(ratio, adv, expected_loss, grad_is_zero):
    loss, grad, clip_frac = one_token_loss(ratio, adv)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    if grad_is_zero:
        assert grad == 0.0 and clip_frac == 1.0
    else:
        # d(-r A)/d logp = -r A
        assert grad == pytest.approx(-ratio * adv, rel=1e-5) and clip_frac == 0.0


def test_k3_kl_value_and_gradient():
    """KL_t = exp(ref - logp) - (ref - logp) - 1; d KL / d logp = 1 - exp(ref - logp)."""
    args = Args(kl_coef=0.5, loss_agg="token-mean")
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    zero_adv = torch.zeros(1)
    loss, stats = compute_loss(logprobs, logprobs.detach(), ref, zero_adv, 1.0, torch.ones(1, 3), args, 3, 1)
    d = ref - logprobs.detach()
    kl = torch.exp(d) - d - 1
    assert loss.item() == pytest.approx(0.5 * kl.mean().item(), rel=1e-6)
    assert stats["loss/kl"].item() == pytest.approx(kl.mean().item(), rel=1e-6)
    assert kl[0, 2] == 0 and (kl >= 0).all()
    loss.backward()
    torch.testing.assert_close(logprobs.grad, 0.5 * (1 - torch.exp(d)) / 3)


def test_padding_tokens_do_not_contribute():
    args = Args(kl_coef=0.0, loss_agg="token-mean")
    logprobs = torch.tensor([[-1.0, -9.0]], requires_grad=True)
    loss, _ = compute_loss(logprobs, logprobs.detach(), None, torch.tensor([2.0]), 1.0, torch.tensor([[1, 0]]), args, 1, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert logprobs.grad[0, 1] == 0
