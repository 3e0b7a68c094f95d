"""Tasks: a dataset of prompts plus a verifiable reward, the "environments" of LM RL.

A task gives train examples, held-out eval examples and `reward(completion, example)`,
a float computed from the completion's text alone (no learned judge). Each example is
a dict with at least "prompt" (the user's text: the question and the answer format it
asks for) and "answer". A reward never raises on model output: what it cannot read
scores 0.

    --task sort               the bundled digit-sorting task (the default): 3 to 8 digits
    --task sort:MIN-MAX       the same with lists of MIN to MAX digits (sort:9-11: longer than the
                              tiny model's demonstrations, a harder task)
    --task multiply           "123*45=" -> "5535": operands of 1 to 3 digits, the task where a calculator
                              tool (--env calculator) makes the difference for the tiny model
    --task gsm8k              GSM8K from the hub (openai/gsm8k, config main), checked by math-verify
    --task gsm8k:PATH         the same from a local copy of the hub dataset (README.md, main/*.parquet)
    --task countdown          reasoning-gym's countdown (small config, see RG_TASKS)
    --task basic_arithmetic   reasoning-gym's basic_arithmetic (small config)
    --task arithmetic         the same problems asking for \boxed{}, read leniently by math-verify
    --task arithmetic:k=v,... the same with basic_arithmetic config overrides (arithmetic:max_terms=2)
    --task rg:NAME[:k=v,...]  any reasoning-gym dataset, its default config or these overrides
    --task jsonl:PATH         your own data: one {"prompt": ..., "answer": ...} per line,
                              checked like gsm8k; jsonl:TRAIN,EVAL for an explicit eval file
    --task textarena:GAME-ID  a TextArena game's prompts, held-out games and outcome (common/games.py),
                              played by grpo_multiturn.py --env textarena:GAME-ID
    --task FILE.py:FUNCTION   your own task: a function returning a Task (also MODULE:FUNCTION;
                              see common/rewards.py, and examples/)

How a prompt reaches the model (chat template or raw text) and which tokens end a
completion are the tokenizer's business: encode_prompts and stop_token_ids, in common/models.py.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import os
import random
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from common.errors import ConfigError
from common.games import make_game_task
from common.hub import hub_reachable
from common.rewards import InWorkers, checked_call
from common.workers import load_function, recipe_of


@dataclass
class Task:
    name: str
    train: list[dict]
    eval: list[dict]
    reward_fn: Callable[[str, dict], float]

    def reward(self, completion: str, example: dict) -> float:
        """The task's reward, checked as the reward terms are (common/rewards.py checked_call): an
        exception, a NaN or a non-number is a bug in the task, not a 0, said in one line."""
        return checked_call(self.reward_fn, completion, example, f"task {self.name!r}: reward function")


# ---------------------------------------------------------------------------------------
# sort: the policy-gradient lecture's example. "sort 52813:" -> "12358" (then EOS).
# ---------------------------------------------------------------------------------------

def sort_prompt(digits: str) -> str:
    return f"sort {digits}:"


def exact_reward(completion: str, example: dict) -> float:
    """1 if the completion is exactly the answer (surrounding spaces ignored), else 0: `sort`'s
    sorted digits, `multiply`'s product (in a multi-turn episode: the model's final turn)."""
    return 1.0 if completion.strip() == example["answer"] else 0.0


sort_reward = exact_reward


def sort_partial_reward(completion: str, example: dict) -> float:
    """Partial credit: the fraction of positions that hold the right digit, over the longer
    of completion and answer (1 only for the exact answer). Never negative, so without a
    baseline every sample is reinforced: the setting of the policy-gradient lecture."""
    c, a = completion.strip(), example["answer"]
    return sum(x == y for x, y in zip(c, a)) / max(len(c), len(a), 1)


def make_sort_task(seed: int = 0, num_train: int = 20000, num_eval: int = 200,
                   min_len: int = 3, max_len: int = 8, name: str = "sort", reward_fn=sort_reward) -> Task:
    """Lists of min_len..max_len random digits; eval lists never appear in train.

    The split depends on `seed` only, so every run and every script sees the same data.
    """
    rng = random.Random(seed)

    def sample() -> str:
        n = rng.randint(min_len, max_len)
        return "".join(rng.choice("0123456789") for _ in range(n))

    eval_digits: list[str] = []
    seen: set[str] = set()
    while len(eval_digits) < num_eval:
        d = sample()
        if d not in seen:
            seen.add(d)
            eval_digits.append(d)
    train_digits = []
    while len(train_digits) < num_train:
        d = sample()
        if d not in seen:  # held out: no eval list in train (repeats within train are fine)
            train_digits.append(d)

    def example(d: str) -> dict:
        return {"prompt": sort_prompt(d), "answer": "".join(sorted(d))}

    return Task(name, [example(d) for d in train_digits], [example(d) for d in eval_digits], reward_fn)


# ---------------------------------------------------------------------------------------
# multiply: the multi-turn (tool) task. "123*45=" -> "5535" (then EOS).
# ---------------------------------------------------------------------------------------

multiply_reward = exact_reward


def make_multiply_task(seed: int = 0, num_train: int = 20000, num_eval: int = 200, name: str = "multiply") -> Task:
    """Products of two operands of 1 to 3 digits each: the digit count is uniform in 1..3,
    then the number is uniform among those with that many digits (0-9 for one digit); the
    prompt is "123*45=", the answer "5535". Eval problems never appear in train.

    Why: a ~1M-parameter model cannot multiply 3-digit numbers (it learns the small products
    at best), but it can copy "123*45" into a calculator call, <call>123*45</call>, and the
    calculator's <result>5535</result> into its answer. With a model that calls the tool only
    on some problems (models/tiny-tool, scripts/make_tiny_tool_model.py), RL can learn that
    calling it pays everywhere: the multi-turn script's test task.

    The split depends on `seed` only, as make_sort_task's."""
    rng = random.Random(seed)

    def operand() -> int:
        digits = rng.randint(1, 3)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    eval_pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(eval_pairs) < num_eval:
        pair = (operand(), operand())
        if pair not in seen:
            seen.add(pair)
            eval_pairs.append(pair)
    train_pairs = []
    while len(train_pairs) < num_train:
        pair = (operand(), operand())
        if pair not in seen:  # held out (repeats within train are fine)
            train_pairs.append(pair)

    def example(a: int, b: int) -> dict:
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    return Task(name, [example(*p) for p in train_pairs], [example(*p) for p in eval_pairs], multiply_reward)


