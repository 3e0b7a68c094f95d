"""--engine transformers: the trainer's policy samples its own rollouts, with vLLM's calls and
outputs. Its samples are the policy's (log-probs, greedy decoding, the sampling distribution),
each seeded by its place in the whole batch (so N ranks sample what one process samples), and
every script runs and learns with it (tests/test_learning.py)."""

import json
import subprocess
import sys

import pytest
import torch

from common import dist
from common.args import check_args
from common.batch import rollout_batch
from common.engine import SamplingParams, create_engine, sampled_logprobs, sync_weights
from common.errors import ConfigError
from common.models import encode_prompts, load_policy, stop_token_ids
from common.ops import batched_logprobs
from common.scripts import load_script
from tests.conftest import ROOT, TINY_MODEL
from tests.test_grpo_e2e import read_metrics

PROMPTS = ["sort 52813:", "sort 907:", "sort 4410236:", "sort 61:"]


@pytest.fixture()
def engine(tiny_policy):
    llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
    sync_weights(llm, tiny_policy)
    return llm


def prompt_ids(tokenizer, prompts=PROMPTS):
    return encode_prompts(tokenizer, prompts, True, None)


def sample(llm, ids, tokenizer, **params):
    params = SamplingParams(**{"n": 4, "max_tokens": 12, "logprobs": 0, "stop_token_ids": stop_token_ids(tokenizer),
                               **params})
    return [c for out in llm.generate([{"prompt_token_ids": p} for p in ids], params) for c in out.outputs]


def test_samples_carry_the_policys_log_probs_and_end_like_vllms(engine, tiny_policy, tokenizer):
    ids = prompt_ids(tokenizer)
    completions = sample(engine, ids, tokenizer, max_tokens=6)
    assert len(completions) == 16
    stops = set(stop_token_ids(tokenizer))
    for c in completions:  # a stop token ends a completion and is kept; else it runs to max_tokens
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stops) and not stops & set(c.token_ids[:-1])
        assert c.finish_reason == "stop" or len(c.token_ids) == 6
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert mismatch(tiny_policy, ids, completions, tokenizer, 1.0) < 1e-4
    # processed log-probs: after the temperature, as vLLM's
    assert mismatch(tiny_policy, ids, sample(engine, ids, tokenizer, temperature=2.0), tokenizer, 2.0) < 1e-4


def mismatch(policy, ids, completions, tokenizer, temperature: float) -> float:
    """The largest difference between the engine's log-probs of its samples and the trainer's."""
    input_ids, attention_mask, completion_mask, _, _ = rollout_batch(ids, completions, tokenizer.pad_token_id, "cpu")
    C = completion_mask.shape[1]
    trainer = batched_logprobs(policy, input_ids, attention_mask, C, temperature, 64)
    return float(((trainer - sampled_logprobs(completions, C, "cpu")).abs() * completion_mask).max())


def test_greedy_decoding_is_transformers_generate(engine, tiny_policy, tokenizer):
    ids = prompt_ids(tokenizer)
    ours = sample(engine, ids, tokenizer, n=1, temperature=0.0)
    for p, c in zip(ids, ours):
        reference = tiny_policy.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         do_sample=False, max_new_tokens=12, eos_token_id=stop_token_ids(tokenizer),
                                         pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist()
        assert c.token_ids == reference


def test_sampling_follows_the_policys_distribution(engine, tiny_policy, tokenizer):
    ids = prompt_ids(tokenizer, ["sort 52:"])
    first = torch.tensor([c.token_ids[0] for c in sample(engine, ids, tokenizer, n=4000, max_tokens=1)])
    with torch.no_grad():
        probs = torch.softmax(tiny_policy(torch.tensor(ids)).logits[0, -1], -1)
    frequencies = torch.bincount(first, minlength=len(probs)) / len(first)
    assert probs.topk(2).values.min() > 0.3  # "2" or "5" first: a real choice
    assert (frequencies - probs).abs().max() < 0.03  # ~4 standard errors at 4000 samples


def test_each_sample_is_seeded_by_its_place_in_the_whole_batch(engine, tiny_policy, tokenizer, monkeypatch):
    """Two ranks, each with half the prompts, sample what one process samples; the next call
    samples anew, and another seed samples otherwise."""
    ids = prompt_ids(tokenizer)
    whole = [c.token_ids for c in sample(engine, ids, tokenizer)]
    halves = []
    for rank in (0, 1):
        llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
        sync_weights(llm, tiny_policy)
        monkeypatch.setattr(dist, "first_index", lambda count: rank * count)  # rank 0 holds as many rows
        halves += [c.token_ids for c in sample(llm, ids[2 * rank:2 * rank + 2], tokenizer)]  # its share
    assert halves == whole
    monkeypatch.setattr(dist, "first_index", lambda count: 0)
    assert [c.token_ids for c in sample(engine, ids, tokenizer)] != whole
    other = create_engine(TINY_MODEL, seed=1, max_model_len=64, engine="transformers")
    sync_weights(other, tiny_policy)
    assert [c.token_ids for c in sample(other, ids, tokenizer)] != whole


