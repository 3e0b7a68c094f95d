"""Build the bundled tiny guessing model, models/tiny-guess: a 4-layer Qwen2 (as models/tiny-sort)
with a byte-level BPE tokenizer learned on the game's texts, warm-started by supervised training
on TextArena's GuessTheNumber-v0 (a number from 1 to 20, 10 guesses, "higher" / "lower" after
each) played badly but legally, through the project's own adapter (common/games.py), raw text:

    <the game's rules>[13]\\nThe target number is lower.\\n[4]\\nThe target number is higher.\\n[9] ...

The demonstrations play legal moves only (a number not guessed yet), and most of them misread
the hints: a game reads every hint right with probability --p-right (0.4), guessing inside what
the hints leave, else reads every one backwards ("higher" as lower), guessing where the target
is not (then anywhere, once nothing is left there). models/tiny-sort's recipe: demonstrations that
mostly do the unrewarded thing. Greedy, the model misreads and starts with a low win rate;
sampled, it reads the hints right in some games, which win, and RL with the game
(grpo_multiturn.py --env textarena:GuessTheNumber-v0) can learn to read them right in every game
(binary search, the middle of what they leave, wins every game in at most 5 guesses, 3.7 on
average; a uniform guess inside it in about 5).

The tokenizer: models/tiny-sort's, one token a character, plus each of the game's fixed messages
(the ~600-character rules, which are the prompt; "The target number is higher." and "lower.";
the invalid-move messages) and each legal move ("[1]" ... "[20]") as one token of its own, so that
a whole game fits the context of 128 positions and a guess is one choice (with a move spelled in
characters, "[17]" as 4 tokens, the model learned to repeat its favourite guesses: 1.7 invalid
moves a game, greedy). Anything else the model writes is characters; a turn ends at "]" (the
game's stop string).

    python scripts/make_tiny_guess_model.py            # writes models/tiny-guess/

Seeded and deterministic on one CPU thread.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.games import TextArenaGame, make_game_task  # noqa: E402
from scripts.make_tiny_model import make_tokenizer as make_char_tokenizer, tiny_config  # noqa: E402
from scripts.make_tiny_tool_model import encode, sft_batch  # noqa: E402

GAME = "GuessTheNumber-v0"
LOW, HIGH = 1, 20
MAX_LEN = 128  # max_position_embeddings: the prompt and every turn must fit


@dataclass
class Args:
    output_dir: str = "models/tiny-guess"
    """where the model and tokenizer are saved"""
    seed: int = 0
    hidden_size: int = 128
    """head_dim = hidden_size / num_heads must be 64: vLLM's CPU attention rejects 16"""
    num_layers: int = 4
    num_heads: int = 2
    lr: float = 1e-3
    """peak learning rate, decayed linearly to 0"""
    batch_size: int = 32
    sft_steps: int = 1000
    p_right: float = 0.4
    """fraction of the demonstrations that read the hints right (the others misread every one)"""
    eval_every: int = 250
    eval_games: int = 100
    max_turns: int = 12
    """turns of an evaluation episode (the game's own limit, 10 guesses, ends it first unless moves are invalid)"""


def guess(rng: random.Random, guessed: set, low: int, high: int) -> int:
    """A demonstration's next guess: a number not guessed yet in [low, high], else any not guessed yet."""
    inside = [n for n in range(low, high + 1) if n not in guessed]
    return rng.choice(inside or [n for n in range(LOW, HIGH + 1) if n not in guessed])


def demonstration(env: TextArenaGame, example: dict, rng: random.Random, p_right: float) -> list[tuple[str, bool]]:
    """(text, trained) segments of one game played by the demonstration policy: the prompt and the
    game's messages are not trained, the moves are. With probability p_right the game reads the
    hints right (each guess inside what they leave), else it misreads every one ("higher" as lower)."""
    state, segments = env.start(example), [(example["prompt"], False)]
    guessed, low, high, right = set(), LOW, HIGH, rng.random() < p_right
    while True:
        n = guess(rng, guessed, low, high)
        guessed.add(n)
        segments.append((f"[{n}]", True))
        step = env.step(state, f"[{n}]")
        if step.observation is None:
            return segments
        segments.append((step.observation, False))
        if ("higher" in step.observation) == right:
            low = max(low, n + 1)
        else:
            high = min(high, n - 1)