# ---------------------------------------------------------------------------------------
# math answers checked by math-verify: gsm8k and jsonl:PATH
# ---------------------------------------------------------------------------------------

MATH_FORMAT = "Solve the problem step by step, then put your final answer within \\boxed{}."


def _math_verify_timeout() -> int | None:
    """math-verify times out a slow parse with SIGALRM (signal.alarm), which works in the main
    thread only, and would replace a running timer and cancel it on return: None (no timeout of its
    own) in a worker thread, or within --reward-timeout's limit (common/rewards.py time_limit), which
    then bounds the whole call, or where there is no SIGALRM (Windows: math-verify would start a process a
    parse); else 5 s."""
    if (threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM")
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        return None
    return 5


# math-verify warns once when it runs without a timeout of its own (None above): the scripts'
# --reward-timeout bounds the call instead
for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))


@functools.lru_cache(maxsize=65536)
def parse_gold(answer: str) -> tuple:
    """math-verify's reading of a reference answer ('72', '1,000', '\\frac{1}{2}', '0.5').

    A bare answer is read as LaTeX math ($...$), which also takes plain numbers."""
    from math_verify import parse

    answer = answer.strip()
    wrapped = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return tuple(parse(wrapped, parsing_timeout=_math_verify_timeout()) or
                 parse(answer, parsing_timeout=_math_verify_timeout()))


