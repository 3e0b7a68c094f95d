"""Environments of multi-turn episodes (grpo_multiturn.py): what answers the model's turns.

An episode starts from a task example. The model writes a turn; the environment reads it and
answers with an observation (a tool's result, an error message, feedback), which the model
reads before its next turn, or ends the episode: that turn was the model's final answer, which
the task's verifier scores.

    --env calculator          <call>EXPR</call> -> <result>VALUE</result>: + - * / and parentheses,
                              parsed by a small grammar (common/calculator.py), never executed
    --env textarena:GAME-ID   a single-player TextArena game (common/games.py): GuessTheNumber-v0,
                              TowerOfHanoi-v0, ...; the task follows it (--task textarena:GAME-ID)
    --env FILE.py:FUNCTION    your own: a function (no arguments) returning an Environment
                              (see examples/my_env.py)

An Environment is any object with
    stop                      strings that end a model turn besides EOS, kept in the turn ("</call>")
    max_turns                 (optional) the most model turns an episode of it takes: --max-turns's
                              default (the calculator's 3; a game's turn limit with its retries);
                              None or absent: no limit of its own, the token budget ends an episode
    start(example) -> state   a new episode from a task example; the state is anything the episode
                              keeps (None for the calculator, which remembers nothing)
    step(state, turn) -> Step what the model's turn (its text) gets back
One object serves every episode, so per-episode data belongs in the state. A step that raises is
one line naming the environment and the turn; one that runs past --env-timeout ends its episode,
counted (env/timeouts), as a slow reward scores 0.

Your environment (FILE.py:FUNCTION) runs in worker processes (common/workers.py), each of which
calls FUNCTION once: a step past --env-timeout is killed with its worker, whatever it does (its own
SIGALRM handler, `except BaseException`, a long C call, a never-ending thread), and a worker that
dies (a segfault, os._exit, out of memory) ends its episode the same way, in a line of its own.
An episode's state lives in the run and goes to a worker with each step and back (EnvState), so any
worker serves any episode and a killed one loses nothing but its call: a state must pickle. The
calculator runs in the run's own process, under a SIGALRM limit (common/rewards.py time_limit).

Token-in/token-out: an episode keeps the ids the engine sampled and each observation's ids,
tokenized once, on its own (observation_ids); the text is never re-encoded, because BPE merges
across a turn boundary would give other ids than those sampled.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from common.calculator import calculate
from common.errors import ConfigError, RunError, need
from common.rewards import RewardTimeout, time_limit
from common.workers import DIED, OK, RAISED, TIMEOUT, WORKERS, load_function

# common.engine and common.models (transformers) are imported where they are used: a worker imports
# this module (the user's file does, for Step) and needs neither, and a worker replaced after a
# timeout should start in a tenth of a second, not in seconds


@dataclass
class Step:
    observation: str | None = None  # what the model reads next; None ends the episode (the turn was its answer)
    tool_call: bool = False         # the turn called a tool (counted: env/tool_calls)
    error: bool = False             # a malformed or failing call; the observation says why (env/tool_errors)
    invalid_move: bool = False      # a game's move its rules refuse (env/invalid_moves_mean)
    reward: float | None = None     # where the environment scores the episode (a game's outcome): its
                                    # reward, with the step that ends it (example["env_reward"])


class Environment:
    """The interface (subclass it, or write any object with the same members; max_turns may be left out)."""
    stop: tuple[str, ...] = ()
    max_turns: int | None = None

    def start(self, example: dict):
        return None

    def step(self, state, turn: str) -> Step:
        raise NotImplementedError


class Calculator(Environment):
    """The model calls `<call>12*(3+4)</call>` (its turn ends at `</call>`) and reads
    `<result>84</result>`, or `<result>error: ...</result>` for a call the grammar refuses,
    a division by zero or a number too large. A turn without a call is the final answer."""
    stop = ("</call>",)
    max_turns = 3  # a call or two, then the answer
    CALL = re.compile(r"<call>(.*)</call>\s*$", re.DOTALL)

    def step(self, state, turn: str) -> Step:
        if "</call>" not in turn:
            return Step(None)
        call = self.CALL.search(turn)
        result = calculate(call.group(1).rsplit("<call>", 1)[-1]) if call else "error: </call> without <call>"
        return Step(f"<result>{result}</result>", tool_call=True, error=result.startswith("error"))


ENVS = {"calculator": Calculator}


class EnvState:
    """An episode's state (what start returned) while its environment runs in the workers: kept
    here, sent with each step and replaced by the state the step leaves."""

    def __init__(self, value):
        self.value = value


def env_calls(spec: str):
    """In a worker: --env spec's environment, made once, as one function: ("start", None, example)
    -> its state; ("step", state, turn) -> (the Step, the state after it)."""
    env = load_function(spec, "--env")()

    def call(method: str, state, *args):
        if method == "start":
            return env.start(*args)
        return env.step(state, *args), state
    return call


class CheckedEnv:
    """An environment whose calls are checked: one that raises or returns anything but a Step is
    a one-line error naming it; a step past `timeout` seconds (0: no limit), or whose worker died,
    returns None. in_workers: the environment runs in the worker processes (the user's), where
    it is made again; `env` (made here too) only gives its stop strings."""

    def __init__(self, env, spec: str, timeout: float, in_workers: bool = False):
        self.env, self.spec, self.timeout = env, spec, timeout
        self.stop = tuple(env.stop)
        self.max_turns = getattr(env, "max_turns", None)
        self.recipe = ("common.env", "env_calls", (spec,)) if in_workers else None

    def _call(self, what: str, fn, *args):
        try:
            with time_limit(self.timeout):
                return fn(*args)
        except RunError:  # already one line; RewardTimeout (a BaseException) passes through too
            raise
        except (Exception, SystemExit) as e:
            raise ConfigError(f"--env {self.spec!r}: {what} raised {type(e).__name__}: {e}") from None

    def _in_worker(self, what: str, *args) -> tuple[str, object]:
        """The call in a worker: (kind, value) as common/workers.py gives them; raising is one line."""
        kind, value = WORKERS.map(self.recipe, [args], self.timeout)[0]
        if kind == RAISED:
            raise ConfigError(f"--env {self.spec!r}: {what} raised {value}")
        return kind, value

    def start(self, example: dict):
        if self.recipe is not None:
            kind, value = self._in_worker("start", "start", None, example)
            need(kind != TIMEOUT, f"--env {self.spec!r}: start ran past --env-timeout {self.timeout:g} s")
            need(kind != DIED, f"--env {self.spec!r}: its worker died ({value}) in start")
            return EnvState(value)
        try:
            return self._call("start", self.env.start, example)
        except RewardTimeout:
            raise ConfigError(f"--env {self.spec!r}: start ran past --env-timeout {self.timeout:g} s") from None

    def step(self, state, turn: str) -> Step | None:
        return self.steps([state], [turn])[0]

    def steps(self, states: list, turns: list[str]) -> list[Step | None]:
        """Each episode's step on its turn; None for one past the limit or whose worker died. In workers
        the calls run in parallel, one a worker: a turn of N hanging calls costs ceil(N / workers) limits."""
        if self.recipe is not None:
            results = WORKERS.map(self.recipe, [("step", s.value, t) for s, t in zip(states, turns)], self.timeout)
            steps = []
            for state, turn, (kind, value) in zip(states, turns, results):
                what = f"step on turn {turn[:80]!r}"
                if kind == RAISED:
                    raise ConfigError(f"--env {self.spec!r}: {what} raised {value}")
                if kind == DIED:
                    tqdm.write(f"--env {self.spec!r}: its worker died ({value}) in {what}; the episode ended",
                               file=sys.stderr)
                if kind != OK:  # past the limit, or its worker died: the episode ends (env/timeouts)
                    steps.append(None)
                    continue
                step, state.value = value
                steps.append(self._checked(step, turn))
            return steps
        steps = []
        for state, turn in zip(states, turns):
            try:
                steps.append(self._checked(self._call(f"step on turn {turn[:80]!r}", self.env.step, state, turn), turn))
            except RewardTimeout:
                steps.append(None)
        return steps

    def _checked(self, step, turn: str) -> Step:
        if not isinstance(step, Step) or not (step.observation is None or isinstance(step.observation, str)):
            what = (f"a Step whose observation is {type(step.observation).__name__} {str(step.observation)[:40]}"
                    if isinstance(step, Step) else str(step)[:80])
            raise ConfigError(f"--env {self.spec!r}: step returned {what} on turn {turn[:80]!r}; it must "
                              f"return a Step (from common.env import Step) whose observation is a str or None")
        return step


def load_env(spec: str, task, timeout: float = 0.0, tokenizer=None, chat_template: bool = False) -> CheckedEnv:
    """--env NAME or FILE.py:FUNCTION, checked now, before anything heavy: the function takes no
    argument and returns an object with stop, start and step, which start and step on the first
    train example (an empty turn) in time; and the chat template (if used) can append observations.
    --env-timeout itself first: a negative or NaN limit is the flag's fault, not the environment's."""
    need(math.isfinite(timeout) and timeout >= 0, f"--env-timeout must be >= 0 seconds (0: no limit), got {timeout}")
    if spec in ENVS:
        env = ENVS[spec]()
    elif spec.startswith("textarena:"):
        from common.games import TextArenaGame

        env = TextArenaGame(spec.removeprefix("textarena:"))
    elif ":" in spec:
        make_env = load_function(spec, "--env")
        try:
            inspect.signature(make_env).bind()
        except TypeError:
            raise ConfigError(f"--env {spec!r}: an environment function takes no argument") from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        try:
            env = make_env()
        except (Exception, SystemExit) as e:
            raise ConfigError(f"--env {spec!r} raised {type(e).__name__}: {e}") from None
    else:
        raise ConfigError(f"unknown environment {spec!r}; known: {', '.join(sorted(ENVS))}, or FILE.py:FUNCTION")
    missing = [m for m in ("start", "step") if not callable(getattr(env, m, None))]
    stop = getattr(env, "stop", None)
    if missing or not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"--env {spec!r}: returned {type(env).__name__}, not an environment (it needs "
                          f"start(example), step(state, turn) and stop, a tuple of non-empty strings: common/env.py)")
    max_turns = getattr(env, "max_turns", None)
    need(max_turns is None or (type(max_turns) is int and max_turns >= 1),
         f"--env {spec!r}: max_turns must be None or an int >= 1, got {max_turns!r}")
    from common.models import has_chat_template

    if chat_template and tokenizer is not None and has_chat_template(tokenizer):
        observation_frame(tokenizer)
    # a game runs here, as the calculator: its object lives across turns (common/games.py)
    checked = CheckedEnv(env, spec, timeout, in_workers=not (spec in ENVS or spec.startswith("textarena:")))
    if checked.step(checked.start(task.train[0]), "") is None:
        raise ConfigError(f"--env {spec!r}: step ran past --env-timeout {timeout:g} s (or its worker died) on an "
                          f"empty turn")
    return checked


def observation_ids(tokenizer, text: str, chat_template: bool, turn_ids: list[int],
                    room: int | None = None) -> list[int] | None:
    """An observation's token ids, tokenized once, on its own; None where they would not leave the
    model a token of `room` (the episode's budget left), found for a text too long to fit without
    tokenizing it: a token stands for at most longest_token(tokenizer) characters, so a text of
    (room + 1) x that many has at least room + 1 tokens, one of which a turn boundary may merge away
    (a tokenizer whose normalizer deletes characters aside). A 1 MB observation tokenized whole
    took 2.2 s. With a chat template they are what
    the template puts after an assistant turn's text when a tool message (a user message, where the
    template has no tool role) and the next assistant turn follow: the assistant turn's end, the
    message, the generation prompt, the separators a turn boundary needs (a turn that ended with the
    end-of-turn token, turn_ids' last, already holds that one); without one, the text as it is."""
    from common.models import has_chat_template, stop_token_ids

    if room is not None and len(text) >= (room + 1) * longest_token(tokenizer):
        return None
    if not (chat_template and has_chat_template(tokenizer)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        before, after = observation_frame(tokenizer)
        ids = tokenizer(before + text + after, add_special_tokens=False)["input_ids"]
        ids = ids[1:] if ids[:1] == turn_ids[-1:] and ids[0] in stop_token_ids(tokenizer) else ids
    return None if room is not None and len(ids) >= room else ids


@functools.lru_cache(maxsize=4)
def longest_token(tokenizer) -> int:
    """The most characters a token of the vocabulary stands for: its string's length, which is its
    byte count under byte-level BPE (one character a byte) and its text's under SentencePiece."""
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)


@functools.lru_cache(maxsize=4)
def observation_frame(tokenizer) -> tuple[str, str]:
    """(before, after): the chat template's text around an observation's, found once by rendering a
    conversation with placeholders; a template that cannot continue after an assistant turn is
    one line (load_env asks before anything heavy)."""
    turn, slot = "Xq7Zw", "Yk3Vb"  # the assistant turn's text and the observation's, found again
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": turn}]
    for role in ("tool", "user"):
        try:
            alone = tokenizer.apply_chat_template(turns, tokenize=False)
            after = tokenizer.apply_chat_template(turns + [{"role": role, "content": slot}], tokenize=False,
                                                  add_generation_prompt=True)
        except Exception:  # e.g. a template whose roles must alternate user / assistant
            continue
        cut = alone.rfind(turn) + len(turn)
        if turn in alone and after[:cut] == alone[:cut] and after.count(slot) == 1:
            before, _, rest = after[cut:].partition(slot)
            return before, rest
    raise ConfigError("the chat template cannot render a tool or user message after an assistant turn as a "
                      "continuation of that turn, so observations cannot be appended (try --no-chat-template)")


@dataclass
class Episode:
    """One episode after its prompt, as the engine and the environment produced it: `token_ids`
    (the model's turns and the observations), `logprobs` (the engine's, per token, as vLLM gives
    them; 0 for observation tokens, which are not sampled) and `model_mask` (1: the model's token)."""
    prompt_ids: list[int]
    state: object
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    parts: list[list[str]] = field(default_factory=list)  # the transcript: ["model" | "env", text]
    finish_reason: str | None = None  # "stop": answered; "length": cut short (a limit or a timeout): truncated
    ended_by: str | None = None       # "answer", "turn_tokens", "budget", "max_turns" or "timeout"
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_moves: int = 0
    env_reward: float | None = None  # the environment's own score of the episode (Step.reward), if it gives one
    env_calls: int = 0  # the environment's steps on the episode's turns

    def add_turn(self, completion) -> None:
        """The engine's completion (vLLM's CompletionOutput or the transformers engine's)."""
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.model_mask += [1] * len(completion.token_ids)
        self.parts.append(["model", completion.text])

    def add_observation(self, ids: list[int], text: str) -> None:
        from common.engine import Logprob

        self.token_ids += ids
        self.logprobs += [{t: Logprob(0.0)} for t in ids]
        self.model_mask += [0] * len(ids)
        self.parts.append(["env", text])

    def end(self, why: str) -> None:
        self.ended_by, self.finish_reason = why, "stop" if why == "answer" else "length"

    @property
    def answer(self) -> str:
        """The final answer, which the task's verifier scores: the model's last turn."""
        return next((text for who, text in reversed(self.parts) if who == "model"), "")

    @property
    def transcript(self) -> str:
        return "".join(text for _, text in self.parts)


def episode_examples(episodes: list[Episode], examples: list[dict]) -> list[dict]:
    """Each episode's example as its reward sees it: the task's, with the episode's transcript
    (for --reward terms) and the environment's own score (env_reward: None where it gives none)."""
    return [{**example, "transcript": e.transcript, "env_reward": e.env_reward} for e, example in zip(episodes, examples)]


def env_reward(completion: str, example: dict) -> float:
    """A task's reward where the environment scores the episode (a game's outcome, Step.reward):
    example["env_reward"], which episode_examples sets; 0 for an episode that ended without one
    (a script's limit cut it). TextArena's tasks use it, and so can yours (examples/gym_env.py)."""
    reward = example.get("env_reward")
    return 0.0 if reward is None else float(reward)


def turns(episode: Episode) -> int:
    return sum(who == "model" for who, _ in episode.parts)


def episode_metrics(episodes: list[Episode], prefix: str = "env/") -> dict:
    """Means over the episodes: turns, tool calls, tool errors, invalid moves, observation tokens; the
    fractions that ended by the token budget and by --max-turns; and the counts of the environment's
    calls and of those past --env-timeout (summed over ranks: common/dist.py is_count). Where the
    environment scores episodes (a game), also turns_per_win: the mean turns of the episodes it
    scored 1 or more (NaN where none was won)."""
    n = len(episodes)
    metrics = {}
    if any(e.env_reward is not None for e in episodes):
        wins = [turns(e) for e in episodes if e.env_reward is not None and e.env_reward >= 1]
        metrics[f"{prefix}turns_per_win"] = sum(wins) / len(wins) if wins else float("nan")
    return {**metrics, f"{prefix}turns_mean": sum(turns(e) for e in episodes) / n,
            f"{prefix}tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
            f"{prefix}tool_errors_mean": sum(e.tool_errors for e in episodes) / n,
            f"{prefix}invalid_moves_mean": sum(e.invalid_moves for e in episodes) / n,
            f"{prefix}observation_tokens_mean": sum(len(e.model_mask) - sum(e.model_mask) for e in episodes) / n,
            f"{prefix}budget_frac": sum(e.ended_by == "budget" for e in episodes) / n,
            f"{prefix}max_turns_frac": sum(e.ended_by == "max_turns" for e in episodes) / n,
            f"{prefix}timeouts": float(sum(e.ended_by == "timeout" for e in episodes)),
            f"{prefix}calls": float(sum(e.env_calls for e in episodes))}
