"""Real tasks without the hub: GSM8K checked by math-verify (loader on a local copy in the
hub's layout), reasoning-gym tasks with their own scorers, and jsonl:PATH user data."""

import json
import threading

import pytest

from common.tasks import (ANSWER_FORMAT, MATH_FORMAT, gsm8k_gold, load_task, make_gsm8k_task, make_rg_task,
                          math_reward)
from common.errors import ConfigError

# GSM8K-style problems, written for these tests, in the hub dataset's row format
GSM8K_TRAIN = [
    {"question": "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?",
     "answer": "Tom has 3 * 4 = <<3*4=12>>12 apples.\nAfter eating 2 he has 12 - 2 = <<12-2=10>>10.\n#### 10"},
    {"question": "A shop sells pens at $2 each. Mia buys 500 pens. How many dollars does she pay?",
     "answer": "She pays 500 * 2 = <<500*2=1000>>1,000 dollars.\n#### 1,000"},
    {"question": "Sam reads 15 pages a day. How many pages does he read in 6 days?",
     "answer": "15 * 6 = <<15*6=90>>90 pages.\n#### 90"},
    {"question": "A bus has 40 seats and 27 are taken. How many seats are free?",
     "answer": "40 - 27 = <<40-27=13>>13 seats are free.\n#### 13"},
]
GSM8K_TEST = [
    {"question": "Lena has 7 marbles and finds 5 more. How many marbles does she have now?",
     "answer": "7 + 5 = <<7+5=12>>12.\n#### 12"},
    {"question": "A farmer has 24 eggs and puts them in boxes of 6. How many boxes does he fill?",
     "answer": "24 / 6 = <<24/6=4>>4 boxes.\n#### 4"},
    {"question": "Each ticket costs $9. How much do 8 tickets cost?",
     "answer": "9 * 8 = <<9*8=72>>72 dollars.\n#### 72"},
    {"question": "Ann had 50 stickers and gave away 18. How many stickers does she have left?",
     "answer": "50 - 18 = <<50-18=32>>32.\n#### 32"},
    {"question": "A class has 6 rows of 5 desks. How many desks are there?",
     "answer": "6 * 5 = <<6*5=30>>30.\n#### 30"},
    {"question": "Ben runs 3 km every morning and 2 km every evening. How many km does he run in 4 days?",
     "answer": "Each day 3 + 2 = <<3+2=5>>5 km, so 5 * 4 = <<5*4=20>>20 km.\n#### 20"},
    {"question": "A pizza has 8 slices. How many slices are in 3 pizzas?",
     "answer": "8 * 3 = <<8*3=24>>24.\n#### 24"},
    {"question": "Kim saves $15 a week. How many weeks does she need to save $60?",
     "answer": "60 / 15 = <<60/15=4>>4 weeks.\n#### 4"},
]

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
# gsm8k (test fixture in the hub's layout)
"""


def write_gsm8k_fixture(root, train=GSM8K_TRAIN, test=GSM8K_TEST):
    """A folder laid out like the hub dataset openai/gsm8k: README.md with its configs and
    main/{train,test}-00000-of-00001.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "main").mkdir(parents=True)
    (root / "README.md").write_text(GSM8K_README)
    for split, rows in (("train", train), ("test", test)):
        table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
        pq.write_table(table, root / "main" / f"{split}-00000-of-00001.parquet")
    return root


# ---------------------------------------------------------------------------------------
# gsm8k: reward and loader
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion", [
    "1000", "1,000", "1000.0", "\\boxed{1000}", "$1,000$", "The answer is \\boxed{1,000}.",
    "500 pens at $2 each: 500 * 2 = 1000.\nThe final answer is 1000.",
    "First 12, then 990 more: \\boxed{1000.00}",
])
def test_math_reward_equal_answers_in_any_format(completion):
    assert math_reward(completion, {"answer": "1000"}) == 1.0
    assert math_reward(completion, {"answer": "1,000"}) == 1.0


@pytest.mark.parametrize("completion", [
    "999", "\\boxed{999}", "1000 is close but the answer is \\boxed{1001}", "10001", "1,000,000",
])
def test_math_reward_wrong_answers(completion):
    assert math_reward(completion, {"answer": "1000"}) == 0.0


@pytest.mark.parametrize("completion", [
    "", "I don't know", "\\boxed{", "\\boxed{}", "}}}{{{\\frac", "\x00\x01", "$$$$", "\\boxed{\\frac{1}{0}}",
    "<|im_end|>", "nan", "a" * 5000,
])
def test_math_reward_unparseable_scores_zero_without_raising(completion):
    assert math_reward(completion, {"answer": "1000"}) == 0.0


def test_math_reward_fractions_and_latex_gold():
    assert math_reward("so x = 0.5", {"answer": "\\frac{1}{2}"}) == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math_reward("\\boxed{\\frac{1}{3}}", {"answer": "0.5"}) == 0.0


