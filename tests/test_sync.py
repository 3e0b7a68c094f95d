"""Weight sync into the in-process vLLM engine: after a sync vLLM scores tokens exactly as
the trainer does; without one it keeps the old weights."""

import torch

from common.engine import engine_model, sync_weights
from common.batch import make_batch
from common.ops import forward_logprobs
from tests.conftest import vllm_sampling_params


def vllm_prompt_logprobs(llm, ids: list[int]) -> torch.Tensor:
    out = llm.generate([{"prompt_token_ids": ids}], vllm_sampling_params(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    input_ids, attention_mask, _ = make_batch([ids[:1]], [ids[1:]], 0, "cpu")
    with torch.no_grad():
        return forward_logprobs(model, input_ids, attention_mask, len(ids) - 1)[0]


def test_sync_makes_vllm_match_the_trainer(llm, tiny_policy, tokenizer):
    ids = tokenizer("sort 52813:12358")["input_ids"] + [tokenizer.eos_token_id]
    sync_weights(llm, tiny_policy)  # the session engine may have been used by other tests
    assert (vllm_prompt_logprobs(llm, ids) - trainer_logprobs(tiny_policy, ids)).abs().max() < 1e-4

    torch.manual_seed(1)
    with torch.no_grad():
        for p in tiny_policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before_sync = (vllm_prompt_logprobs(llm, ids) - trainer_logprobs(tiny_policy, ids)).abs().max()
    assert before_sync > 0.1, "perturbing the trainer must change its log-probs"

    sync_weights(llm, tiny_policy)
    after_sync = (vllm_prompt_logprobs(llm, ids) - trainer_logprobs(tiny_policy, ids)).abs().max()
    assert after_sync < 1e-4


def test_sync_changes_what_vllm_generates(llm, tiny_policy, tokenizer):
    """Greedy outputs follow the synced weights (the prefix cache must not serve stale KV)."""
    prompt = tokenizer("sort 9876:")["input_ids"]
    greedy = vllm_sampling_params(temperature=0.0, max_tokens=6)
    sync_weights(llm, tiny_policy)
    llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)  # fills the prefix cache
    # make the trainer always emit "7": bias the tied embedding/unembedding towards that token
    seven = tokenizer("7")["input_ids"][0]
    with torch.no_grad():
        tiny_policy.lm_head.weight[seven] *= 0
        tiny_policy.lm_head.weight[seven] += 50 * tiny_policy.model.norm.weight.sign()
    sync_weights(llm, tiny_policy)
    text = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].text
    assert text == "777777"


def test_engine_keeps_plain_cpu_weights(llm):
    """The CPU patch keeps ordinary weights in the engine (vLLM would pack and empty them)."""
    qkv = engine_model(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.weight.numel() > 0


def test_sampled_tokens_are_ranked_without_compiling(llm, tokenizer):
    """vLLM ranks each sampled token (with log-probs asked for) with a torch.compile'd helper
    that the first sampled rollout of every run compiled; on CPU the engine ranks them eagerly
    (create_engine): the compiled helper never runs, and a rank is the number of tokens at
    least as likely as the sampled one, by vLLM's own top-20 log-probs (which hold every token
    at least as likely as a sampled one of rank <= 20)."""
    from vllm.v1.sample.ops import logprobs as vllm_logprobs

    prompt = tokenizer("sort 52813:")["input_ids"]
    out = llm.generate([{"prompt_token_ids": prompt}], vllm_sampling_params(n=4, temperature=1.0, max_tokens=8, logprobs=20),
                       use_tqdm=False)[0]
    ranks = [(candidates[token].rank, sum(lp.logprob >= candidates[token].logprob for lp in candidates.values()))
             for completion in out.outputs for token, candidates in zip(completion.token_ids, completion.logprobs)]
    checked = [(rank, count) for rank, count in ranks if rank <= 20]
    assert len(checked) > len(ranks) / 2 and all(rank == count for rank, count in checked)
    compiled_code = vllm_logprobs.batched_count_greater_than._torchdynamo_orig_callable.__code__
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(compiled_code) == []


def test_sampled_log_probs_are_not_decoded_but_the_text_is(llm, tiny_policy, tokenizer):
    """The rollout reads a sampled token's log-prob, never its text: the engine leaves the log-prob
    entries undecoded (vLLM would decode each one in Python), and the completion's text is still
    the decoded tokens (up to EOS)."""
    sync_weights(llm, tiny_policy)
    prompt = tokenizer("sort 52813:")["input_ids"]
    out = llm.generate([{"prompt_token_ids": prompt}], vllm_sampling_params(n=8, temperature=1.0, max_tokens=8, logprobs=0),
                       use_tqdm=False)[0]
    for c in out.outputs:
        entries = [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
        assert [e.decoded_token for e in entries] == [None] * len(c.token_ids)
        assert all(e.logprob <= 0 and e.rank >= 1 for e in entries)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert any(c.text for c in out.outputs)


def test_sleep_mode_cycle_wakes_the_engine_before_sampling_and_its_weights_before_a_sync(llm, run_main, tmp_path,
                                                                                       monkeypatch):
    """vLLM's sleep mode exists on CUDA only: here it is simulated on the session engine.
    sleep() releases the engine's memory, and generating, or loading weights, into released
    memory fails the test (on a GPU the loaded weights would be lost silently). Two steps of
    grpo.py with an evaluation each step: every rollout and evaluation finds the engine awake,
    every sync finds its weights awake, and the synced weights are what vLLM then samples."""
    from tests.conftest import logprob_tolerance
    from tests.test_grpo_e2e import SMALL, read_metrics

    released, calls = set(), []
    real_generate, real_load = llm.generate, engine_model(llm).load_weights

    def sleep(level=1):
        released.update({"weights", "kv_cache"})
        calls.append(f"sleep {level}")

    def wake_up(tags=None):
        released.difference_update(tags or {"weights", "kv_cache"})
        calls.append(f"wake {sorted(tags)}")

    def generate(*args, **kwargs):
        assert not released, f"generate() on released memory: {released}"
        return real_generate(*args, **kwargs)

    def load_weights(weights):
        assert "weights" not in released, "weights loaded into a sleeping engine"
        return real_load(weights)

    for name, value in [("sleep", sleep), ("wake_up", wake_up), ("generate", generate), ("sleeps", True),
                        ("asleep", set())]:
        monkeypatch.setattr(llm, name, value)
    monkeypatch.setattr(engine_model(llm), "load_weights", load_weights)
    args = run_main("grpo.py", "--steps", "2", "--eval-every", "1", "--output-dir", tmp_path / "run", *SMALL)
    # start: eval; each step: rollout, sync (weights first), eval
    assert calls == ["sleep 1", "wake ['kv_cache', 'weights']", "sleep 1",
                     "wake ['weights']", "wake ['kv_cache']", "sleep 1",
                     "wake ['kv_cache', 'weights']", "sleep 1", "wake ['weights']", "wake ['kv_cache']", "sleep 1"]
    assert all(m["rollout/logprob_mismatch"] < logprob_tolerance(args) for m in read_metrics(tmp_path / "run")[1:])
