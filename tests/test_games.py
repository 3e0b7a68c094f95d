"""TextArena's games through common/games.py: the adapter against scripted players, invalid moves,
the game's own turn limit, seeds and the trainer's `random`, refused games, and the game played by
grpo_multiturn.py on both engines, token-in/token-out."""

import json
import random
import sys

import pytest
import torch

from common.env import load_env, observation_ids
from common.errors import ConfigError
from common.games import checked_game, make_game_task, pair_task
from tests.conftest import ROOT

GAME = "textarena:GuessTheNumber-v0"
GUESS_MODEL = str(ROOT / "models" / "tiny-guess")


@pytest.fixture(scope="module")
def task():
    return make_game_task("GuessTheNumber-v0", seed=0, num_train=20, num_eval=20)


@pytest.fixture(scope="module")
def env(task):
    return load_env(GAME, task)


def play(env, example, moves):
    """Each move a function of the observations so far; the Steps until the game ends."""
    state, steps = env.start(example), []
    while not steps or steps[-1].observation is not None:
        steps.append(env.step(state, moves([s.observation for s in steps])))
    return steps


def binary_search(observations):
    """[the middle of what the hints leave]: 1..20, then halves."""
    low, high = 1, 20
    for guess, hint in zip(binary_search.guesses, observations):
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)
    binary_search.guesses = binary_search.guesses[:len(observations)] + [(low + high) // 2]
    return f"I guess [{binary_search.guesses[-1]}]"


def test_a_binary_search_player_wins_every_game_in_at_most_5_turns(env, task):
    turns = []
    for example in task.eval:
        binary_search.guesses = []
        steps = play(env, example, binary_search)
        assert steps[-1].reward == 1.0 and not any(s.invalid_move for s in steps)
        turns.append(len(steps))
    assert max(turns) <= 5 and len(set(turns)) > 1, turns  # ceil(log2 20) = 5; the targets differ


def test_an_invalid_move_is_counted_gets_one_retry_then_ends_the_game(env, task):
    state = env.start(task.eval[0])
    retry = env.step(state, "no bracket here")
    assert retry.invalid_move and "invalid move" in retry.observation and retry.reward is None
    end = env.step(state, "[99]")  # out of range: the second invalid move in a row
    assert end.observation is None and end.invalid_move and end.reward == 0.0  # no guess yet: no partial credit


def test_the_games_own_turn_limit_ends_it_with_its_partial_credit():
    """max_turns=2: wrong guesses end the game at its limit, with GuessTheNumber's partial credit
    1 - |last - target| / 19. TextArena 0.7.4 checks the limit before counting the turn, so the
    game takes max_turns + 1 guesses (3 here; GuessTheNumber-v0 "within 10 turns" takes 11)."""
    spec = "GuessTheNumber-v0:max_turns=2"
    task = make_game_task(spec, num_train=4, num_eval=4)
    short = load_env("textarena:" + spec, task)
    assert "within 2 turns" in task.eval[0]["prompt"]  # the prompt is the game's, with its options
    state = short.start(task.eval[0])
    target = state["game"].game_number
    guesses = [n for n in (1, 20, 2, 19) if n != target][:3]
    steps = [short.step(state, f"[{n}]") for n in guesses]
    assert [s.observation is None for s in steps] == [False, False, True] and not any(s.invalid_move for s in steps)
    assert steps[-1].reward == pytest.approx(1 - abs(guesses[-1] - target) / 19)


def test_the_games_own_limit_in_model_turns_is_max_turns_plus_one_each_with_its_retry():
    """--max-turns's default (env.max_turns): a player whose every other move is invalid (a retry) and
    whose valid ones are wrong plays exactly (2 + 1) x 2 = 6 turns of GuessTheNumber-v0:max_turns=2
    before the game ends it; GuessTheNumber-v0 (10 turns) allows 22."""
    spec = "GuessTheNumber-v0:max_turns=2"
    task = make_game_task(spec, num_train=4, num_eval=4)
    short = load_env("textarena:" + spec, task)
    assert short.max_turns == 6 and load_env(GAME, task).max_turns == 22
    state = short.start(task.eval[0])
    wrong = iter(n for n in range(1, 21) if n != state["game"].game_number)
    steps = [short.step(state, "no move" if i % 2 == 0 else f"[{next(wrong)}]") for i in range(short.max_turns)]
    assert [s.invalid_move for s in steps] == [True, False] * 3
    assert [s.observation is None for s in steps] == [False] * 5 + [True]  # the game's limit, not the script's


def test_the_seed_is_the_game_and_the_trainers_random_state_is_untouched(env, task):
    """Same seed, same target (found by counting up); interleaving two games changes neither; the
    caller's global `random` is where it was, though the library reseeds it in every reset."""
    def target(example, other=None):
        state = env.start(example)
        for n in range(1, 21):
            if other is not None:  # another game's calls in between
                env.step(env.start(other), f"[{n}]")
            if env.step(state, f"[{n}]").observation is None:
                return n
    random.seed(1234)
    before = random.getstate()
    targets = [target(e) for e in task.eval[:8]]
    assert random.getstate() == before
    assert targets == [target(e, other=task.eval[-1]) for e in task.eval[:8]]
    assert len(set(targets)) > 1  # the held-out games differ
    again = make_game_task("GuessTheNumber-v0", seed=0, num_train=20, num_eval=20)
    assert [e["game_seed"] for e in again.train] == [e["game_seed"] for e in task.train]
    other_run = make_game_task("GuessTheNumber-v0", seed=1, num_train=20, num_eval=20)
    assert [e["game_seed"] for e in other_run.train] != [e["game_seed"] for e in task.train]
    assert [e["game_seed"] for e in other_run.eval] == [e["game_seed"] for e in task.eval]  # held out: fixed
    assert not {e["game_seed"] for e in task.train} & {e["game_seed"] for e in task.eval}


@pytest.mark.parametrize("spec, said", [
    ("Wordle-v0", "needs the network (it tried to reach"),
    ("TicTacToe-v0", "not a single-player game"),
    ("QuantumTicTacToe-v0", "not a single-player game (its state is a TwoPlayerState)"),
    ("Chess-v0", "cannot be imported"),
    ("NoSuchGame-v0", "no game 'NoSuchGame-v0'"),
    ("GuessTheNumber-v0:colour=3", "failed to start (TypeError"),
    ("GuessTheNumber-v0:max_turns", "expected key=value"),
])
def test_a_game_that_cannot_run_here_is_refused_in_one_line(spec, said):
    with pytest.raises(ConfigError, match=None) as e:
        checked_game(spec)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_missing_textarena_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ConfigError, match=r"textarena package is missing \(pip install textarena==0.7.4\)"):
        checked_game("GuessTheNumber-v0")