def test_math_reward_a_number_answer_must_be_a_number_not_an_expression():
    """math-verify evaluates what it reads: without the check, the question restated (SmolLM2
    learned to write it under GRPO) equals the answer."""
    restated = "To calculate -1 - 3 - 9 within \\boxed{}, you need to put the final answer within \\boxed{}."
    assert math_reward(restated, {"answer": "-13"}) == 0.0
    assert math_reward("\\boxed{3 + 4}", {"answer": "7"}) == 0.0
    assert math_reward("-1 - 3 - 9 = \\boxed{-13}", {"answer": "-13"}) == 1.0
    assert math_reward("\\boxed{1 + x^2}", {"answer": "x^2 + 1"}) == 1.0  # an expression answer may be one


def test_math_reward_works_outside_the_main_thread():
    """math-verify's timeout uses SIGALRM, which only the main thread may set."""
    results = []
    t = threading.Thread(target=lambda: results.append(
        (math_reward("\\boxed{1,000}", {"answer": "1000"}), math_reward("7", {"answer": "1000"}))))
    t.start()
    t.join()
    assert results == [(1.0, 0.0)]


def test_gsm8k_gold_answer_is_after_the_hashes():
    assert gsm8k_gold("She pays 500 * 2 = 1,000 dollars.\n#### 1,000") == "1000"
    assert gsm8k_gold("#### -3") == "-3"
    with pytest.raises(ValueError):
        gsm8k_gold("no final answer")


def test_gsm8k_loader_reads_a_local_copy_in_the_hub_layout(tmp_path):
    """The same datasets.load_dataset(path, "main") call as for the hub id, on a local copy."""
    root = write_gsm8k_fixture(tmp_path / "gsm8k")
    task = load_task(f"gsm8k:{root}", seed=0)
    assert task.name == "gsm8k"
    assert [e["answer"] for e in task.train] == ["10", "1000", "90", "13"]
    assert [e["answer"] for e in task.eval] == ["12", "4", "72", "32", "30", "20", "24", "4"]
    first = task.train[0]
    assert first["prompt"] == GSM8K_TRAIN[0]["question"] + "\n" + MATH_FORMAT
    assert "\\boxed{}" in first["prompt"]
    assert task.reward("3 * 4 = 12 and 12 - 2 = 10, so \\boxed{10}", first) == 1.0
    assert task.reward("\\boxed{12}", first) == 0.0
    assert task.reward("no idea", first) == 0.0
    assert task.reward("She pays \\boxed{1,000}", task.train[1]) == 1.0


def test_gsm8k_from_a_dataset_object_and_a_seeded_eval_subset():
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_TRAIN),
                               "test": datasets.Dataset.from_list(GSM8K_TEST)})
    a = make_gsm8k_task(seed=0, source=dd, num_eval=3)
    assert len(a.train) == 4 and len(a.eval) == 3
    assert a.eval == make_gsm8k_task(seed=0, source=dd, num_eval=3).eval


def test_gsm8k_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        load_task(f"gsm8k:{tmp_path / 'missing'}")
    root = write_gsm8k_fixture(tmp_path / "bad", train=[{"question": "q", "answer": "no hashes"}])
    with pytest.raises(ConfigError, match="hub's format"):
        load_task(f"gsm8k:{root}")


# ---------------------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["basic_arithmetic", "countdown"])
def test_reasoning_gym_task_scores_with_its_own_scorer(name):
    task = make_rg_task(name, seed=0, num_train=30, num_eval=10, name=name,
                        config={"min_numbers": 3, "max_numbers": 3} if name == "countdown" else None)
    for e in task.eval[:5]:
        assert e["prompt"].startswith(e["question"].rstrip()) and e["prompt"].endswith(ANSWER_FORMAT)
        assert task.reward(f"Let me think.\n<answer>{e['answer']}</answer>", e) == 1.0
        assert task.reward(f"<answer>{e['answer']}</answer>", e) == 1.0
        # wrong, or no tagged answer: below 1 (countdown's scorer gives 0.05 to a wrong but
        # well-formed expression and 0.01 to no answer; basic_arithmetic gives 0)
        wrong = "1 + 1 + 1 + 1" if name == "countdown" else str(int(e["answer"]) + 1)
        assert task.reward(f"<answer>{wrong}</answer>", e) < 0.1
        assert task.reward(e["answer"], e) < 0.1  # the answer without its tags does not count
        assert task.reward("", e) < 0.1
        assert task.reward("<answer>)))(((</answer>", e) < 0.1


def test_basic_arithmetic_answers_are_right():
    """The registry's config avoids reasoning-gym's broken no-parentheses divisions."""
    from fractions import Fraction
    import re

    task = load_task("basic_arithmetic", seed=0)
    for e in task.train[:500]:
        expr = re.sub(r"(-?\d+)", r"Fraction(\1)", e["metadata"]["expression"])
        assert eval(expr) == int(e["answer"]), e["question"]


