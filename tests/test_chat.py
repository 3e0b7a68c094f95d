"""Chat templates: the prompt text the model sees, and the template's end-of-turn token
ending a completion in vLLM and staying in the loss mask."""

import json
import shutil

import pytest

from common.errors import ConfigError
from common.batch import make_batch
from common.scripts import algorithm_scripts
from common.models import encode_prompts, end_of_turn_token_ids, stop_token_ids
from common.engine import evaluate
from tests.conftest import TINY_MODEL, vllm_sampling_params

# ChatML, as SmolLM2 and Qwen use it (the tiny vocabulary spells <|im_start|> in characters)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The user's text as is, and <|im_end|> after each assistant turn: the tiny model (trained on
# raw "sort 52813:" -> "12358<|im_end|>") behaves as usual under it.
PLAIN_TURNS = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|im_end|>{% endif %}"
               "{% endfor %}")


def model_copy(dst, chat_template: str | None, eos: str = "<|im_end|>", bos_post_processor: bool = False):
    """The tiny model with a chat template and, optionally, another EOS token or a tokenizer
    that prepends a BOS (<|endoftext|>) to every text."""
    shutil.copytree(TINY_MODEL, dst)
    if chat_template is not None:
        (dst / "chat_template.jinja").write_text(chat_template)
    eos_id = {"<|endoftext|>": 0, "<|im_end|>": 1}[eos]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos_id
        (dst / name).write_text(json.dumps(cfg, indent=2))
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = eos
    if bos_post_processor:
        tok_cfg["bos_token"] = "<|endoftext|>"
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return str(dst)


def test_prompt_text_through_the_chat_template(tmp_path, tokenizer):
    from common.models import load_tokenizer

    tok = load_tokenizer(model_copy(tmp_path / "chatml", CHATML))
    ids = encode_prompts(tok, ["sort 52813:"])[0]
    assert tok.decode(ids) == "<|im_start|>user\nsort 52813:<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1  # the special token, not its characters

    ids = encode_prompts(tok, ["sort 52813:"], system_prompt="Sort ascending.")[0]
    assert tok.decode(ids) == ("<|im_start|>system\nSort ascending.<|im_end|>\n"
                               "<|im_start|>user\nsort 52813:<|im_end|>\n<|im_start|>assistant\n")

    # raw text on request, and for a tokenizer without a template (the bundled model)
    assert tok.decode(encode_prompts(tok, ["sort 52813:"], chat_template=False)[0]) == "sort 52813:"
    assert encode_prompts(tokenizer, ["sort 52813:"]) == encode_prompts(tokenizer, ["sort 52813:"], False)
    assert tokenizer.decode(encode_prompts(tokenizer, ["sort 52813:"])[0]) == "sort 52813:"
    with pytest.raises(ConfigError, match="system prompt needs a chat template"):
        encode_prompts(tokenizer, ["sort 52813:"], system_prompt="Sort ascending.")


def test_template_ids_get_no_second_bos(tmp_path):
    """A tokenizer that prepends BOS to plain text: the template's own BOS is the only one."""
    from common.models import load_tokenizer

    tok = load_tokenizer(model_copy(tmp_path / "bos", "{{ bos_token }}" + CHATML, bos_post_processor=True))
    assert tok("hi")["input_ids"][0] == 0  # the plain-text path adds a BOS
    ids = encode_prompts(tok, ["hi"])[0]
    assert ids[0] == 0 and ids[1] != 0 and ids.count(0) == 1
    assert ids == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)


def test_end_of_turn_and_stop_tokens(tmp_path, tokenizer):
    from common.models import load_tokenizer

    assert end_of_turn_token_ids(tokenizer) == [] and stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    tok = load_tokenizer(model_copy(tmp_path / "eot", CHATML, eos="<|endoftext|>"))
    assert tok.eos_token_id == 0
    assert end_of_turn_token_ids(tok) == [1]  # <|im_end|>, read off the rendered template
    assert stop_token_ids(tok) == [0, 1]
    # no pad token of its own and no spare special token: padding reuses EOS (padding is found
    # by position) and nothing is added to the vocabulary, which vLLM's copy could not take
    assert tok.pad_token_id == tok.eos_token_id and len(tok) == 98