def test_the_task_follows_the_game_and_other_pairings_are_refused():
    grpo_multiturn = pytest.importorskip("common.scripts").load_script("grpo_multiturn.py")
    args = grpo_multiturn.Args(env=GAME)
    pair_task(args)
    assert args.task == GAME
    with pytest.raises(ConfigError, match="use --task textarena:GuessTheNumber-v0"):
        pair_task(grpo_multiturn.Args(env=GAME, task="sort"))
    with pytest.raises(ConfigError, match="play it with --env textarena:GuessTheNumber-v0"):
        pair_task(grpo_multiturn.Args(task=GAME))
    grpo = pytest.importorskip("common.scripts").load_script("grpo.py")
    with pytest.raises(ConfigError, match="in grpo_multiturn.py"):
        pair_task(grpo.Args(task=GAME))


def test_the_bundled_model_plays_legal_moves_badly(task, env):
    """models/tiny-guess (scripts/make_tiny_guess_model.py): its greedy moves are mostly legal, and it
    wins some games but not all: RL has something to learn."""
    from scripts.make_tiny_guess_model import evaluate
    from common.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(GUESS_MODEL)
    model = load_policy(GUESS_MODEL, tokenizer, "float32", "cpu")
    m = evaluate(model, tokenizer, env, task.eval, max_turns=12)
    assert 0.1 <= m["win_rate"] <= 0.7 and m["turns_per_win"] > 4.3, m