def make_tokenizer(messages: list[str]):
    """make_tiny_model's tokenizer (one token a character) with each of the game's fixed messages and
    each move as one more token of its own (an added token: matched before the character split)."""
    tokenizer = make_char_tokenizer()
    tokenizer.add_tokens(sorted(set(messages)))
    return tokenizer


@torch.no_grad()
def evaluate(model, tokenizer, env: TextArenaGame, examples: list[dict], max_turns: int) -> dict:
    """Greedy games, token-in/token-out as grpo_multiturn.py plays them: the win rate, the turns per
    win, the invalid moves per game and the mean reward."""
    model.eval()
    contexts = [encode(tokenizer, e["prompt"]) for e in examples]
    states = [env.start(e) for e in examples]
    reward, turns, invalid = [0.0] * len(examples), [0] * len(examples), [0] * len(examples)
    live = list(range(len(examples)))
    for _ in range(max_turns):
        width = max(len(contexts[i]) for i in live)
        pad = tokenizer.pad_token_id
        batch = torch.tensor([[pad] * (width - len(contexts[i])) + contexts[i] for i in live])
        mask = torch.tensor([[0] * (width - len(contexts[i])) + [1] * len(contexts[i]) for i in live])
        out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)[:, width:].tolist()
        still = []
        for i, ids in zip(live, out):
            cut = next((k + 1 for k in range(len(ids)) if "]" in tokenizer.decode(ids[: k + 1])), len(ids))
            turn_ids = ids[:cut]
            turns[i] += 1
            step = env.step(states[i], tokenizer.decode(turn_ids))
            invalid[i] += step.invalid_move
            if step.observation is None:
                reward[i] = step.reward or 0.0
                continue
            contexts[i] += turn_ids + encode(tokenizer, step.observation)
            if len(contexts[i]) + 4 <= MAX_LEN:
                still.append(i)
        live = still
        if not live:
            break
    wins = [t for t, r in zip(turns, reward) if r >= 1]
    n = len(examples)
    return {"win_rate": len(wins) / n, "turns_per_win": sum(wins) / max(len(wins), 1),
            "invalid_moves": sum(invalid) / n, "reward_mean": sum(reward) / n}


def report(m: dict) -> str:
    return (f"held-out greedy win rate {m['win_rate']:.3f}, turns per win {m['turns_per_win']:.2f}, "
            f"invalid moves per game {m['invalid_moves']:.2f}, mean reward {m['reward_mean']:.3f}")


def main(args: Args) -> None:
    start = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # bit-for-bit reproducible across machines with the same torch
    rng = random.Random(args.seed)
    task, env = make_game_task(GAME, seed=args.seed), TextArenaGame(GAME)
    games = [demonstration(env, task.train[i % len(task.train)], rng, args.p_right)
             for i in range(args.batch_size * args.sft_steps)]
    # the game's fixed messages, each one token: the rules (the prompt), the hints, the invalid moves'
    invalid = [env.step(env.start(task.train[0]), move).observation for move in ("[0]", "guess")]
    repeat = env.start(task.train[0])
    env.step(repeat, "[1]")
    messages = [task.train[0]["prompt"]] + [text for g in games[:100] for text, trained in g[1:] if not trained]
    moves = [f"[{n}]" for n in range(LOW, HIGH + 1)]
    tokenizer = make_tokenizer([m for m in messages + invalid + [env.step(repeat, "[1]").observation] if m] + moves)
    model = Qwen2ForCausalLM(tiny_config(tokenizer, args, MAX_LEN))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / args.sft_steps)
    held_out = task.eval[: args.eval_games]
    metrics = evaluate(model, tokenizer, env, held_out, args.max_turns)
    for step in range(1, args.sft_steps + 1):
        model.train()
        loss = model(**sft_batch(tokenizer, games[(step - 1) * args.batch_size: step * args.batch_size])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.sft_steps:
            metrics = evaluate(model, tokenizer, env, held_out, args.max_turns)
            print(f"sft step {step} ({time.time() - start:.0f} s): loss {loss.item():.3f}, {report(metrics)}",
                  flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"saved {args.output_dir}: {sum(p.numel() for p in model.parameters())} parameters, {len(tokenizer)} "
          f"tokens (the prompt: {len(encode(tokenizer, task.eval[0]['prompt']))}), {step} SFT steps, "
          f"{time.time() - start:.0f} s; {report(metrics)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
