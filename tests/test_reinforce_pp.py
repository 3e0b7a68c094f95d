"""reinforce_pp.py by hand: the reward-to-go with the per-token KL, less the group baseline, whitened
over the batch's tokens; PPO's clipped surrogate with per-token advantages."""

import math

import pytest
import torch

import reinforce_pp


def test_advantages_whitened_over_the_batch_with_and_without_the_group_baseline():
    """Two prompts, two one-token completions each, R = (1, 0 | 1, 1), no KL."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.ones(4, 1)
    returns = reinforce_pp.compute_returns(rewards, torch.zeros(4, 1), mask, 0.0)
    # none: G = (1, 0, 1, 1), mean 3/4, population std sqrt(3)/4
    none = reinforce_pp.compute_advantages(returns, rewards, mask, "none", 2)
    s = math.sqrt(3) / 4
    torch.testing.assert_close(none[:, 0], torch.tensor([0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s]))
    # group: G - b = (1/2, -1/2, 0, 0), mean 0, std sqrt(1/8): the solved-by-all prompt gets 0
    group = reinforce_pp.compute_advantages(returns, rewards, mask, "group", 2)
    r = math.sqrt(1 / 8)
    torch.testing.assert_close(group[:, 0], torch.tensor([0.5 / r, -0.5 / r, 0.0, 0.0]))


def test_the_kl_penalty_is_a_reward_to_go_per_token():
    """R = 1, beta 0.5, KL = (0.1, 0.2, 0.3) and a padding token: G = (0.7, 0.75, 0.85), then whitened."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0]])
    returns = reinforce_pp.compute_returns(torch.tensor([1.0]), kl, mask, 0.5)
    torch.testing.assert_close(returns[0, :3], torch.tensor([0.7, 0.75, 0.85]))
    A = reinforce_pp.compute_advantages(returns, torch.tensor([1.0]), mask, "none", 1)
    g = torch.tensor([0.7, 0.75, 0.85])
    torch.testing.assert_close(A[0], torch.cat([(g - g.mean()) / g.std(unbiased=False), torch.zeros(1)]),
                               atol=1e-5, rtol=1e-5)


def test_clipped_surrogate_per_token():
    """Tokens with (ratio, A) = (0.9, 1), (1.5, 1), (0.5, -1), (1.5, -1): token-mean over 4; the 2nd and 3rd
    are clipped (no gradient), the others get -r A / 4."""
    args = reinforce_pp.Args(eps_low=0.2, eps_high=0.2)
    ratios = torch.tensor([[0.9, 1.5, 0.5, 1.5]])
    logprobs = ratios.log().requires_grad_()
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = reinforce_pp.compute_loss(logprobs, torch.zeros(1, 4), A, torch.ones(1, 4), torch.ones(1, 4),
                                            args, 4, 1)
    assert loss.item() == pytest.approx((-0.9 - 1.2 + 0.8 + 1.5) / 4, rel=1e-6)
    grad = torch.autograd.grad(loss, logprobs)[0][0]
    torch.testing.assert_close(grad, torch.tensor([-0.9 / 4, 0.0, 0.0, 1.5 / 4]))
    assert stats["policy/clip_frac"].item() == pytest.approx(0.5)


def test_defaults_are_reinforce_plus_plus():
    args = reinforce_pp.Args()
    assert (args.baseline, args.kl_estimator, args.eps_low, args.eps_high) == ("none", "k1", 0.2, 0.2)