@pytest.mark.parametrize("engine_kind", ["vllm", "transformers"])
def test_game_episodes_are_the_engines_ids_and_the_messages_ids(task, engine_kind, monkeypatch):
    """run_episodes in the game at temperature 1: each episode's tokens are, turn by turn, the ids the
    engine sampled and the ids of the game's message tokenized on its own (observation_ids), the
    next turn continues from exactly those, and the trainer's log-probs of the model's tokens are
    the engine's."""
    from common.batch import episode_batch
    from common.engine import create_engine, sampled_logprobs, sync_weights
    from common.models import encode_prompts, load_policy, load_tokenizer
    from common.ops import forward_logprobs
    from common.scripts import load_script
    from tests.conftest import GPU_SHARE, keep_engine, vllm_module

    grpo_multiturn = load_script("grpo_multiturn.py")
    tokenizer = load_tokenizer(GUESS_MODEL)
    policy = load_policy(GUESS_MODEL, tokenizer, "float32", "cpu")
    if engine_kind == "vllm":
        vllm_module()
        llm = keep_engine(create_engine(GUESS_MODEL, seed=0, max_model_len=128, dtype="float32",
                                        gpu_memory_utilization=GPU_SHARE, cpu_kv_cache_gib=1, sleep_mode=False))
    else:
        llm = create_engine(GUESS_MODEL, seed=0, max_model_len=128, engine="transformers")
        sync_weights(llm, policy)
    requests = []
    generate = llm.generate

    def recorded(prompts, params, **kwargs):
        requests.extend(p["prompt_token_ids"] for p in prompts)
        return generate(prompts, params, **kwargs)

    monkeypatch.setattr(llm, "generate", recorded)
    args = grpo_multiturn.Args(engine=engine_kind, env=GAME, max_turns=20, max_turn_tokens=4, max_new_tokens=64)
    env = load_env(GAME, task)
    torch.manual_seed(0)
    examples = task.train[:8]
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], True, None)
    episodes = grpo_multiturn.run_episodes(llm, env, tokenizer, prompt_ids, examples, args, temperature=1.0)
    assert sum(len(e.parts) > 4 for e in episodes) >= 4  # several turns
    for p, e in zip(prompt_ids, episodes):
        ids, k = list(p), 0
        for who, text in e.parts:
            if who == "model":
                assert ids in requests  # the turn continued from exactly these ids
                n = e.model_mask[k:].index(0) if 0 in e.model_mask[k:] else len(e.model_mask) - k
            else:
                n = len(observation_ids(tokenizer, text, True, []))
                assert e.token_ids[k:k + n] == observation_ids(tokenizer, text, True, [])
            ids += e.token_ids[k:k + n]
            k += n
        assert ids == list(p) + e.token_ids and k == len(e.token_ids)
    input_ids, attention_mask, completion_mask, _, _ = episode_batch(prompt_ids, episodes, tokenizer.pad_token_id,
                                                                     "cpu")
    C = completion_mask.shape[1]
    with torch.no_grad():
        trainer = forward_logprobs(policy, input_ids, attention_mask, C, temperature=1.0)
    engine = sampled_logprobs(episodes, C, "cpu")
    mismatch = float((trainer - engine)[completion_mask.bool()].abs().max())
    assert mismatch < 1e-4, mismatch


def test_grpo_multiturn_trains_on_the_game(tmp_path, run_main):
    """Two steps of grpo_multiturn.py in the game, its turn limit the game's own (no --max-turns): the task
    follows --env, every reward is the game's
    outcome (1 for a win, else its partial credit, in [0, 1]), the transcripts alternate the model's
    moves and the game's messages, and the game's metrics are logged."""
    out = tmp_path / "run"
    args = run_main("grpo_multiturn.py", "--engine", "transformers", "--model", GUESS_MODEL, "--env", GAME,
                    "--steps", "2", "--prompts-per-step", "4", "--completions-per-prompt", "4",
                    "--max-turn-tokens", "4", "--eval-every", "0", "--save-every", "0",
                    "--log-completions", "16", "--output-dir", out)
    assert args.task == GAME
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert {"env/invalid_moves_mean", "eval/env/turns_per_win", "eval/env/invalid_moves_mean"} <= set(metrics[-1])
    assert metrics[-1]["env/turns_mean"] > 2 and 0.1 <= metrics[0]["eval/accuracy"] <= 0.7
    train = [m for m in metrics if "env/max_turns_frac" in m]  # (a step-0 line holds the evaluation only)
    assert len(train) == 2 and all(m["env/max_turns_frac"] == 0 for m in train)  # only the game ends its games
    records = [json.loads(line) for line in (out / "completions.jsonl").open()]
    assert len(records) == 32
    for r in records:
        parts = r["completion"]
        assert [who for who, _ in parts] == (["model", "env"] * len(parts))[:len(parts)]
        assert all(text.startswith("\n") for who, text in parts if who == "env")
        assert 0.0 <= r["reward"] <= 1.0
        assert r["reward"] < 1 or parts[-1][0] == "model"  # a win ends the game at the model's move
    rewards = [r["reward"] for r in records]
    assert 1.0 in rewards and min(rewards) < 1.0  # wins and losses: a signal


def test_another_librarys_environment_through_the_ten_line_adapter():
    """examples/gym_env.py: a gym-style environment, in the worker processes like any FILE.py:FUNCTION
    environment; a player counting up finds the secret, and the episode's reward is the environment's."""
    from common.env import Episode, env_reward, episode_examples
    from common.tasks import load_task

    task = load_task("examples/gym_env.py:hot_cold_task", seed=0)
    env = load_env("examples/gym_env.py:hot_cold", task)
    for example in task.eval[:5]:
        steps = play(env, example, lambda observations: f"{len(observations)}")
        secret = random.Random(example["game_seed"]).randrange(10)  # as HotCold.reset draws it
        assert len(steps) == min(secret + 1, 8) and steps[-1].reward == (1.0 if secret < 8 else 0.0)
        assert all("hotter" in s.observation or "colder" in s.observation for s in steps[:-1])
        episode = Episode([], None, parts=[["model", "0"]], env_reward=steps[-1].reward)
        assert task.reward("0", episode_examples([episode], [example])[0]) == steps[-1].reward
    assert env_reward("0", {"prompt": "p"}) == 0.0  # an episode a limit cut: no outcome
