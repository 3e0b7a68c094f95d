"""grpo_multiturn.py end to end: token-in/token-out episodes through a real engine (vLLM, and the
transformers engine), a resumed run that continues the uninterrupted one, and (tests/test_engine.py)
two processes that sample the batch of one."""

import json

import pytest
import torch

from common.batch import episode_batch
from common.engine import create_engine, sampled_logprobs, sync_weights
from common.env import CheckedEnv, Step
from common.models import encode_prompts, load_policy, load_tokenizer
from common.ops import forward_logprobs
from common.scripts import load_script
from tests.conftest import GPU_SHARE, TINY_MODEL, keep_engine, vllm_module
from tests.test_grpo_e2e import read_metrics

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def merging_model(tmp_path_factory):
    """A random-weight Qwen2 (seeded; head_dim 64, as vLLM's CPU attention needs) whose tokenizer is
    make_tokenizer()'s one token a character plus BPE merges "Xq" for every lowercase letter X.
    Qwen2's pre-tokenizer keeps a run of letters together, so a turn that ends with a letter
    followed by an observation that starts with "q" re-encodes to one "Xq" token where the engine
    sampled "X" and the observation holds "q"."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    from scripts.make_tiny_model import EOS, PAD, make_tokenizer

    vocab = dict(make_tokenizer().get_vocab())
    for c in LETTERS:
        vocab[c + "q"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[(c, "q") for c in LETTERS], unk_token=PAD, pad_token=PAD,
                               eos_token=EOS)
    assert tokenizer("%cq1", add_special_tokens=False)["input_ids"] == [vocab["%"], vocab["cq"], vocab["1"]]
    torch.manual_seed(0)
    # a wide initialization: a peaked distribution, whose log-probs tell tokens and positions apart
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("merging") / "model"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class Echo:
    """Every model turn ends at its first lowercase letter (a stop string) and every observation
    starts with "q": at each turn boundary BPE would merge the two. It records what it answered,
    per episode (the state)."""
    stop = tuple(LETTERS)

    def start(self, example):
        return {"id": example["id"], "observations": []}

    def step(self, state, turn):
        state["observations"].append(f"q{len(state['observations'])}={len(turn)} ")
        return Step(state["observations"][-1], tool_call=True)


@pytest.mark.parametrize("engine_kind", ["vllm", "transformers"])
def test_episodes_are_the_engines_ids_and_the_observations_never_re_encoded(merging_model, engine_kind, monkeypatch):
    """run_episodes at temperature 1 with a tokenizer whose merges join a turn's end to the next
    observation, then episode_batch: each row is the prompt, then the engine's ids of each turn and
    the environment's observation ids in between, exactly (their text re-encodes to other ids); the
    model-token mask is every turn's tokens and no observation's; and the trainer's log-probs of
    those tokens, all turns, are the engine's."""
    grpo_multiturn = load_script("grpo_multiturn.py")
    tokenizer = load_tokenizer(merging_model)
    policy = load_policy(merging_model, tokenizer, "float32", "cpu")
    if engine_kind == "vllm":
        vllm_module()
        llm = keep_engine(create_engine(merging_model, seed=0, max_model_len=MAX_MODEL_LEN, dtype="float32",
                                        gpu_memory_utilization=GPU_SHARE, cpu_kv_cache_gib=1, sleep_mode=False))
    else:
        llm = create_engine(merging_model, seed=0, max_model_len=MAX_MODEL_LEN, engine="transformers")
        sync_weights(llm, policy)
    calls = []  # what the engine was asked and what it sampled
    generate = llm.generate

    def recorded(requests, params, **kwargs):
        outputs = generate(requests, params, **kwargs)
        calls.append([(r["prompt_token_ids"], o.outputs[0]) for r, o in zip(requests, outputs)])
        return outputs

    monkeypatch.setattr(llm, "generate", recorded)
    args = grpo_multiturn.Args(engine=engine_kind, max_turns=3, max_turn_tokens=12, max_new_tokens=40)
    env = Echo()
    torch.manual_seed(0)  # the in-process vLLM engine samples from the global generator
    examples = [{"id": i, "prompt": f"{i:02d}:"} for i in range(16)]  # distinct prompts of 3 tokens each
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], True, None)
    episodes = grpo_multiturn.run_episodes(llm, CheckedEnv(env, "echo", 0), tokenizer, prompt_ids, examples, args,
                                           temperature=1.0)
    input_ids, attention_mask, completion_mask, _, _ = episode_batch(prompt_ids, episodes, tokenizer.pad_token_id,
                                                                     "cpu")
    C = completion_mask.shape[1]
    turns_seen, re_encoded_otherwise = [], 0
    for i, (p, e) in enumerate(zip(prompt_ids, episodes)):
        # the engine's turns of this episode, in order (each request starts with the episode's own prompt)
        turns = [(request, out) for call in calls for request, out in call if request[:len(p)] == p]
        observations = [tokenizer(o, add_special_tokens=False)["input_ids"] for o in e.state["observations"]]
        ids, mask = list(p), []
        for k, (request, out) in enumerate(turns):
            assert request == ids, f"episode {i}, turn {k + 1}: the engine continued from other ids"
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            if k < len(turns) - 1:  # an observation between two turns
                ids += observations[k]
                mask += [0] * len(observations[k])
        row = input_ids[i][attention_mask[i].bool()].tolist()
        assert row == ids, f"episode {i}: the trainer's ids are not the engine's and the observations'"
        assert completion_mask[i].tolist() == mask + [0] * (C - len(mask)), f"episode {i}: not the model's tokens"
        turns_seen.append(len(turns))
        re_encoded = tokenizer(tokenizer.decode(row), add_special_tokens=False)["input_ids"]
        re_encoded_otherwise += re_encoded != row
    # the case is built: re-encoding the text gives other ids (an "Xq" token where a turn met an observation)
    assert re_encoded_otherwise >= 4, re_encoded_otherwise
    assert max(turns_seen) == 3 and sum(t >= 2 for t in turns_seen) >= 8, turns_seen
    with torch.no_grad():
        trainer = forward_logprobs(policy, input_ids, attention_mask, C, temperature=1.0)
    engine = sampled_logprobs(episodes, C, "cpu")
    mask = completion_mask.bool()
    mismatch = float((trainer - engine)[mask].abs().max())
    assert mismatch < 1e-4, f"the trainer's log-probs of the model's tokens are not the engine's: {mismatch:.3g} apart"
    assert (engine[~mask] == 0).all()
    assert trainer[mask].std() > 0.5  # a peaked distribution: other tokens would score otherwise


