"""reinforce.py, rloo.py, gspo.py, cispo.py, sapo.py: each algorithm's math against hand computations,
and the central claim of the policy-gradient lecture: a baseline keeps the expected
gradient and lowers its variance."""

import math

import pytest
import torch

import cispo
import gspo
import reinforce
import rloo
import sapo
from common.ops import kl_penalty


# ------------------------------------------------------------------------------- RLOO
def test_rloo_seed_example():
    """K = 4, rewards [0.8, 0.3, 0.6, 0.5]: 1 reinforced, 2 suppressed, 3 and 4 small."""
    rewards = torch.tensor([0.8, 0.3, 0.6, 0.5])
    mask = torch.ones(4, 3)
    returns = reinforce.compute_returns(rewards, torch.zeros(4, 3), mask, kl_coef=0.0)
    advantages, baselines = rloo.compute_advantages(returns, mask, group_size=4)
    expected = torch.tensor([0.8 - 1.4 / 3, 0.3 - 1.9 / 3, 0.6 - 1.6 / 3, 0.5 - 1.7 / 3])  # 1/3, -1/3, 1/15, -1/15
    torch.testing.assert_close(advantages, expected.unsqueeze(1).expand(4, 3))
    torch.testing.assert_close(baselines.squeeze(1), torch.tensor([1.4, 1.9, 1.6, 1.7]) / 3)


def test_rloo_groups_are_separate_and_padding_gets_nothing():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]).float()
    returns = reinforce.compute_returns(rewards, torch.zeros(4, 2), mask, 0.0)
    advantages, _ = rloo.compute_advantages(returns, mask, group_size=2)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


# -------------------------------------------------------------------------- REINFORCE
def test_returns_are_reward_to_go_of_the_kl_penalty():
    rewards = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    returns = reinforce.compute_returns(rewards, kl, mask, kl_coef=0.5)
    expected = torch.tensor([[1 - 0.5 * 0.6, 1 - 0.5 * 0.5, 1 - 0.5 * 0.3], [2 - 0.5 * 1.0, 2 - 0.5 * 0.5, 2.0]])
    torch.testing.assert_close(returns, expected)


