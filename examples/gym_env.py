"""Another library's environment through the same interface: a 10-line adapter (GymText) for any
gym-style text environment, `reset(seed=...) -> (observation, info)` and `step(action) ->
(observation, reward, terminated, truncated, info)`, and a task whose reward is the environment's:

    python grpo_multiturn.py --env examples/gym_env.py:hot_cold --task examples/gym_env.py:hot_cold_task \
        --max-turns 8

HotCold stands in for the library: a secret number from 0 to 9, "hotter" or "colder" after each
guess, reward 1 for finding it. Replace `HotCold` by your library's constructor (a function that
makes one environment); each episode gets its own, reset with the example's seed.
"""

import random

from common.env import Environment, Step, env_reward
from common.tasks import Task


class GymText(Environment):
    def __init__(self, make):
        self.make = make  # a function returning a new environment of the library

    def start(self, example: dict) -> dict:
        env = self.make()
        env.reset(seed=example["game_seed"])  # its first observation is the example's prompt
        return {"env": env}

    def step(self, state: dict, turn: str) -> Step:
        observation, reward, terminated, truncated, _ = state["env"].step(turn)
        return Step(None, reward=float(reward)) if terminated or truncated else Step(observation)


class HotCold:
    """The stand-in library: gym-style, seeded, text in and out."""
    PROMPT = "Guess my number from 0 to 9, one digit a turn:"

    def reset(self, seed: int):
        self.secret, self.last, self.turns = random.Random(seed).randrange(10), None, 0
        return self.PROMPT, {}

    def step(self, action: str):
        digits = [c for c in action if c.isdigit()]
        guess, self.turns = (int(digits[0]) if digits else -1), self.turns + 1
        if guess == self.secret:
            return "", 1.0, True, False, {}
        hint = "hotter" if self.last is not None and abs(guess - self.secret) < abs(self.last - self.secret) else "colder"
        self.last = guess
        return f" {hint}: ", 0.0, False, self.turns >= 8, {}


def hot_cold() -> GymText:
    return GymText(HotCold)


def hot_cold_task(seed: int = 0) -> Task:
    """The environment's prompt for each game seed; the reward is the environment's (env_reward)."""
    rng = random.Random(seed)
    train = [{"prompt": HotCold.PROMPT, "game_seed": rng.randrange(10**9)} for _ in range(1000)]
    held_out = [{"prompt": HotCold.PROMPT, "game_seed": 10**9 + i} for i in range(50)]
    return Task("hot-cold", train, held_out, env_reward)