def math_reward(completion: str, example: dict) -> float:
    """1 if math-verify finds the completion's final answer equal to example["answer"], else 0.

    math-verify reads the last \\boxed{...} answer first, then "the final answer is ...",
    then the last number; it compares values, so 1,000 and 1000.0 and \\boxed{1000} are
    the same answer. Anything it cannot parse scores 0.

    When the answer is a number, so must the completion's be: math-verify evaluates what it
    reads, so "-1 - 3 - 9", the question restated, would equal -13. SmolLM2 learned exactly
    that in a GRPO run on `arithmetic` (2026-12-01) before this check."""
    from math_verify import parse, verify
    from sympy import Number

    try:
        gold = list(parse_gold(str(example["answer"])))
        timeout = _math_verify_timeout()
        pred = parse(completion, parsing_timeout=timeout)
        if gold and isinstance(gold[0], Number) and not (pred and isinstance(pred[0], Number)):
            return 0.0  # an expression, not a value
        return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # math-verify mostly catches its own errors; a reward must never raise
        return 0.0


def gsm8k_gold(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after '####', thousands separators dropped."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_prompt(question: str) -> str:
    return f"{question.strip()}\n{MATH_FORMAT}"


def make_gsm8k_task(seed: int = 0, source="openai/gsm8k", num_eval: int | None = None) -> Task:
    """GSM8K (grade-school math word problems): train on its train split, evaluate on its
    test split (all 1,319 problems; num_eval takes a seeded subset instead).

    source is a hub id (`openai/gsm8k`, needs the network or the datasets cache), a local
    folder in the hub's layout (README.md with the configs, main/train-*.parquet,
    main/test-*.parquet: what downloading the dataset repository gives), or a
    datasets.DatasetDict with "train" and "test" splits. Rows have "question" and
    "answer" (a worked solution ending in '#### 72')."""
    if isinstance(source, str):
        import datasets

        path = os.path.expanduser(source)
        is_hub_id = source.count("/") == 1 and not source.startswith((".", "/", "~"))
        if not os.path.isdir(path) and not is_hub_id:
            raise ConfigError(f"gsm8k: {source!r} is not a folder (use --task gsm8k:PATH with a local copy "
                              f"of the hub dataset openai/gsm8k: README.md and main/*.parquet)")
        online = os.path.isdir(path) or hub_reachable()
        try:
            splits = {s: datasets.load_dataset(path if os.path.isdir(path) else source, "main", split=s)
                      for s in ("train", "test")}
        except Exception as e:
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            why = "the Hugging Face hub is unreachable from here (offline?) and it is not cached" if not online \
                else first_line
            raise ConfigError(f"gsm8k: cannot load {source!r} ({why}); without the hub, download "
                              f"openai/gsm8k elsewhere and use --task gsm8k:PATH") from None
    else:
        splits = source

    def examples(split) -> list[dict]:
        try:
            return [{"prompt": gsm8k_prompt(row["question"]), "answer": gsm8k_gold(row["answer"]),
                     "question": row["question"]} for row in split]
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"gsm8k: {source if isinstance(source, str) else 'dataset'} is not in the "
                              f"hub's format (rows of 'question' and 'answer' ending in '#### N'): {e}") from None

    train, test = examples(splits["train"]), examples(splits["test"])
    if num_eval is not None and num_eval < len(test):
        test = random.Random(seed).sample(test, num_eval)
    return Task("gsm8k", train, test, math_reward)


# ---------------------------------------------------------------------------------------
# jsonl:PATH - your own prompts and answers, no code
# ---------------------------------------------------------------------------------------