def test_kl_estimators():
    old, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = old - ref  # log pi_old / pi_ref
    torch.testing.assert_close(kl_penalty(old, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(old, ref, "k2"), d ** 2 / 2)
    torch.testing.assert_close(kl_penalty(old, ref, "k3"), torch.exp(-d) + d - 1)


def test_moving_average_baseline_over_several_steps():
    args = reinforce.Args(baseline="moving-average", baseline_decay=0.5)
    state, used = None, []
    for batch_mean in [1.0, 3.0, 0.0, 2.0]:
        returns = torch.full((4, 2), batch_mean)
        b, state = reinforce.update_baseline(state, returns, args)
        used.append(b)
    # first batch: its own mean; then b_k = 0.5 b_{k-1} + 0.5 mean_{k-1} (past batches only)
    assert used == pytest.approx([1.0, 1.0, 2.0, 1.0])
    assert state == pytest.approx(1.5)
    assert reinforce.update_baseline(None, torch.full((2, 1), 7.0), reinforce.Args(baseline="none"))[0] == 0.0
    assert reinforce.update_baseline(None, torch.tensor([[1.0], [3.0]]), reinforce.Args())[0] == 2.0


def test_reinforce_loss_is_advantage_weighted_log_likelihood():
    args = reinforce.Args(loss_agg="seq-mean-token-sum")
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    advantages = torch.tensor([[2.0, 2.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = reinforce.compute_loss(logprobs, advantages, 1.0, mask, args, 3, 2)
    assert loss.item() == pytest.approx(-(2 * -3.0 + -1 * -0.5) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0], [0.5, 0.0]]))


# ------------------------------------------------------------------------------- GSPO
def gspo_loss(logprobs, old, adv, mask, **kw):
    args = gspo.Args(kl_coef=0.0, **kw)
    return gspo.compute_loss(logprobs, old, None, adv, torch.ones_like(logprobs), mask, args, mask.sum(), logprobs.shape[0])


def test_gspo_sequence_ratio_is_the_geometric_mean_over_each_length():
    token_ratios = [[1.5, 0.8, 1.1, 1.0], [2.0, 0.5, 1.0, 1.0]]  # second sequence has 2 real tokens
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logprobs = torch.log(torch.tensor(token_ratios)).requires_grad_()
    old = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = gspo_loss(logprobs, old, adv, mask, eps_low=10.0, eps_high=10.0)  # no clipping
    s1 = (1.5 * 0.8 * 1.1 * 1.0) ** (1 / 4)
    s2 = (2.0 * 0.5) ** (1 / 2)
    assert loss.item() == pytest.approx((-s1 * 1.0 + s2 * 1.0) / 2, rel=1e-5)
    loss.backward()
    # d s_i / d logp_t = s_i / |y_i| on the real tokens, 0 on padding
    torch.testing.assert_close(logprobs.grad[0], torch.full((4,), -s1 / 4 / 2))
    torch.testing.assert_close(logprobs.grad[1], torch.tensor([s2 / 2 / 2, s2 / 2 / 2, 0.0, 0.0]))


@pytest.mark.parametrize("log_s,adv,clipped", [
    (math.log(1 + 5e-4), 1.0, True),     # above 1 + eps_high with A > 0
    (math.log(1 + 2e-4), 1.0, False),    # inside
    (math.log(1 - 5e-4), -1.0, True),    # below 1 - eps_low with A < 0
    (math.log(1 - 5e-4), 1.0, False),    # below, but A > 0: the pessimistic bound is unclipped
])
def test_gspo_clips_whole_sequences_at_the_paper_bounds(log_s, adv, clipped):
    logprobs = torch.full((1, 3), log_s, requires_grad=True)  # every token ratio = s, so s_i = s
    loss, stats = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([adv]), torch.ones(1, 3))
    s = math.exp(log_s)
    bound = min(max(s, 1 - 3e-4), 1 + 4e-4)
    assert loss.item() == pytest.approx(-min(s * adv, bound * adv), rel=1e-6)
    loss.backward()
    assert (logprobs.grad.abs().sum().item() == 0.0) == clipped
    assert stats["policy/clip_frac"].item() == float(clipped)


# ------------------------------------------------------------------------------ CISPO
def test_cispo_gradient_flows_through_every_token_with_capped_detached_weight():
    args = cispo.Args(kl_coef=0.0, eps_low=1.0, eps_high=0.28, loss_agg="token-mean")
    ratios = torch.tensor([[0.1, 1.0, 1.2, 3.0]])  # far below, inside, inside, far above
    logprobs = torch.log(ratios).requires_grad_()
    old = torch.zeros(1, 4)
    A = 2.0
    loss, stats = cispo.compute_loss(logprobs, old, None, torch.tensor([A]), 1.0, torch.ones(1, 4), args, 4, 1)
    weights = torch.tensor([0.1, 1.0, 1.2, 1.28])  # capped at 1 + eps_high, no lower bound
    assert loss.item() == pytest.approx((-(weights * A * torch.log(ratios)).sum() / 4).item(), rel=1e-6)
    loss.backward()
    # d/d logp_t of -sg(w_t) A logp_t = -w_t A: no zero gradients (unlike GRPO at ratio 3.0),
    # and no gradient through the weight itself (which would add -w_t A logp_t for w = r)
    torch.testing.assert_close(logprobs.grad[0], -weights * A / 4)
    assert (logprobs.grad != 0).all()
    assert stats["policy/clip_frac"].item() == pytest.approx(0.25)