@pytest.fixture(scope="session")
def eot_model(tmp_path_factory):
    """A tiny-model copy whose EOS is <|endoftext|> and whose template ends a turn with
    <|im_end|>: only the stop tokens make vLLM stop at end-of-turn."""
    return model_copy(tmp_path_factory.mktemp("eot") / "model", PLAIN_TURNS, eos="<|endoftext|>")


@pytest.fixture(scope="session")
def eot_engine(eot_model):
    from common.engine import create_engine
    from common.models import load_tokenizer
    from tests.conftest import GPU_SHARE, keep_engine, vllm_module

    vllm_module()
    return keep_engine(create_engine(eot_model, seed=0, max_model_len=64, enforce_eager=True,
                                     gpu_memory_utilization=GPU_SHARE, sleep_mode=False)), \
        load_tokenizer(eot_model)


def test_end_of_turn_ends_a_completion_and_is_in_the_loss_mask(eot_engine):
    llm, tok = eot_engine
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = ["sort 52813:", "sort 907:", "sort 4411:", "sort 6020318:"]
    prompt_ids = encode_prompts(tok, prompts)
    assert tok.decode(prompt_ids[0]) == "sort 52813:"
    requests = [{"prompt_token_ids": p} for p in prompt_ids]

    # without the stop tokens the model's <|im_end|> does not end the completion
    free = llm.generate(requests, vllm_sampling_params(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert any(im_end in o.outputs[0].token_ids[:-1] or o.outputs[0].finish_reason == "length" for o in free)

    outputs = llm.generate(requests, vllm_sampling_params(temperature=0.0, max_tokens=16, stop_token_ids=stop_token_ids(tok)),
                           use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    for o, ids in zip(outputs, completions):
        assert o.outputs[0].finish_reason == "stop"  # finished, not truncated
        assert ids[-1] == im_end and im_end not in ids[:-1]
        assert o.outputs[0].text.isdigit()  # the text has no end-of-turn marker
    _, _, completion_mask = make_batch(prompt_ids, completions, tok.pad_token_id, "cpu")
    for row, ids in zip(completion_mask, completions):
        assert row[len(ids) - 1] == 1 and row.sum() == len(ids)  # end-of-turn is a loss token


def test_evaluate_uses_the_template_and_stop_tokens(eot_engine):
    """evaluate() encodes and stops like training; completions end at <|im_end|>."""
    from common.tasks import make_sort_task

    llm, tok = eot_engine
    task = make_sort_task(seed=0, num_train=1, num_eval=16)
    stopped = evaluate(llm, tok, task, max_new_tokens=12)
    # the tiny model sorts ascending 22% of the time (README): without stop tokens it would
    # keep writing after <|im_end|> and no answer would match exactly
    assert stopped["eval/accuracy"] > 0
    with pytest.raises(ConfigError, match="system prompt needs a chat template"):
        evaluate(llm, tok, task, 12, chat_template=False, system_prompt="Sort.")


@pytest.mark.parametrize("script", algorithm_scripts())
def test_every_script_stops_rollouts_at_end_of_turn(script, tmp_path, eot_model, eot_engine, run_main):
    """A model whose EOS is <|endoftext|> and whose turns end with <|im_end|>: a script that
    did not pass the stop tokens to vLLM would see every completion run to max_new_tokens.
    Its pad is EOS (no other special token), and the weight sync must still work."""
    from tests.conftest import logprob_tolerance
    from tests.test_grpo_e2e import read_metrics

    out = tmp_path / "run"
    args = run_main(script, "--model", eot_model, "--task", "sort", "--steps", "1", "--prompts-per-step", "4",
                    "--completions-per-prompt", "4",
             "--max-new-tokens", "12", "--micro-batch-size", "8", "--output-dir", out, engine=eot_engine[0])
    step = read_metrics(out)[1]
    assert step["response/truncated_frac"] < 0.5, step
    assert step["rollout/logprob_mismatch"] < logprob_tolerance(args)