def read_jsonl_examples(path: str) -> list[dict]:
    """Rows of {"prompt": str, "answer": str or number} (other fields are kept); blank lines
    are skipped. A malformed line is a ConfigError naming the file, the line and the problem."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(f"jsonl task: file {path!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: expected a JSON object with fields 'prompt' and 'answer', "
                                  f"got {type(row).__name__}")
            for field in ("prompt", "answer"):
                if field not in row:
                    raise ConfigError(f"{where}: missing field {field!r} (each line needs 'prompt' and "
                                      f"'answer'; found {', '.join(map(repr, row)) or 'no fields'})")
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ConfigError(f"{where}: field 'prompt' must be a non-empty string")
            answer = row["answer"]
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
                raise ConfigError(f"{where}: field 'answer' must be a non-empty string or a number, "
                                  f"got {answer!r}")
            out.append({**row, "answer": str(answer)})
    if not out:
        raise ConfigError(f"jsonl task: {path!r} has no examples")
    return out


def make_jsonl_task(spec: str, seed: int = 0, max_eval: int = 200) -> Task:
    """`PATH`: a seeded held-out set of 10% of the lines (1 to max_eval) is the eval split,
    the rest is train. `TRAIN,EVAL`: two files. Rewards as gsm8k (math_reward); the prompt
    is sent as written, so it should state the answer format (e.g. \\boxed{})."""
    if "," in spec and not os.path.isfile(os.path.expanduser(spec)):
        train_path, eval_path = spec.rsplit(",", 1)
        train, held_out = read_jsonl_examples(train_path), read_jsonl_examples(eval_path)
    else:
        rows = read_jsonl_examples(spec)
        if len(rows) < 2:
            raise ConfigError(f"jsonl task: {spec!r} has {len(rows)} example; it needs at least 2 "
                              f"(one is held out for evaluation), or pass jsonl:TRAIN,EVAL")
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        n_eval = min(max_eval, max(1, len(rows) // 10))
        held_out = [rows[i] for i in sorted(order[:n_eval])]
        train = [rows[i] for i in sorted(order[n_eval:])]
    return Task(f"jsonl:{spec}", train, held_out, math_reward)


# ---------------------------------------------------------------------------------------
# reasoning-gym: procedurally generated tasks with their own scorers
# ---------------------------------------------------------------------------------------

ANSWER_FORMAT = "Give your final answer inside <answer></answer> tags."

# Configs of the named reasoning-gym tasks: smaller than the package defaults (countdown:
# 4-6 numbers, targets 100-999; basic_arithmetic: up to 6 terms of 4 digits), which a
# ~100M model cannot start on. `rg:NAME` uses the package's defaults. basic_arithmetic
# keeps allow_parentheses=True: with False, reasoning-gym 0.1.25 writes a different
# divisor into the question than it divides by ("Calculate 46 / 60." -> "2").
RG_TASKS = {
    "countdown": ("countdown", {"min_numbers": 3, "max_numbers": 4, "min_target": 10, "max_target": 100}),
    "basic_arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                              "max_digits": 2, "allow_negation": False}),
}


def extract_answer_tag(completion: str) -> str | None:
    """The text inside the last <answer>...</answer> of the completion, or None."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion, tag_name="answer")


