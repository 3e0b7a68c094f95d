"""Your own task, without touching the project's code:

    python grpo.py --task examples/my_task.py:make_task

A task is train examples, held-out eval examples (dicts with at least a "prompt"; any other
fields reach the reward) and a reward function (completion, example) -> float, the verifier
that held-out accuracy counts (reward >= 1). This one sorts 3 to 5 digits, in the prompt
format the bundled tiny model was pretrained on ("sort 52813:" -> "12358").
"""

import random

from common.tasks import Task


def exact_match(completion: str, example: dict) -> float:
    return 1.0 if completion.strip() == example["answer"] else 0.0


def make_task(seed: int = 0) -> Task:
    """Called with the run's --seed, so the data is the same in every run of that seed."""
    rng = random.Random(seed)

    def example() -> dict:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
        return {"prompt": f"sort {digits}:", "answer": "".join(sorted(digits))}

    eval_examples = [example() for _ in range(50)]
    held_out = {e["prompt"] for e in eval_examples}
    train = [e for e in (example() for _ in range(2000)) if e["prompt"] not in held_out]
    return Task("short-sort", train, eval_examples, exact_match)
