"""TextArena's single-player games (textarena, pinned) as a multi-turn environment and its task.

    --env textarena:GAME-ID[:key=value,...]   grpo_multiturn.py plays the game: GuessTheNumber-v0,
                                              TowerOfHanoi-v0, Mastermind-v0:code_length=3, ...
    --task textarena:GAME-ID[:key=value,...]  its prompts and held-out games (the same spec: leave
                                              --task out and it follows --env)

The key=value pairs are the game's constructor arguments (ta.make(GAME-ID, **kwargs)), read as
Python literals. Each episode is its own game, reset with the example's seed (`game_seed`: the
train games' from the run's seed, the held-out games' fixed); the game's first message is the
prompt, the model's turn is the action text (the turn ends at "]": the games read a bracketed
move such as [7]), and the observation is the game's new messages only (the transcript already
holds the history, token-in/token-out). The episode's reward is the game's final reward (1 for a
win; the game's partial credit otherwise); an episode a script limit cuts (--max-turns, the token
budget, a timeout) has no outcome and scores 0; --max-turns defaults to the game's own limit in
model turns, its retries included (GuessTheNumber-v0: 22). An invalid move is counted
(env/invalid_moves_mean); the game gives one retry message, then ends the game.

The library reseeds Python's global `random` in reset and draws from it in its games: every call
into a game runs with that game's own `random` state, swapped in and out (own_random), so the
trainer's state is untouched and a game plays the same whatever runs between its turns. A game
that needs the network (word lists from nltk.download), a second player or a module that is
missing is refused in one line before any model loads (checked_game).

A game runs in the run's own process (as the calculator does): the library's games are plain Python,
and a game object must live across turns.
"""

from __future__ import annotations

import ast
import contextlib
import io
import random
import socket

from common.env import Environment, Step, env_reward
from common.errors import ConfigError

PIN = "textarena==0.7.4"
NUM_TRAIN, NUM_EVAL, EVAL_SEED = 2000, 200, 10**9  # held-out games: seeds EVAL_SEED + i, every run the same


