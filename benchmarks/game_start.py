"""Which TextArena game can a model start on? Greedy held-out games of each, before any training,
as grpo_multiturn.py plays and scores them (its run_episodes, the game's task and environment):
win rate, mean reward, invalid moves and turns per game, and the first transcripts.

    .venv/bin/python benchmarks/game_start.py --model smollm2 --games GuessTheNumber-v0 TowerOfHanoi-v0 \\
        --episodes 50 --json benchmarks/results/game_start_smollm2.json -- --max-turn-tokens 64 --max-new-tokens 512

Flags after `--` are grpo_multiturn.py's (the limits, --system-prompt). Greedy by default;
`--sampled` plays each game `--completions-per-prompt` times at `--temperature`, as a training step samples it.
RL needs a start where some episodes win or score partly and moves are mostly legal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.args import parse_args  # noqa: E402
from common.engine import create_engine, sync_weights  # noqa: E402
from common.env import episode_metrics, load_env  # noqa: E402
from common.models import encode_prompts, load_policy  # noqa: E402
from common.scripts import load_script  # noqa: E402
from common.setup import Precision, engine_options, prepare  # noqa: E402

grpo_multiturn = load_script("grpo_multiturn.py")


def setup(game: str, model: str, flags: list[str]) -> tuple:
    """The game's arguments, task, environment and tokenizer, as grpo_multiturn.py's main() makes them."""
    args = parse_args(grpo_multiturn.Args, ["--model", model, "--env", f"textarena:{game}", *flags])
    task, _, tokenizer, max_prompt_len = prepare(args, grpo_multiturn.check)
    env = load_env(args.env, task, args.env_timeout, tokenizer, args.chat_template)
    return args, task, env, tokenizer, max_prompt_len


def play(llm, game: str, args, task, env, tokenizer, episodes: int, sampled: bool) -> dict:
    """The game's numbers and first transcripts on its first held-out games: greedy, or sampled as training does."""
    examples, temperature = task.eval[:episodes], args.temperature if sampled else 0.0
    if sampled:
        examples = [e for e in examples for _ in range(args.completions_per_prompt)]
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], args.chat_template, args.system_prompt)
    start = time.perf_counter()
    played = grpo_multiturn.run_episodes(llm, env, tokenizer, prompt_ids, examples, args,
                                          temperature=temperature)
    rewards = [e.env_reward or 0.0 for e in played]
    return {"game": game, "episodes": len(played), "temperature": temperature,
            "win_rate": sum(r >= 1 for r in rewards) / len(played),
            "reward_mean": sum(rewards) / len(played), "prompt_tokens": max(map(len, prompt_ids)),
            **{k.removeprefix("env/"): v for k, v in episode_metrics(played).items()},
            "ended_by": {why: sum(e.ended_by == why for e in played) for why in sorted({e.ended_by for e in played})},
            "seconds": time.perf_counter() - start, "transcripts": [e.parts for e in played[:3]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--games", nargs="+", default=["GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0"])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--sampled", action="store_true", help="sample each game --completions-per-prompt times at --temperature")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("flags", nargs="*", help="grpo_multiturn.py's flags, after --")
    a = parser.parse_args()
    games = [(game, *setup(game, a.model, a.flags)) for game in a.games]  # every check before the engine
    args = games[0][1]
    options = engine_options(args, max(g[5] for g in games), Precision.of(args, args.device))  # the longest prompt
    llm = create_engine(args.model, **options)
    if args.engine == "transformers":
        sync_weights(llm, load_policy(args.model, games[0][4], args.dtype, args.device))
    results = []
    for game, args, task, env, tokenizer, _ in games:
        result = play(llm, game, args, task, env, tokenizer, a.episodes, a.sampled)
        results.append(result)
        print(f"{game}: win rate {result['win_rate']:.2f}, mean reward {result['reward_mean']:.3f}, invalid moves "
              f"{result['invalid_moves_mean']:.2f} and turns {result['turns_mean']:.2f} a game, ended by "
              f"{result['ended_by']}, {result['seconds']:.0f} s", flush=True)
        for parts in result["transcripts"][:1]:
            print("  " + " | ".join(f"{who}: {text.strip()[:100]!r}" for who, text in parts[:8]))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "flags": a.flags, "measured": time.strftime(
            "%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
