"""gmpo.py's loss by hand: the geometric mean of the tokens' clipped ratios, each token clipped in
log space with the sign of its sequence's advantage."""

import math

import pytest
import torch

import gmpo


def loss_and_grad(log_ratios, advantage, eps_low=0.4, eps_high=0.4):
    """One completion at old log-probs 0: its loss and d loss / d logprob."""
    args = gmpo.Args(eps_low=eps_low, eps_high=eps_high, kl_coef=0.0)
    logprobs = torch.tensor([log_ratios], requires_grad=True)
    mask = torch.ones(1, len(log_ratios))
    loss, stats = gmpo.compute_loss(logprobs, torch.zeros(1, len(log_ratios)), None, torch.tensor([advantage]),
                                    torch.ones(1, len(log_ratios)), mask, args, mask.sum(), 1)
    return loss.item(), torch.autograd.grad(loss, logprobs)[0][0].tolist(), stats["policy/clip_frac"].item()


def test_positive_advantage_clips_a_token_above_its_bound():
    """A = 2, d = (0.1, 0.6, -0.7): l = (0.1, 0.4, -0.7) (only 0.6 is past the bound the advantage pushes
    toward; -0.7 is below the range, kept), s = exp(-0.2 / 3), L = -2 s; tokens 0 and 2 get -2 s / 3."""
    loss, grad, clip_frac = loss_and_grad([0.1, 0.6, -0.7], 2.0)
    s = math.exp((0.1 + 0.4 - 0.7) / 3)
    assert loss == pytest.approx(-2 * s, rel=1e-6)
    assert grad == pytest.approx([-2 * s / 3, 0.0, -2 * s / 3], rel=1e-6)
    assert clip_frac == pytest.approx(1 / 3)


def test_negative_advantage_clips_a_token_below_its_bound():
    """A = -1, d = (0.1, -0.6, 0.7): l = (0.1, -0.4, 0.7), s = exp(0.4 / 3), L = s; tokens 0 and 2 get s / 3."""
    loss, grad, clip_frac = loss_and_grad([0.1, -0.6, 0.7], -1.0)
    s = math.exp((0.1 - 0.4 + 0.7) / 3)
    assert loss == pytest.approx(s, rel=1e-6)
    assert grad == pytest.approx([s / 3, 0.0, s / 3], rel=1e-6)
    assert clip_frac == pytest.approx(1 / 3)


def test_the_bounds_are_per_token_not_per_sequence():
    """d = (0.6, -0.6): the mean log-ratio is 0, inside any range, yet the 0.6 token is clipped (A > 0):
    a sequence-level clip (GSPO's) would pass both tokens' gradients."""
    loss, grad, _ = loss_and_grad([0.6, -0.6], 1.0)
    s = math.exp((0.4 - 0.6) / 2)
    assert loss == pytest.approx(-s, rel=1e-6)
    assert grad == pytest.approx([0.0, -s / 2], rel=1e-6)


def test_the_papers_range_and_no_kl_by_default():
    args = gmpo.Args()
    assert (args.eps_low, args.eps_high, args.kl_coef) == (0.4, 0.4, 0.0)
