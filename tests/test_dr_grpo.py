"""dr_grpo.py's two changes to GRPO, by hand: advantages centered but not divided by the group's
std, and every completion's token sum divided by the generation budget, not by its length."""

import pytest
import torch

import dr_grpo
import grpo


def test_advantages_are_the_rewards_minus_their_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,    # mean 0.25, std 0.5: GRPO would give 1.5 / -0.5
                            2.0, 4.0, 4.0, 6.0])   # mean 4
    adv = dr_grpo.compute_advantages(rewards, 4, dr_grpo.Args().scale_rewards)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, -2.0, 0.0, 0.0, 2.0]))


def loss_and_grad(module, lengths, advantages, max_new_tokens=8):
    """The default loss (no KL) of completions of the given lengths at ratio 1, and d loss / d logprob."""
    args = module.Args(kl_coef=0.0, max_new_tokens=max_new_tokens)
    C = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in lengths])
    logprobs = torch.full((len(lengths), C), -1.0, requires_grad=True)
    loss, _ = module.compute_loss(logprobs, logprobs.detach(), None, torch.tensor(advantages), 1.0, mask, args,
                                  mask.sum(), len(lengths))
    return loss.item(), torch.autograd.grad(loss, logprobs)[0], mask


def test_a_tokens_gradient_does_not_depend_on_its_completions_length():
    """At ratio 1, L = (1/B) sum_i sum_t -A_i / L_max: d L / d logp_t = -A_i / (L_max B) on every token."""
    lengths, A, L_max, B = [1, 4, 6], [1.0, 1.0, -1.0], 8, 3
    loss, grad, mask = loss_and_grad(dr_grpo, lengths, A, L_max)
    assert loss == pytest.approx(-(1 * 1 + 4 * 1 - 6 * 1) / (L_max * B))
    expected = -torch.tensor(A).unsqueeze(1) / (L_max * B) * mask
    torch.testing.assert_close(grad, expected)
    # the same completion, another budget: its tokens' gradient scales with 1 / L_max only
    _, grad16, _ = loss_and_grad(dr_grpo, lengths, A, 16)
    torch.testing.assert_close(grad16, expected / 2)


def test_grpo_weights_a_token_by_one_over_its_completions_length():
    """The bias dr_grpo.py removes: GRPO's default gives -A_i / (|y_i| B), a short answer's tokens weigh more."""
    lengths, A = [1, 4, 6], [1.0, 1.0, -1.0]
    _, grad, mask = loss_and_grad(grpo, lengths, A)
    expected = -torch.tensor(A).unsqueeze(1) / (torch.tensor(lengths, dtype=torch.float).unsqueeze(1) * 3) * mask
    torch.testing.assert_close(grad, expected)
