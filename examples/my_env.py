"""Your own multi-turn environment, without touching the project's code:

    python grpo_multiturn.py --env examples/my_env.py:retry --task sort

An environment answers each model turn (common/env.py): `start(example)` begins an episode from
a task example and returns its state, `step(state, turn)` returns a Step whose observation the
model reads before its next turn, or Step(None) to end the episode; `max_turns`, if it has one, is
the most turns an episode of it takes (--max-turns's default). One object serves every
episode, so what an episode remembers lives in its state. The task's verifier then scores the
model's last turn, as it scores a single-turn completion.

This one gives feedback and lets the model retry: a wrong answer reads "wrong, try again: " and
gets another turn, up to `attempts` answers in all; a right one ends the episode. With --task
sort: "sort 52813:" -> "12385" -> "\nwrong, try again: " -> "12358", which scores 1 (the
verifier reads the last turn only, so a second try scores as a first one would).
"""

from common.env import Environment, Step


class Retry(Environment):
    def __init__(self, attempts: int):
        self.attempts = attempts
        self.max_turns = attempts  # (optional) its own limit, the default of --max-turns

    def start(self, example: dict) -> dict:
        return {"example": example, "answers": 0}

    def step(self, state: dict, turn: str) -> Step:
        state["answers"] += 1
        if turn.strip() == state["example"]["answer"] or state["answers"] >= self.attempts:
            return Step(None)  # right, or out of attempts: this turn is the final answer
        return Step("\nwrong, try again: ")


def retry(attempts: int = 3) -> Retry:
    """Called with no arguments by --env examples/my_env.py:retry."""
    return Retry(attempts)
