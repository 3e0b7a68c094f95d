"""ppo.py: GAE, the per-token reward layout, the clipped value loss, whitening, the reward
model, and checkpoint/resume of the critic with its optimizer state."""

import math
import re

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

import ppo
from common import dist
from common.rewards import reward_model_scores
from tests.conftest import TINY_MODEL, read_optimizer_state
from tests.test_grpo_e2e import SMALL, STEP_METRICS, read_metrics

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second completion is one token shorter


def test_gae_by_hand():
    token_rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 0.5, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, 9.0]])  # 9.0 sits on padding: must be ignored
    advantages, returns = ppo.compute_advantages(token_rewards, values, MASK, gamma=0.9, lam=0.5)
    # row 0: deltas -0.04, -0.33, 0.7 (the last token is terminal: no V after it)
    #   A_2 = 0.7; A_1 = -0.33 + 0.45 * 0.7 = -0.015; A_0 = -0.04 + 0.45 * -0.015 = -0.04675
    # row 1: deltas -0.11, 0.4; A_1 = 0.4; A_0 = -0.11 + 0.45 * 0.4 = 0.07; padding 0
    expected = torch.tensor([[-0.04675, -0.015, 0.7], [0.07, 0.4, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values * MASK)


def test_gae_lambda_limits():
    torch.manual_seed(0)
    token_rewards, values = torch.randn(2, 3) * MASK, torch.randn(2, 3)
    # lambda = 1, gamma = 1: A_t = (sum of rewards from t on) - V_t, the Monte-Carlo advantage
    advantages, returns = ppo.compute_advantages(token_rewards, values, MASK, gamma=1.0, lam=1.0)
    reward_to_go = token_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(advantages, (reward_to_go - values) * MASK)
    torch.testing.assert_close(returns, reward_to_go * MASK)
    # lambda = 0: A_t = delta_t = r_t + gamma V_{t+1} - V_t, with V = 0 after the last token
    advantages, _ = ppo.compute_advantages(token_rewards, values, MASK, gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:] * MASK[:, 1:], torch.zeros(2, 1)], dim=1)
    torch.testing.assert_close(advantages, (token_rewards + 0.9 * next_values - values) * MASK)


def test_token_rewards_layout():
    kl = torch.tensor([[0.2, -0.1, 0.4], [0.3, 0.5, 7.0], [1.0, 1.0, 1.0]])
    mask = torch.cat([MASK, torch.zeros(1, 3)])  # the third completion is fully masked out
    r = ppo.compute_token_rewards(torch.tensor([1.0, 0.5, 3.0]), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.02, 0.01, -0.04 + 1.0], [-0.03, -0.05 + 0.5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(r, expected)


@pytest.mark.parametrize("value,loss,grad", [
    (0.1, 0.5 * 0.9 ** 2, 0.1 - 1.0),   # inside the clip range: plain 0.5 (V - R)^2
    (0.5, 0.5 * 0.8 ** 2, 0.0),         # moved past V_old + 0.2 towards R: the clipped error is larger, no gradient
    (-0.5, 0.5 * 1.5 ** 2, -0.5 - 1.0),  # moved past V_old - 0.2 away from R: the unclipped error is larger
])
def test_clipped_value_loss(value, loss, grad):
    """V_old = 0, return 1, vf_clip 0.2; zero advantages leave only the value term."""
    args = ppo.Args(vf_coef=1.0, vf_clip=0.2, loss_agg="token-mean")
    values = torch.tensor([[value]], requires_grad=True)
    zeros, ones = torch.zeros(1, 1), torch.ones(1, 1)
    total, stats = ppo.compute_loss(zeros, zeros, zeros, values, zeros, ones, 1.0, ones, args, 1, 1)
    total.backward()
    assert total.item() == pytest.approx(loss)
    assert values.grad.item() == pytest.approx(grad)
    assert stats["value/clip_frac"].item() == (1.0 if grad == 0.0 else 0.0)


def test_policy_loss_is_the_clipped_surrogate():
    args = ppo.Args(vf_coef=0.0, eps_low=0.2, eps_high=0.2, loss_agg="token-mean")
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    ones = torch.ones(1, 3)
    loss, stats = ppo.compute_loss(logprobs, old, advantages, old, old, old, 1.0, ones, args, 3, 1)
    # ratios 1.5 (A>0: clipped to 1.2), 0.5 (A<0: clipped to 0.8), 1.1 (unclipped)
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3)
    loss.backward()
    # clipped tokens get no gradient; d(-r A / 3)/dlogp = -r A / 3 on the unclipped one
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1 * 2.0 / 3]]))
    assert stats["policy/clip_frac"].item() == pytest.approx(2 / 3)