RESUME_FLAGS = ["--model", TINY_MODEL, "--task", "sort", "--env", "examples/my_env.py:retry", "--max-new-tokens", "40",
                "--max-turn-tokens", "12", "--prompts-per-step", "2", "--completions-per-prompt", "4",
                "--num-minibatches", "2", "--micro-batch-size", "4", "--log-completions", "8", "--save-every", "2",
                "--eval-every", "2"]
COMPARED = ("reward/mean", "response/length_mean", "loss/total")


@pytest.mark.parametrize("engine_kind", ["transformers", "vllm"])
def test_a_resumed_run_continues_as_the_uninterrupted_run(tmp_path, run_main, engine_kind):
    """4 steps, and a resume from step 2's checkpoint into another folder: steps 3 and 4 sample the
    same episodes (several turns: the retry environment) and make the same updates. The transformers
    engine seeds each sample by its call count, which the checkpoint carries; in-process vLLM samples
    from torch's global generator, whose state the checkpoint carries."""
    run_main("grpo_multiturn.py", "--engine", engine_kind, "--steps", "4", *RESUME_FLAGS, "--output-dir",
             tmp_path / "whole")
    run_main("grpo_multiturn.py", "--resume", tmp_path / "whole" / "checkpoints" / "step_2", "--output-dir",
             tmp_path / "resumed")
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in whole] == [0, 1, 2, 3, 4] and [m["step"] for m in resumed] == [3, 4]
    assert max(m["env/turns_mean"] for m in whole[1:]) > 1.5  # multi-turn episodes
    for w, r in zip(whole[3:], resumed):
        for key in COMPARED + tuple(k for k in w if k.startswith(("env/", "eval/"))):
            assert r[key] == pytest.approx(w[key], abs=1e-6), (w["step"], key)

    def completions(run):
        return [r for r in map(json.loads, (run / "completions.jsonl").open()) if r["step"] > 2]
    assert len(completions(tmp_path / "whole")) == 16
    assert completions(tmp_path / "resumed") == completions(tmp_path / "whole")