# ------------------------------------------------- the baseline: same mean, less variance
def test_baseline_keeps_the_expected_gradient_and_lowers_its_variance():
    """A 4-armed bandit with all-positive rewards, policy softmax(theta). Estimate the policy
    gradient 3000 times from batches of 8 with the scripts' own estimators and compare
    with the exact gradient of E[R]."""
    torch.manual_seed(0)
    theta0 = torch.tensor([0.5, -0.2, 0.1, 0.0])
    arm_rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    probs = torch.softmax(theta0, 0)
    exact = probs * (arm_rewards - (probs * arm_rewards).sum())  # d E[R] / d theta

    def estimates(advantage_fn, n=3000, batch=8):
        out = []
        for _ in range(n):
            theta = theta0.clone().requires_grad_()
            arms = torch.multinomial(probs, batch, replacement=True)
            logprobs = torch.log_softmax(theta, 0)[arms].unsqueeze(1)  # one "token" per episode
            mask = torch.ones(batch, 1)
            returns = reinforce.compute_returns(arm_rewards[arms], torch.zeros(batch, 1), mask, 0.0)
            loss, _ = reinforce.compute_loss(logprobs, advantage_fn(returns, mask), 1.0, mask,
                                             reinforce.Args(loss_agg="seq-mean-token-sum"), batch, batch)
            out.append(-torch.autograd.grad(loss, theta)[0])  # gradient of the objective
        return torch.stack(out)

    no_baseline = estimates(lambda G, m: reinforce.compute_advantages(G, m, 0.0))
    loo = estimates(lambda G, m: rloo.compute_advantages(G, m, group_size=8)[0])
    for est in (no_baseline, loo):  # both unbiased: the mean is within 4 standard errors
        se = est.std(0) / math.sqrt(len(est))
        assert ((est.mean(0) - exact).abs() < 4 * se + 1e-4).all(), (est.mean(0), exact)
    var_none, var_loo = no_baseline.var(0).sum().item(), loo.var(0).sum().item()
    assert var_loo < 0.25 * var_none, (var_loo, var_none)


def test_sapo_soft_gate_loss_and_gradient_by_hand():
    """Ratios [1, 1.5, 0.5] with A = 2 (tau_pos 1) and [1, 3, padding] with A = -1 (tau_neg 1.05),
    token-mean over the 5 tokens: loss = -sum_t f(r_t) A_i / 5 with f(r) = (4 / tau) sigmoid(tau (r - 1)),
    and d loss / d logp_t = -4 s (1 - s) r_t A_i / 5: GRPO's -A_i / 5 at r = 1, less off-policy."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    ratios = [[1.0, 1.5, 0.5], [1.0, 3.0, 1.0]]
    logprobs = torch.tensor(ratios).log().requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    args = sapo.Args(loss_agg="token-mean")
    loss, stats = sapo.compute_loss(logprobs, torch.zeros(2, 3), None, torch.tensor([2.0, -1.0]), torch.ones(2, 3),
                                    mask, args, mask.sum(), 2)
    # row 1: sigmoid(x) + sigmoid(-x) = 1, so f(1.5) + f(0.5) = 4 and the row's sum is 2 + 4 = 6
    row2 = (4 / 1.05) * (sig(0.0) + sig(1.05 * 2.0))
    assert loss.item() == pytest.approx(-(2.0 * 6.0 - 1.0 * row2) / 5, rel=1e-6)
    assert loss.item() == pytest.approx(-1.340264, rel=1e-5)
    grad = torch.autograd.grad(loss, logprobs)[0]
    expected = [[-4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r * A / 5 if m else 0.0
                 for r, m in zip(rs, ms)] for rs, ms, A, tau in zip(ratios, mask.tolist(), (2.0, -1.0), (1.0, 1.05))]
    torch.testing.assert_close(grad, torch.tensor(expected))
    assert grad[0, 0].item() == pytest.approx(-2.0 / 5) and grad[1, 0].item() == pytest.approx(1.0 / 5)  # GRPO's
    assert 0 < grad[1, 1].item() < 1.0 / 5 * 3.0 * 0.5  # r = 3: far below the unclipped 3/5, yet not zero
    gates = [sig(t * (r - 1)) for r, t in [(1, 1), (1.5, 1), (0.5, 1), (1, 1.05), (3, 1.05)]]
    assert stats["policy/gate_weight"].item() == pytest.approx(sum(4 * s * (1 - s) for s in gates) / 5, rel=1e-6)
