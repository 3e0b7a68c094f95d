"""dapo.py's own parts: the soft overlong penalty at its boundaries, dynamic sampling's group
filter, and short runs through real vLLM (the metrics, a capped step with a kept batch that
num_minibatches does not divide, a step that keeps no group)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import dapo
from common.args import parse_args
from common.errors import ConfigError
from common.setup import prepare
from dapo import keep_groups, overlong_penalty
from tests.conftest import TINY_MODEL
from tests.test_grpo_e2e import SMALL, STEP_METRICS, read_metrics


def test_overlong_penalty_hand_computed():
    # L_max 12, L_cache 4: free up to 8 tokens, then -1/4 per token down to -1 at 12; -1 beyond
    lengths = torch.tensor([0, 1, 7, 8, 9, 10, 11, 12, 13, 20])
    expected = [0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    torch.testing.assert_close(overlong_penalty(lengths, max_len=12, buffer_len=4), torch.tensor(expected))
    # the defaults on sort: L_max 12, L_cache 3; the longest right answer (8 digits and EOS) is 9 tokens, free
    torch.testing.assert_close(overlong_penalty(torch.tensor([9, 10, 11, 12]), 12, 3),
                               torch.tensor([0.0, -1 / 3, -2 / 3, -1.0]))
    # L_cache = L_max: every token counts, -|y| / L_max
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 3, 6]), 6, 6), torch.tensor([0.0, -0.5, -1.0]))
    # 0: off
    assert torch.equal(overlong_penalty(torch.tensor([0, 12, 13]), 12, 0), torch.zeros(3))


def test_keep_groups_drops_the_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0,      # all right: dropped
                            0.0, 1.0, 0.0,      # kept
                            0.0, 0.0, 0.0,      # all wrong: dropped
                            0.5, 0.5, 0.25,     # one differs: kept
                            1.0, 0.75, 1.0,     # all right, one with an overlong penalty: a signal, kept
                            -0.0, 0.0, 0.0])    # -0.0 == 0.0: dropped
    assert keep_groups(rewards, group_size=3).tolist() == [False, True, False, True, True, False]
    assert keep_groups(torch.tensor([0.0, 1.0]), group_size=2).tolist() == [True]
    assert keep_groups(torch.tensor([0.2, 0.2, 0.2, 0.2]), group_size=2).tolist() == [False, False]


def test_run_logs_dynamic_sampling_and_the_overlong_penalty(tmp_path, run_main):
    out = tmp_path / "run"
    args = run_main("dapo.py", "--steps", "2", "--output-dir", out, *SMALL)
    assert args.kl_coef == 0.0 and args.loss_agg == "token-mean" and (args.eps_low, args.eps_high) == (0.2, 0.28)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        # no reference model by default: no kl/ref
        assert all(k in m for k in STEP_METRICS if k != "kl/ref") and "kl/ref" not in m, sorted(m)
        assert m["rollout/sampling_rounds"] in range(1, args.max_sampling_rounds + 1)
        assert 0.0 <= m["rollout/dropped_group_frac"] <= 1.0
        assert 0 <= m["rollout/kept_groups"] <= args.prompts_per_step
        assert -1.0 <= m["reward/overlong_mean"] <= 0.0
        if m["rollout/kept_groups"] < args.prompts_per_step:  # the cap was hit
            assert m["rollout/sampling_rounds"] == args.max_sampling_rounds
        assert m["reward/mean"] == pytest.approx(m["reward/correct_mean"] + m["reward/overlong_mean"], abs=1e-6)
    # the completions written are the kept groups': rewards not all equal within a group of G
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    G = args.completions_per_prompt
    assert len(records) == 2 * args.log_completions and args.log_completions == G
    for step in (1, 2):
        group = [r for r in records if r["step"] == step]
        assert len({r["prompt"] for r in group}) == 1 and len({r["reward"] for r in group}) > 1
        for r in group:
            assert r["reward"] == pytest.approx(r["reward/correct"] + r["reward/overlong"])


@pytest.mark.parametrize("kept", ["none", "first"])
def test_a_capped_step_trains_on_what_it_kept(kept, tmp_path, run_main, monkeypatch, capsys):
    """keep_groups replaced: each round keeps no group, or only its first. Two rounds of 3
    prompts then give no update (said on stderr), or a batch of 2 groups x 4 = 8 rows, which 3
    minibatches split as 3 + 3 + 2: three optimizer steps (split(8 // 3) would make four), seen in
    the warmup's learning rate."""
    def only(group):
        return lambda rewards, group_size: torch.arange(len(rewards) // group_size) == group

    monkeypatch.setattr(dapo, "keep_groups", only(-1 if kept == "none" else 0))
    out = tmp_path / "run"
    args = run_main("dapo.py", "--steps", "1", "--output-dir", out, "--prompts-per-step", "3",
                    "--completions-per-prompt", "4", "--num-minibatches", "3", "--max-sampling-rounds", "2",
                    "--warmup-steps", "10", "--micro-batch-size", "3", "--max-new-tokens", "10")
    m = read_metrics(out)[1]
    assert m["rollout/sampling_rounds"] == 2
    no_update = "step 1: no update: dynamic sampling kept no group with unequal rewards in 2 rounds"
    assert (no_update in capsys.readouterr().err) == (kept == "none")
    if kept == "none":
        assert m["rollout/kept_groups"] == 0 and m["rollout/dropped_group_frac"] == 1.0
        assert "loss/total" not in m and m["optim/lr"] == pytest.approx(args.lr / 11)  # the scheduler never stepped
        final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
        initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
        assert all(torch.equal(final[k], initial[k]) for k in initial), "no update"
    else:
        assert m["rollout/kept_groups"] == 2
        assert m["optim/lr"] == pytest.approx(args.lr * 4 / 11)  # 3 optimizer steps of warmup


def test_kept_groups_are_shared_whole_and_evenly(monkeypatch):
    """N ranks pool the kept groups alike, then each trains on an equal share of the largest
    multiple of N: 5 groups on 2 ranks -> 4, rank 1 gets the 3rd and 4th; one rank keeps all 5."""
    from common import dist

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    assert dist.share_whole(["a", "b", "c", "d", "e"]) == (["c", "d"], 4)
    assert dist.share_whole(["a"]) == ([], 0)
    monkeypatch.setattr(dist, "world_size", lambda: 1)
    monkeypatch.setattr(dist, "rank", lambda: 0)
    assert dist.share_whole(["a", "b", "c", "d", "e"]) == (["a", "b", "c", "d", "e"], 5)


def test_a_reward_term_named_overlong_is_refused(tmp_path):
    """DAPO logs its length penalty as reward/overlong: a term of that name would be overwritten by it."""
    user = tmp_path / "mine.py"
    user.write_text("def overlong(completion, example):\n    return 0.0\n")
    args = parse_args(dapo.Args, ["--model", TINY_MODEL, "--reward", f"{user}:overlong:0.5"])
    with pytest.raises(ConfigError, match="a term named 'overlong' would be mixed up with DAPO's length penalty"):
        prepare(args, dapo.check)
