"""The task registry and the bundled sort task."""

import math

import pytest

from common.models import encode_prompts
from common.tasks import Task, load_task, make_multiply_task, make_sort_task, multiply_reward, sort_partial_reward, sort_reward
from common.errors import ConfigError
from tests.conftest import TINY_MODEL


def test_sort_task_is_deterministic_and_held_out():
    a, b = make_sort_task(seed=0), make_sort_task(seed=0)
    assert a.train[:50] == b.train[:50] and a.eval == b.eval
    assert make_sort_task(seed=1).eval != a.eval
    eval_prompts = {e["prompt"] for e in a.eval}
    assert len(eval_prompts) == len(a.eval)
    assert not eval_prompts & {e["prompt"] for e in a.train}


def test_sort_examples_and_reward():
    ex = {"prompt": "sort 52813:", "answer": "12358"}
    assert sort_reward("12358", ex) == 1.0
    assert sort_reward(" 12358 ", ex) == 1.0
    assert sort_reward("12385", ex) == 0.0
    assert sort_reward("", ex) == 0.0
    task = make_sort_task(seed=0)
    for e in task.train[:100]:
        digits = e["prompt"][len("sort "):-1]
        assert e["answer"] == "".join(sorted(digits)) and 3 <= len(digits) <= 8


def test_sort_partial_reward_gives_credit_per_position():
    ex = {"prompt": "sort 52813:", "answer": "12358"}
    assert sort_partial_reward("12358", ex) == 1.0
    assert sort_partial_reward("85321", ex) == 1 / 5  # descending: only the middle digit is in place
    assert sort_partial_reward("1235", ex) == 4 / 5
    assert sort_partial_reward("123588", ex) == 5 / 6  # extra digits count against it
    assert sort_partial_reward("", ex) == 0.0
    partial, exact = load_task("sort-partial"), load_task("sort")
    assert partial.eval == exact.eval and partial.train[:100] == exact.train[:100]  # same prompts


def test_multiply_task_is_deterministic_and_held_out():
    a, b = make_multiply_task(seed=0), make_multiply_task(seed=0)
    assert a.train[:50] == b.train[:50] and a.eval == b.eval
    assert len(a.train) == 20000 and len(a.eval) == 200
    assert make_multiply_task(seed=1).eval != a.eval
    eval_prompts = {e["prompt"] for e in a.eval}
    assert len(eval_prompts) == len(a.eval)
    assert not eval_prompts & {e["prompt"] for e in a.train}
    assert load_task("multiply").eval == a.eval
    # seed 0's first problems, pinned (products checked by hand)
    assert a.eval[:2] == [{"prompt": "63*4=", "answer": "252"}, {"prompt": "597*48=", "answer": "28656"}]
    assert a.train[:2] == [{"prompt": "21*1=", "answer": "21"}, {"prompt": "24*720=", "answer": "17280"}]


def test_multiply_examples_and_reward():
    ex = {"prompt": "123*45=", "answer": "5535"}
    assert multiply_reward("5535", ex) == 1.0
    assert multiply_reward(" 5535\n", ex) == 1.0
    assert multiply_reward("5536", ex) == 0.0
    assert multiply_reward("55350", ex) == 0.0
    assert multiply_reward("<call>123*45</call>", ex) == 0.0  # a call is not an answer
    assert multiply_reward("", ex) == 0.0
    task = make_multiply_task(seed=0)
    digit_counts = set()
    for e in task.train[:2000] + task.eval:
        left, right = e["prompt"].removesuffix("=").split("*")
        for operand in (left, right):
            assert operand.isdigit() and 1 <= len(operand) <= 3 and (len(operand) == 1 or operand[0] != "0")
        assert e["prompt"] == f"{left}*{right}=" and e["answer"] == str(int(left) * int(right))
        digit_counts.add((len(left), len(right)))
    assert digit_counts == {(i, j) for i in (1, 2, 3) for j in (1, 2, 3)}


def test_unknown_task_lists_known_tasks():
    with pytest.raises(ConfigError, match=r"unknown task 'nope'; known tasks: .*sort"):
        load_task("nope")


@pytest.mark.parametrize("bad", [float("nan"), math.inf, "1", None, True, 1e39,  # 1e39: inf in float32
                                 pytest.param(10**400, id="10**400")])
def test_reward_that_is_not_a_finite_number_is_an_error(bad):
    task = Task("bad", [], [], lambda completion, example: bad)
    with pytest.raises(ConfigError, match="reward function returned"):
        task.reward("x", {})


def test_tokenizer_is_character_level(tokenizer):
    ids = encode_prompts(tokenizer, ["sort 52813:"])[0]
    assert len(ids) == len("sort 52813:")
    assert tokenizer.decode(ids) == "sort 52813:"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id


def test_sort_with_other_list_lengths():
    task = load_task("sort:9-11", seed=0)
    assert task.name == "sort:9-11"
    lengths = {len(e["answer"]) for e in task.train[:500] + task.eval}
    assert lengths == {9, 10, 11}
    assert all(e["answer"] == "".join(sorted(e["prompt"][5:-1])) for e in task.eval)
    for bad in ("sort:2-5", "sort:9", "sort:9-7", "sort:a-b"):
        with pytest.raises(ConfigError, match="expected sort:MIN-MAX"):
            load_task(bad)


def test_arithmetic_asks_for_boxed_and_reads_the_answer_leniently():
    task = load_task("arithmetic", seed=0)
    rg = load_task("basic_arithmetic", seed=0)
    assert [e["question"] for e in task.eval] == [e["question"] for e in rg.eval]  # the same problems
    e = next(e for e in task.eval if e["answer"] not in e["question"])
    assert e["prompt"].endswith("\\boxed{}.") and e["question"] in e["prompt"]
    assert task.reward(f"The result is \\boxed{{{e['answer']}}}.", e) == 1.0
    assert task.reward(f"{e['question']} = {e['answer']}", e) == 1.0  # the last number, without a box
    assert task.reward(f"\\boxed{{{int(e['answer']) + 1}}}", e) == 0.0
    assert task.reward("I do not know.", e) == 0.0


def test_an_empty_prompt_is_refused_naming_its_split_and_index(tmp_path):
    """An empty prompt passed the check and stopped vLLM mid-run (no token to start from)."""
    user = tmp_path / "blank.py"
    user.write_text("from common.tasks import Task\n"
                    "def make_task():\n"
                    "    return Task('blank', [{'prompt': 'sort 1:'}], [{'prompt': 'sort 2:'}, {'prompt': ' '}], len)\n")
    with pytest.raises(ConfigError, match=r"Task.eval\[1\] is \{'prompt': ' '\}; every example must be a dict "
                                          r"with a non-empty \"prompt\" string"):
        load_task(f"{user}:make_task")


def test_a_verifier_that_raises_in_evaluation_is_one_line(tiny_policy):
    """As in training: the task, the completion and the exception, not a traceback."""
    from common.engine import create_engine, evaluate, sync_weights

    llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
    sync_weights(llm, tiny_policy)
    task = Task("fragile", [], [{"prompt": "sort 321:", "answer": "123"}], lambda completion, example: {}[completion])
    with pytest.raises(ConfigError) as e:
        evaluate(llm, llm.tokenizer, task, max_new_tokens=8)
    assert str(e.value).startswith("task 'fragile': reward function raised KeyError: ") and "on completion '" in str(e.value)
    assert "\n" not in str(e.value)
