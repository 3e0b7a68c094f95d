"""Your own reward terms, summed with weights in place of the task's reward:

    python grpo.py --task examples/my_task.py:make_task \
        --reward examples/my_rewards.py:correct --reward examples/my_rewards.py:same_digits:0.5

Each term is a function (completion, example) -> float and is logged as reward/<name>_mean;
the total is R = 1.0 * correct + 0.5 * same_digits. A reward must read any text the model
writes: what it cannot read scores 0 (an exception stops the run, naming the function).
"""


def correct(completion: str, example: dict) -> float:
    """1 for the sorted digits, exactly."""
    return 1.0 if completion.strip() == example["answer"] else 0.0


def same_digits(completion: str, example: dict) -> float:
    """Partial credit: 1 if the completion holds exactly the prompt's digits, in any order."""
    return 1.0 if sorted(completion.strip()) == sorted(example["answer"]) else 0.0