def make_rg_task(dataset: str, seed: int = 0, num_train: int | None = None, num_eval: int | None = None,
                 config: dict | None = None, name: str | None = None) -> Task:
    """A reasoning-gym dataset generated from `seed`: eval examples first, then train
    examples whose question is not an eval question. The prompt is the dataset's question
    plus ANSWER_FORMAT; the reward is the dataset's own score_answer on the text inside
    the last <answer> tags (None when there is none: the scorer's "no answer" score).

    Generation costs from ~0.1 ms (basic_arithmetic) to ~5-20 ms (countdown) an example,
    so the default sizes are 5,000 train and 200 eval, or 1,000 and 100 for countdown."""
    import reasoning_gym

    slow = dataset == "countdown"
    num_train = num_train or (1000 if slow else 5000)
    num_eval = num_eval or (100 if slow else 200)
    # reasoning-gym seeds example i with Random(seed + i): spread the task seeds apart so
    # that seeds 0 and 1 don't give the same examples shifted by one
    base_seed = random.Random(f"rg:{dataset}:{seed}").randrange(2**31)
    try:
        data = reasoning_gym.create_dataset(dataset, seed=base_seed, size=num_eval + 4 * num_train,
                                            **(config or {}))
    except Exception as e:
        raise ConfigError(f"task {name or dataset!r}: reasoning-gym cannot create {dataset!r} with "
                          f"{config or {}} ({type(e).__name__}: {e})") from None

    def example(i: int) -> dict:
        entry = data[i]
        return {**entry, "prompt": f"{entry['question'].rstrip()}\n{ANSWER_FORMAT}"}

    eval_examples, seen, i = [], set(), 0
    while len(eval_examples) < num_eval and i < num_eval * 4:
        e = example(i)
        i += 1
        if e["question"] not in seen:
            seen.add(e["question"])
            eval_examples.append(e)
    i, train = num_eval * 4, []
    while len(train) < num_train and i < data.size:
        e = example(i)
        i += 1
        if e["question"] not in seen:  # held out (repeats within train are fine)
            train.append(e)
    if not train:
        raise ConfigError(f"task {name or dataset!r}: every generated question is in the eval set")

    def reward(completion: str, ex: dict) -> float:
        try:
            return float(data.score_answer(extract_answer_tag(completion), ex))
        except Exception:  # a scorer that trips over odd model output: no reward
            return 0.0

    return Task(name or f"rg:{dataset}", train, eval_examples, reward)


def make_arithmetic_task(seed: int = 0, overrides: dict | None = None, name: str = "arithmetic") -> Task:
    """basic_arithmetic's problems (small config, plus `overrides`) asked and checked as GSM8K's:
    the prompt asks for \\boxed{} and math-verify reads the final answer leniently (the last
    \\boxed{}, else "the answer is ...", else the last number) and compares its value. A small
    model that states the right number without the <answer> tags reasoning-gym asks for still
    scores, so SmolLM2-135M-Instruct starts above 0 and has a gradient."""
    dataset, config = RG_TASKS["basic_arithmetic"]
    problems = make_rg_task(dataset, seed=seed, config={**config, **(overrides or {})}, name=name)

    def asked_for_boxed(e: dict) -> dict:
        return {**e, "prompt": f"{e['question'].rstrip()}\n{MATH_FORMAT}"}

    return Task(name, [asked_for_boxed(e) for e in problems.train],
                [asked_for_boxed(e) for e in problems.eval], math_reward)


def parse_rg_spec(spec: str) -> tuple[str, dict]:
    """'basic_arithmetic:max_terms=2,max_digits=1' -> ('basic_arithmetic', {...})."""
    dataset, _, overrides = spec.partition(":")
    config = {}
    for item in filter(None, overrides.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"task 'rg:{spec}': expected key=value, got {item!r}")
        try:
            config[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            config[key.strip()] = value.strip()
    return dataset.strip(), config


# ---------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., Task]] = {
    "sort": make_sort_task,
    "sort-partial": functools.partial(make_sort_task, name="sort-partial", reward_fn=sort_partial_reward),
    "multiply": make_multiply_task,
    "gsm8k": make_gsm8k_task,
    "arithmetic": make_arithmetic_task,
    **{name: functools.partial(make_rg_task, dataset, config=config, name=name)
       for name, (dataset, config) in RG_TASKS.items()},
}


def _sort_from_spec(spec: str, seed: int) -> Task:
    low, dash, high = spec.partition("-")
    if not (low.isdigit() and dash and high.isdigit() and 3 <= int(low) <= int(high)):  # 3: enough distinct lists
        raise ConfigError(f"task 'sort:{spec}': expected sort:MIN-MAX with 3 <= MIN <= MAX, e.g. sort:9-11")
    return make_sort_task(seed, min_len=int(low), max_len=int(high), name=f"sort:{spec}")