def test_lora_and_gradient_checkpointing_policies_sample_and_stay_in_training(tokenizer):
    policy = load_policy(TINY_MODEL, tokenizer, "float32", "cpu", True, 8, 16.0, ("q_proj", "v_proj"))
    policy.train()
    llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
    sync_weights(llm, policy)
    with torch.no_grad():  # adapters that change the model (B starts at 0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = prompt_ids(tokenizer)
    completions = sample(llm, ids, tokenizer)
    assert len(completions) == 16 and all(c.token_ids for c in completions)
    # sampled with the adapters and the KV cache (in training mode checkpointing would turn the cache off)
    assert mismatch(policy, ids, completions, tokenizer, 1.0) < 1e-4
    assert policy.training


def test_the_vllm_engine_without_vllm_is_one_line(monkeypatch):
    import importlib.util

    args = load_script("grpo.py").Args(engine="vllm")  # asked for explicitly (auto would take transformers)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="--engine transformers"):
        check_args(args, 512, 10, 2)
    args.engine = "transformers"
    check_args(args, 512, 10, 2)


# grpo_multiturn.py: multi-turn episodes on the tiny model (the retry environment answers a wrong turn)
MULTITURN = ["--model", TINY_MODEL, "--task", "sort", "--env", "examples/my_env.py:retry", "--max-new-tokens", "40",
             "--max-turn-tokens", "12"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "grpo_multiturn.py"])
def test_two_processes_sample_the_batch_of_one(tmp_path, script):
    """grpo.py --engine transformers under torchrun (2 CPU processes, FSDP2: the ranks decode in step)
    samples the same rollouts as one process: the same step-1 rewards and lengths (before any
    update) and the same logged completions (rank 0's share: the batch's first prompts); so does
    grpo_multiturn.py, whose ranks decode each turn in step (the same turns per episode too)."""
    from tests.test_dist import SMALL, torchrun

    flags = ["--engine", "transformers", "--steps", "2", "--save-every", "0", "--eval-every", "0",
             "--log-completions", "8", *SMALL, *(MULTITURN if script == "grpo_multiturn.py" else [])]
    one = subprocess.run([sys.executable, script, *flags, "--output-dir", tmp_path / "one"], cwd=ROOT,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(script, *flags, "--output-dir", tmp_path / "two")
    output = two.communicate(timeout=600)[0]
    assert two.returncode == 0, output[-3000:]
    m1, m2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["world_size"] == 2
    assert m1[0]["eval/accuracy"] == m2[0]["eval/accuracy"]
    keys = ("reward/mean", "response/length_mean") + (("env/turns_mean",) if script == "grpo_multiturn.py" else ())
    for key in keys:
        assert m1[1][key] == pytest.approx(m2[1][key], abs=1e-6), key
    assert m2[1]["rollout/logprob_mismatch"] < 1e-4
    if script == "grpo_multiturn.py":
        assert m1[1]["env/turns_mean"] > 1, "no multi-turn episodes"

    def completions(run):
        return [(r["step"], r["completion"]) for r in map(json.loads, (run / "completions.jsonl").open())]
    assert completions(tmp_path / "one")[:8] == completions(tmp_path / "two")[:8]


@pytest.mark.slow
def test_ranks_with_unequal_budgets_or_no_request_decode_in_step_and_sample_the_batch_of_one(tmp_path):
    """The policy sharded over 2 processes (tests/engine_worker.py): a rank whose samples end sooner
    (budgets 12 and 3, as episodes' budgets left differ) or that has no request still takes every
    decode step with the others, so both finish (a rank out of step fails at the worker's 60-second
    process-group timeout, not 30 minutes later), and they sample what one process samples. The
    evaluation, each rank its share of the split a few prompts a batch, gives the metrics of one
    process, which are those of the whole split in one batch; and counts as one engine call. One prompt
    given to both ranks gets other completions on each (the vLLM twin: tests/test_dist.py)."""
    from tests.test_dist import torchrun

    one = subprocess.run([sys.executable, "tests/engine_worker.py", "transformers", tmp_path / "one.pt"], cwd=ROOT,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun("tests/engine_worker.py", "transformers", tmp_path / "two.pt")
    output = two.communicate(timeout=600)[0]
    assert two.returncode == 0, output[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    lengths = {"unequal budgets": [12, 12, 3, 3, 3, 3], "a rank without requests": [12, 12, 5, 5],
               "the same prompt on both ranks": [12, 12, 12, 12]}  # no stop token: each to its own budget
    for case in lengths:
        for call in (0, 1):
            ones, twos = one[case, call], two[case, call]
            assert [len(ids) for ids, _ in ones] == lengths[case]
            assert [ids for ids, _ in twos] == [ids for ids, _ in ones], (case, call)
            for (_, lp1), (_, lp2) in zip(ones, twos):
                assert lp2 == pytest.approx(lp1, abs=1e-5)
        assert one[case, 1] != one[case, 0]  # the next call samples anew
    # each sample is seeded by its place in the whole batch: rank 1's two samples of the prompt are not rank 0's
    # (the tiny model sorts well, so one sample of each rank may be the same right answer)
    for call in (0, 1):
        samples = [ids for ids, _ in two["the same prompt on both ranks", call]]
        assert samples[:2] != samples[2:]
    assert 0 < one["eval"]["eval/reward_mean"] < 1
    assert two["eval"] == one["eval"] == one["eval, one batch"]
    # 11 prompts, at most 2 a rank at once: cuts of 4, 4 and 3 shared by the ranks; in one process 6 batches
    assert two["eval batches"] == [[2, 2, 2], [2, 2, 1]] and one["eval batches"] == [[2, 2, 2, 2, 2, 1]]
    assert two["eval calls"] == one["eval calls"] == 7  # 6 calls sampled, the evaluation