def test_adaptive_kl_controller():
    fixed = ppo.Args(kl_coef=0.1)
    assert ppo.update_kl_coef(0.1, 50.0, 64, fixed) == 0.1  # no --target-kl: beta stays
    args = ppo.Args(kl_coef=0.1, target_kl=1.0, kl_horizon=1000)
    # the proportional error is clipped to +-0.2, scaled by the batch's share of the horizon
    assert ppo.update_kl_coef(0.1, 50.0, 64, args) == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    assert ppo.update_kl_coef(0.1, 0.0, 64, args) == pytest.approx(0.1 * (1 - 0.2 * 64 / 1000))
    assert ppo.update_kl_coef(0.1, 1.1, 64, args) == pytest.approx(0.1 * (1 + 0.1 * 64 / 1000))


def test_whiten_under_a_mask():
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, 100.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    s = math.sqrt(1.5)  # mean 2, population variance 2/3 over the three masked-in entries
    expected = torch.tensor([[-s, 0.0, s], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(dist.whiten(values, mask), expected, atol=1e-6, rtol=1e-6)


def make_reward_model(path, tokenizer):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128)
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores clearly different per text
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_reward_model_score_reaches_the_last_completion_token(tmp_path, tokenizer):
    rm = make_reward_model(tmp_path / "rm", tokenizer).eval()
    texts = ["sort 321:123", "sort 54:45", "sort 98765:56789<|im_end|>"]
    scores = reward_model_scores(rm, tokenizer, texts, "cpu", micro_batch_size=2)  # 2 micro-batches
    # each text alone through the model's own pooled head (no padding anywhere)
    with torch.no_grad():
        alone = torch.stack([rm(**tokenizer(t, return_tensors="pt")).logits[0, 0] for t in texts])
    torch.testing.assert_close(scores, alone)
    assert scores.unique().numel() == 3
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    token_rewards = ppo.compute_token_rewards(scores, torch.zeros(3, 4), mask, kl_coef=0.1)
    last = [2, 1, 3]
    for i in range(3):
        assert token_rewards[i, last[i]] == scores[i]
        assert token_rewards[i].abs().sum() == scores[i].abs()  # nowhere else


def test_reward_model_reads_one_bos_only(tmp_path):
    """A reward-model tokenizer that adds BOS, and a text that starts with one (a decoded prompt):
    the text is scored with a single BOS, as the reward model was trained."""
    from tests.test_chat import model_copy

    rm_tokenizer = AutoTokenizer.from_pretrained(model_copy(tmp_path / "bos", None, bos_post_processor=True))
    assert rm_tokenizer("x")["input_ids"][0] == rm_tokenizer.bos_token_id
    rm = make_reward_model(tmp_path / "rm", rm_tokenizer).eval()
    score = reward_model_scores(rm, rm_tokenizer, [rm_tokenizer.bos_token + "sort 321:123"], "cpu", 4)
    with torch.no_grad():
        one_bos = rm(**rm_tokenizer("sort 321:123", return_tensors="pt")).logits[0, 0]
        two_bos = rm(**rm_tokenizer(rm_tokenizer.bos_token + "sort 321:123", return_tensors="pt")).logits[0, 0]
    torch.testing.assert_close(score[0], one_bos)
    assert not torch.isclose(one_bos, two_bos)


def test_critic_starts_at_zero_and_reads_the_state_before_each_token(tokenizer):
    critic = ppo.load_critic(TINY_MODEL, tokenizer, "float32", "cpu")
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 13]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert ppo.forward_values(critic, input_ids, attention_mask, 2).abs().max() == 0.0
    torch.nn.init.normal_(critic.score.weight)
    values = ppo.forward_values(critic, input_ids, attention_mask, 2)
    # V for completion token j is read at the column before it: dropping the last token changes nothing
    truncated = ppo.forward_values(critic, input_ids[:, :-1], attention_mask[:, :-1], 1)
    torch.testing.assert_close(values[:, :1], truncated)