def _rg_from_spec(spec: str, seed: int) -> Task:
    dataset, config = parse_rg_spec(spec)
    return make_rg_task(dataset, seed=seed, config=config, name=f"rg:{spec}")


# NAME:ARGUMENT spellings
TASK_PREFIXES: dict[str, Callable[[str, int], Task]] = {
    "arithmetic": lambda spec, seed: make_arithmetic_task(
        seed, overrides=parse_rg_spec(f"basic_arithmetic:{spec}")[1], name=f"arithmetic:{spec}"),
    "gsm8k": lambda path, seed: make_gsm8k_task(seed=seed, source=path),
    "jsonl": lambda spec, seed: make_jsonl_task(spec, seed=seed),
    "rg": _rg_from_spec,
    "sort": _sort_from_spec,
    "textarena": lambda spec, seed: make_game_task(spec, seed),
}


def load_task(name: str, seed: int = 0) -> Task:
    """Build a task by name; an unknown name is a clear error listing the known ones."""
    prefix, colon, argument = name.partition(":")
    if colon and prefix in TASK_PREFIXES and argument:
        return TASK_PREFIXES[prefix](argument, seed)
    if colon:
        return user_task(name, seed)
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}, "
                          f"and the spellings sort:MIN-MAX, gsm8k:PATH, jsonl:PATH, rg:DATASET, arithmetic:k=v, FILE.py:FUNCTION")
    return TASKS[name](seed=seed)


def user_task(spec: str, seed: int, in_workers: bool = True) -> Task:
    """--task FILE.py:FUNCTION: the function's Task (called with seed=SEED if it takes a seed),
    checked: train and eval examples are dicts with a "prompt" string. Its reward runs in the worker
    processes (common/rewards.py InWorkers), which find it by its name in its module, or (a lambda, a
    closure) call FUNCTION again for it (user_task_reward)."""
    make_task = load_function(spec, "--task")
    try:
        signature = inspect.signature(make_task)
        kwargs = {"seed": seed} if "seed" in signature.parameters else {}
        signature.bind(**kwargs)
    except TypeError:
        raise ConfigError(f"--task {spec!r}: a task function takes no argument or `seed`, "
                          f"{make_task.__name__} has the signature {signature}") from None
    try:
        task = make_task(**kwargs)
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:
        raise ConfigError(f"--task {spec!r} raised {type(e).__name__}: {e}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"--task {spec!r} returned {type(task).__name__}, not a Task "
                          f"(from common.tasks import Task; Task(name, train, eval, reward_fn))")
    for split in ("train", "eval"):
        examples = getattr(task, split)
        if not isinstance(examples, list) or not examples:
            raise ConfigError(f"--task {spec!r}: Task.{split} must be a non-empty list of examples")
        # an empty prompt would stop vLLM mid-run (no token to start from)
        bad = next((i for i, e in enumerate(examples) if not isinstance(e, dict) or not isinstance(e.get("prompt"), str)
                    or not e["prompt"].strip()), None)
        if bad is not None:
            raise ConfigError(f"--task {spec!r}: Task.{split}[{bad}] is {str(examples[bad])[:80]}; every example must "
                              f"be a dict with a non-empty \"prompt\" string")
    if not callable(task.reward_fn):
        raise ConfigError(f"--task {spec!r}: Task.reward_fn must be a function (completion, example) -> float")
    if in_workers:
        recipe = recipe_of(task.reward_fn, "--task") or ("common.tasks", "user_task_reward", (spec, seed))
        task.reward_fn = InWorkers(recipe, f"task {task.name!r}: reward function")
    return task


def user_task_reward(spec: str, seed: int) -> Callable:
    """In a worker: the reward function of --task FILE.py:FUNCTION's Task, made again."""
    return user_task(spec, seed, in_workers=False).reward_fn