def test_reasoning_gym_tasks_are_seeded_and_held_out():
    a = make_rg_task("basic_arithmetic", seed=0, num_train=300, num_eval=50)
    b = make_rg_task("basic_arithmetic", seed=0, num_train=300, num_eval=50)
    c = make_rg_task("basic_arithmetic", seed=1, num_train=300, num_eval=50)
    assert a.train == b.train and a.eval == b.eval
    assert len(a.train) == 300 and len(a.eval) == 50
    assert a.eval != c.eval and a.train[:20] != c.train[:20]
    eval_q = {e["question"] for e in a.eval}
    assert len(eval_q) == 50
    assert not eval_q & {e["question"] for e in a.train}


def test_registry_and_rg_spelling():
    task = load_task("rg:basic_arithmetic:max_terms=2,max_digits=1", seed=0)
    assert task.name == "rg:basic_arithmetic:max_terms=2,max_digits=1"
    assert all(e["metadata"]["num_digits"] == 1 and e["metadata"]["num_terms"] == 2 for e in task.train[:100])
    with pytest.raises(ConfigError, match="reasoning-gym cannot create 'no_such_dataset'"):
        load_task("rg:no_such_dataset")
    # arithmetic:k=v: the same overrides, the problems asked for \boxed{} and read by math-verify
    easy = load_task("arithmetic:max_terms=2,max_digits=1", seed=0)
    assert easy.name == "arithmetic:max_terms=2,max_digits=1"
    assert all(e["metadata"]["num_digits"] == 1 and e["metadata"]["num_terms"] == 2 and
               e["prompt"] == f"{e['question']}\n{MATH_FORMAT}" for e in easy.train[:100])
    e = easy.eval[0]
    assert easy.reward(f"\\boxed{{{e['answer']}}}", e) == 1.0 and easy.reward("\\boxed{100}", e) == 0.0
    with pytest.raises(ConfigError, match="expected key=value, got 'max_terms'"):
        load_task("arithmetic:max_terms")
    with pytest.raises(ConfigError, match=r"unknown task 'gsm9k'; known tasks: arithmetic, basic_arithmetic, "
                                          r"countdown, gsm8k, multiply, sort, sort-partial, and the spellings sort:MIN-MAX, "
                                          r"gsm8k:PATH, jsonl:PATH"):
        load_task("gsm9k")


# ---------------------------------------------------------------------------------------
# jsonl:PATH
# ---------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_task_happy_path(tmp_path):
    rows = [{"prompt": f"What is {i} + {i}? Answer in \\boxed{{}}.", "answer": 2 * i} for i in range(30)]
    rows[3]["answer"] = "1,000"
    path = write_jsonl(tmp_path / "data.jsonl", rows[:10] + [""] + rows[10:])  # a blank line is skipped
    task = load_task(f"jsonl:{path}", seed=0)
    assert len(task.eval) == 3 and len(task.train) == 27
    assert not {e["prompt"] for e in task.eval} & {e["prompt"] for e in task.train}
    assert task.eval == load_task(f"jsonl:{path}", seed=0).eval
    e = next(e for e in task.train + task.eval if e["prompt"].startswith("What is 5 "))
    assert e["answer"] == "10" and e["prompt"] == rows[5]["prompt"]  # the prompt is sent as written
    assert task.reward("5 + 5 = \\boxed{10}", e) == 1.0
    assert task.reward("10.0", e) == 1.0
    assert task.reward("\\boxed{11}", e) == 0.0
    assert task.reward("", e) == 0.0
    e3 = next(e for e in task.train + task.eval if e["prompt"].startswith("What is 3 "))
    assert task.reward("\\boxed{1000}", e3) == 1.0

    eval_path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    task = load_task(f"jsonl:{path},{eval_path}", seed=0)
    assert len(task.train) == 30 and task.eval == [{"prompt": "2+2?", "answer": "4"}]


@pytest.mark.parametrize("bad_line, message", [
    ({"prompt": "What is 2+2?"}, r"line 3: missing field 'answer'"),
    ({"question": "What is 2+2?", "answer": "4"}, r"line 3: missing field 'prompt'"),
    ('{"prompt": "What is 2+2?", "answer": 4', r"line 3: not valid JSON"),
    ("not json at all", r"line 3: not valid JSON"),
    ('["What is 2+2?", "4"]', r"line 3: expected a JSON object"),
    ({"prompt": "", "answer": "4"}, r"line 3: field 'prompt' must be a non-empty string"),
    ({"prompt": "What is 2+2?", "answer": None}, r"line 3: field 'answer' must be"),
])
def test_jsonl_malformed_line_names_file_line_and_field(tmp_path, bad_line, message):
    good = {"prompt": "What is 1+1?", "answer": "2"}
    path = write_jsonl(tmp_path / "mine.jsonl", [good, good, bad_line, good])
    with pytest.raises(ConfigError, match=message) as err:
        load_task(f"jsonl:{path}")
    assert str(path) in str(err.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(ConfigError, match="has no examples"):
        load_task(f"jsonl:{write_jsonl(tmp_path / 'empty.jsonl', [''])}")