def test_a_reward_model_without_a_trained_score_head_is_refused(tmp_path, tokenizer):
    """A causal LM loads as a sequence classifier too, with a new, random score head (transformers
    reports it MISSING): PPO would train against noise. Refused in check, before anything heavy;
    a saved reward model passes."""
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--reward-model '.*tiny-sort' has no trained score head: its checkpoint "
                                          r"lacks score.weight"):
        ppo.check(ppo.Args(reward_model=TINY_MODEL))
    make_reward_model(tmp_path / "rm", tokenizer)
    ppo.check(ppo.Args(reward_model=str(tmp_path / "rm")))


PPO_METRICS = ["loss/value", "loss/policy", "value/explained_variance", "value/clip_frac", "kl/token_mean",
               "reward/shaped_mean", "policy/approx_kl", "optim/critic_grad_norm"]


def test_ppo_with_reward_model_and_resume(tmp_path, tokenizer, run_main):
    make_reward_model(tmp_path / "rm", tokenizer)
    out = tmp_path / "run"
    run_main("ppo.py", "--steps", "2", "--save-every", "1", "--eval-every", "0", "--output-dir", out,
             "--reward-model", tmp_path / "rm", *SMALL)
    metrics = read_metrics(out)
    for m in metrics[1:]:
        assert all(k in m and math.isfinite(m[k]) for k in STEP_METRICS + PPO_METRICS + ["reward/correct_mean"]), m
    # the training reward is the reward model's score, not the verifier's 0/1
    assert any(m["reward/mean"] not in (0.0, 1.0) for m in metrics[1:])

    step_1 = out / "checkpoints" / "step_1"
    critic_1 = AutoModelForSequenceClassification.from_pretrained(step_1 / "critic").score.weight
    assert critic_1.abs().sum() > 0, "the saved critic is the trained one (its head started at zero)"
    state_1 = torch.load(step_1 / "trainer_state.pt", weights_only=False)
    num_critic = len(list(AutoModelForSequenceClassification.from_pretrained(step_1 / "critic").parameters()))
    groups = read_optimizer_state(step_1)["param_groups"]
    assert len(groups) == 2  # policy and critic
    assert len(groups[1]["params"]) == num_critic and all(n.startswith("critic.") for n in groups[1]["params"])

    # the critic's head starts at zero: step 1's values are exactly 0, later ones are not
    assert metrics[1]["value/mean"] == 0.0 and metrics[2]["value/mean"] != 0.0

    # resume from step 1 into a new folder (the run's flags are restored): step 2's values come
    # from the saved critic (a new one would give 0) and Adam continues its step count
    # (2 minibatches per step: 4 after step 2, not 2)
    again = tmp_path / "again"
    run_main("ppo.py", "--resume", step_1, "--output-dir", again)
    resumed = read_metrics(again)
    assert [m["step"] for m in resumed] == [2] and resumed[0]["value/mean"] != 0.0
    state_2 = torch.load(again / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert all(s["step"] == 4 for s in read_optimizer_state(again / "checkpoints" / "step_2")["state"].values())
    assert state_2["kl_coef"] == state_1["kl_coef"] == 0.05


@pytest.mark.parametrize("flags,message", [
    (["--reward-model", "./no-such-rm"], "--reward-model: model path './no-such-rm' does not exist"),
    (["--critic-model", "./no-such-critic"], "--critic-model: model path './no-such-critic' does not exist"),
    (["--lam", "1.5"], "--gamma and --lam must be in [0, 1]"),
    (["--vf-clip", "0"], "--vf-clip > 0"),
    (["--target-kl", "-1"], "--target-kl must be positive"),
])
def test_bad_input(flags, message):
    from common.errors import ConfigError
    from common.args import parse_args

    with pytest.raises(ConfigError, match=re.escape(message)):
        ppo.main(parse_args(ppo.Args, flags))