def parse_spec(spec: str) -> tuple[str, dict]:
    """'GuessTheNumber-v0:max_turns=5' -> ('GuessTheNumber-v0', {'max_turns': 5})."""
    game, _, options = spec.partition(":")
    kwargs = {}
    for item in filter(None, (s.strip() for s in options.split(","))):
        key, eq, value = item.partition("=")
        if not (eq and key.strip().isidentifier()):
            raise ConfigError(f"textarena:{spec}: expected key=value after the game, got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    if not game:
        raise ConfigError("textarena: expected textarena:GAME-ID[:key=value,...], e.g. textarena:GuessTheNumber-v0")
    return game, kwargs


@contextlib.contextmanager
def own_random(state: dict):
    """The block runs with the game's own global `random` state (state["random"]; None: the
    current one, which the game's reset reseeds); the caller's is restored after it."""
    saved = random.getstate()
    if state["random"] is not None:
        random.setstate(state["random"])
    try:
        yield
    finally:
        state["random"] = random.getstate()
        random.setstate(saved)


class _Offline(OSError):
    pass


@contextlib.contextmanager
def no_network(attempts: list):
    """Connections refused (each host it tried appended to attempts) and the library's own
    prints (nltk's download errors) kept off the terminal, for the check of a game."""
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def refuse_lookup(host, *args, **kwargs):
        attempts.append(str(host))
        raise _Offline(f"no network: {host}")

    def refuse_connect(sock, address):
        attempts.append(str(address[0] if isinstance(address, tuple) else address))
        raise _Offline(f"no network: {address}")

    socket.getaddrinfo, socket.socket.connect = refuse_lookup, refuse_connect
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect


def make_game(spec: str):
    """A new game of spec (GAME-ID[:key=value,...]), its raw version (the new messages only)."""
    try:
        import textarena as ta
    except ImportError:
        raise ConfigError(f"textarena:{spec}: the textarena package is missing (pip install {PIN})") from None
    game, kwargs = parse_spec(spec)
    game_id = game if game.endswith("-raw") else f"{game}-raw"
    if game_id not in ta.envs.registration.ENV_REGISTRY:
        raise ConfigError(f"textarena:{spec}: no game {game!r} in textarena (ids such as GuessTheNumber-v0, "
                          f"TowerOfHanoi-v0, Mastermind-v0: textarena.envs.registration.ENV_REGISTRY)")
    return ta.make(game_id, **kwargs)


def checked_game(spec: str):
    """make_game's game, reset once (seed 0) with the network off: a game that tries to reach it, is
    not for one player, needs a missing module or fails to start is one line. Returns the game."""
    attempts: list[str] = []
    try:
        with no_network(attempts):
            env = make_game(spec)
            with own_random({"random": None}):
                env.reset(num_players=1, seed=0)
                env.get_observation()
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:
        said = next((line.strip() for line in str(e).splitlines() if any(c.isalpha() for c in line)), "")
        what = f"{type(e).__name__}: {said}"
        if attempts or isinstance(e, LookupError):
            where = f" (it tried to reach {attempts[0]})" if attempts else ""
            raise ConfigError(f"textarena:{spec}: the game needs the network{where}, for data it downloads "
                              f"(nltk word lists); runs here are offline: pick another game ({what})") from None
        if isinstance(e, AssertionError) and "number of players" in str(e):
            raise ConfigError(f"textarena:{spec}: not a single-player game ({e}); grpo_multiturn.py plays one "
                              f"player's games") from None
        if isinstance(e, (ImportError, SyntaxError)):
            raise ConfigError(f"textarena:{spec}: the game cannot be imported ({what}): a module it needs is "
                              f"missing, or it does not run on this Python") from None
        raise ConfigError(f"textarena:{spec}: the game failed to start ({what})") from None
    state = type(getattr(env, "state", None)).__name__
    if state != "SinglePlayerState":  # some games of several players start with one, then wait for the others
        raise ConfigError(f"textarena:{spec}: not a single-player game (its state is a {state}); grpo_multiturn.py "
                          f"plays one player's games")
    return env


class TextArenaGame(Environment):
    """A TextArena game an episode: start resets a new game with the example's seed, step plays the
    model's turn as the action and answers with the game's new messages, or ends the episode with
    the game's reward (Step.reward) when the game is over."""
    stop = ("]",)

    def __init__(self, spec: str):
        self.spec = spec
        state = checked_game(spec).state
        # the game's own limit in model turns: TextArena 0.7.4 ends a game after max_turns + 1 moves
        # (it checks the limit before counting the turn), each after at most error_allowance retries
        self.max_turns = (state.max_turns + 1) * (1 + state.error_allowance) if state.max_turns else None

    def start(self, example: dict) -> dict:
        state, _ = new_game(self.spec, int(example.get("game_seed", 0)))  # the prompt: the example holds it
        return state

    def step(self, state: dict, turn: str) -> Step:
        game = state["game"]
        with own_random(state):
            done, _ = game.step(turn)
            if done:
                rewards, info = game.close()
                invalid = bool((info or {}).get(0, {}).get("invalid_move"))
                return Step(None, reward=float((rewards or {}).get(0, 0.0)), invalid_move=invalid)
            player, messages = game.get_observation()
        new = [message for sender, message, _ in messages if sender != player]  # not the model's own move again
        invalid = any("invalid move" in message for message in new)
        return Step("\n" + "\n".join(new) + "\n", invalid_move=invalid)


def new_game(spec: str, seed: int) -> tuple[dict, str]:
    """(an episode's state: a game reset with seed and its own `random` state, the game's messages
    before the first move: its rules and board, the prompt)."""
    state = {"game": make_game(spec), "random": None}
    with own_random(state):
        state["game"].reset(num_players=1, seed=seed)
        _, messages = state["game"].get_observation()
    return state, "\n".join(message for _, message, _ in messages)


def make_game_task(spec: str, seed: int = 0, num_train: int = NUM_TRAIN, num_eval: int = NUM_EVAL):
    """--task textarena:SPEC: train games seeded from `seed`, held-out games seeded EVAL_SEED + i (the
    same for every run, never a train seed); each example's prompt is its game's first message."""
    from common.tasks import Task

    checked_game(spec)
    rng = random.Random(seed)
    train_seeds = [rng.randrange(EVAL_SEED) for _ in range(num_train)]

    def example(game_seed: int) -> dict:
        return {"prompt": new_game(spec, game_seed)[1], "answer": "", "game_seed": game_seed}

    return Task(f"textarena:{spec}", [example(s) for s in train_seeds],
                [example(EVAL_SEED + i) for i in range(num_eval)], env_reward)


def pair_task(args) -> None:
    """A game is both the environment and the task: --env textarena:SPEC with --task left at its
    default plays the game's own prompts (args.task becomes textarena:SPEC, in place); any other
    pairing of a game with something else is one line."""
    env, task = getattr(args, "env", None), args.task
    default_task = type(args).__dataclass_fields__["task"].default
    if env is not None and env.startswith("textarena:"):
        if task == default_task:
            args.task = task = env
        if task != env:
            raise ConfigError(f"--env {env} plays the game's own prompts and scores its outcome: use --task {env} "
                              f"(or leave --task out), not --task {task}")
    elif task.startswith("textarena:"):
        raise ConfigError(f"--task {task} is a game, scored by its outcome: play it with --env {task}"
                          + ("" if env is not None else " in grpo_multiturn.py (a game has several turns)"))
