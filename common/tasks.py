"""Tasks: a dataset of prompts plus a verifiable reward, the "environments" of LM RL.

A task gives train examples, held-out eval examples and `reward(completion, example)`,
a float computed from the completion's text alone (no learned judge). Each example is
a dict with at least "prompt" (the text the model continues) and "answer".
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from common.utils import ConfigError


@dataclass
class Task:
    name: str
    train: list[dict]
    eval: list[dict]
    reward_fn: Callable[[str, dict], float]

    def reward(self, completion: str, example: dict) -> float:
        """The task's reward, checked: a NaN or a non-number is a bug in the task, not a 0."""
        r = self.reward_fn(completion, example)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ConfigError(
                f"task {self.name!r}: reward function returned {r!r} for completion "
                f"{completion!r}; it must return a finite number"
            )
        return float(r)


# ---------------------------------------------------------------------------------------
# sort: the policy-gradient lecture's example. "sort 52813:" -> "12358" (then EOS).
# ---------------------------------------------------------------------------------------

def sort_prompt(digits: str) -> str:
    return f"sort {digits}:"


def sort_reward(completion: str, example: dict) -> float:
    """1 if the completion is exactly the sorted digits (surrounding spaces ignored), else 0."""
    return 1.0 if completion.strip() == example["answer"] else 0.0


def make_sort_task(seed: int = 0, num_train: int = 20000, num_eval: int = 200,
                   min_len: int = 3, max_len: int = 8) -> Task:
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

    return Task("sort", [example(d) for d in train_digits], [example(d) for d in eval_digits],
                sort_reward)


TASKS: dict[str, Callable[..., Task]] = {
    "sort": make_sort_task,
}


def load_task(name: str, seed: int = 0) -> Task:
    """Build a task by name; an unknown name is a clear error listing the known ones."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](seed=seed)


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, exactly as sent to vLLM and scored by the trainer."""
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
