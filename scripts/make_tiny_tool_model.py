"""Build the bundled tiny tool-calling model, models/tiny-tool: the architecture and tokenizer of
models/tiny-sort (scripts/make_tiny_model.py), warm-started by supervised training on the
`multiply` task ("123*45=" -> "5535", operands of 1 to 3 digits) in the calculator
environment's multi-turn format (common/env.py), raw text, no chat template:

    123*45=<call>123*45</call><result>5535</result>5535<|im_end|>     with the tool
    7*8=56<|im_end|>                                                  without it

The model's first turn is "<call>123*45</call>" (the engine stops it at "</call>"), the
environment (common/calculator.py) writes the observation "<result>5535</result>", and the model's
second turn copies the result, then EOS. The loss is on the model's tokens only, not on the prompt
or the observation.

Why: a 1M-parameter model cannot multiply 3-digit numbers, but it can copy them into a call and
copy the result back. The demonstrations call the tool with a probability that grows with the
total number of digits of the operands (--tool-p2 ... --tool-p6), so the model calls it greedily
on long problems only, and at temperature 1 sometimes on medium ones: held-out greedy accuracy
starts low (it is right on the long problems it calls the tool for and on some small products),
and RL with the tool (grpo_multiturn.py) can learn that calling it pays on every problem.

    python scripts/make_tiny_tool_model.py            # writes models/tiny-tool/

Seeded and deterministic on one CPU thread; 3.5 minutes on this project's CPU (2 shared cores,
2026-12-02), 1.06 M parameters, 4.3 MB. Measured on the 200 held-out problems, greedy, with the
calculator: accuracy 0.365, tool-call rate 0.155 (21/21 of the 6-digit problems, 10/45 of the
5-digit ones, none shorter), accuracy of the episodes that call it 0.968 (the call copies the
expression exactly as often); without the tool it is right on 0.81 of the 2-digit problems
(7*8), 0.41 of the 3-digit, 0.12 of the 4-digit and none longer. At temperature 1 the first
token opens a call with probability 0.01 / 0.03 / 0.12 / 0.28 / 0.90 for 2 / 3 / 4 / 5 / 6
digits in all. vLLM (temperature 0, stop "</call>") gives the same accuracy and call rate.

The model calls the tool greedily where it is unsure of the product's first digit, so greedy
accuracy is about the small products it knows (~0.2) plus the call rate: measured, tool
probabilities (.05, .2, .35) for 3-5 digits give 0.42 at a call rate of 0.22, (.1, .25, .3) in
400 steps 0.45 at 0.29; (.05, .2, .5) for 1,000 steps at a constant learning rate 0.47 at
0.17 (the small products learned further: 0.90 of the 2-digit problems).
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.calculator import calculate  # noqa: E402
from common.tasks import load_task  # noqa: E402
from scripts.make_tiny_model import EOS, make_tokenizer, tiny_config  # noqa: E402

CALL, RESULT = ("<call>", "</call>"), ("<result>", "</result>")
MAX_LEN = 128  # max_position_embeddings: prompt and every turn must fit


@dataclass
class Args:
    output_dir: str = "models/tiny-tool"
    """where the model and tokenizer are saved"""
    seed: int = 0
    hidden_size: int = 128
    """head_dim = hidden_size / num_heads must be 64: vLLM's CPU attention rejects 16"""
    num_layers: int = 4
    num_heads: int = 2
    lr: float = 1e-3
    """peak learning rate, decayed linearly to 0 (constant, the greedy numbers swing by 0.1 between evaluations)"""
    batch_size: int = 64
    sft_steps: int = 500
    tool_p2: float = 0.0
    """probability that a demonstration calls the tool when the operands have 2 digits in all"""
    tool_p3: float = 0.05
    """... 3 digits in all (e.g. 7*42)"""
    tool_p4: float = 0.15
    """... 4 digits in all (e.g. 12*34, 5*678)"""
    tool_p5: float = 0.3
    """... 5 digits in all (e.g. 12*345)"""
    tool_p6: float = 0.9
    """... 6 digits in all (e.g. 123*456)"""
    eval_every: int = 100
    max_turns: int = 3
    """turns of an evaluation episode (a turn that still calls the tool at the last is the final answer)"""
    max_turn_tokens: int = 24


def total_digits(prompt: str) -> int:
    return sum(c.isdigit() for c in prompt)


def operands(prompt: str) -> str:
    """'123*45=' -> '123*45', the expression a call copies."""
    return prompt.removesuffix("=")


def demonstration(example: dict, use_tool: bool) -> list[tuple[str, bool]]:
    """(text, trained) segments of one episode: the prompt and the observation are not trained."""
    answer = example["answer"]
    if not use_tool:
        return [(example["prompt"], False), (answer + EOS, True)]
    expression = operands(example["prompt"])
    return [(example["prompt"], False), (CALL[0] + expression + CALL[1], True),
            (RESULT[0] + calculate(expression) + RESULT[1], False), (answer + EOS, True)]


def encode(tokenizer, text: str) -> list[int]:
    """The text's ids, which decode to the text again (EOS included)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text, text
    return ids


def sft_batch(tokenizer, episodes: list[list[tuple[str, bool]]]) -> dict:
    rows, labels = [], []
    for segments in episodes:
        ids, lab = [], []
        for text, trained in segments:
            seg = encode(tokenizer, text)
            ids += seg
            lab += seg if trained else [-100] * len(seg)
        assert len(ids) <= MAX_LEN
        rows.append(ids)
        labels.append(lab)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])}


@torch.no_grad()
def greedy_turns(model, tokenizer, contexts: list[str], max_new_tokens: int) -> list[str]:
    """One greedy turn of each context: the text up to EOS, or up to and including "</call>"
    (generating past the stop string and cutting there is the same as stopping: greedy)."""
    tokenizer.padding_side = "left"
    batch = tokenizer(contexts, return_tensors="pt", padding=True, add_special_tokens=False)
    max_new_tokens = min(max_new_tokens, MAX_LEN - batch["input_ids"].shape[1])
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return [t[: t.index(CALL[1]) + len(CALL[1])] if CALL[1] in t else t for t in texts]


def observation(turn: str) -> str | None:
    """The calculator environment's answer to a turn (as common/env.py's Calculator): None if the
    turn has no call (it is the final answer)."""
    if CALL[1] not in turn:
        return None
    call = re.search(r"<call>(.*)</call>\s*$", turn, re.DOTALL)
    result = calculate(call.group(1).rsplit(CALL[0], 1)[-1]) if call else "error: </call> without <call>"
    return RESULT[0] + result + RESULT[1]


@torch.no_grad()
def evaluate(model, tokenizer, examples, max_turns: int, max_turn_tokens: int) -> dict:
    """Greedy multi-turn episodes with the calculator: accuracy (the final turn, stripped, is the
    answer), the tool-call rate (episodes with a call), the accuracy of the episodes that call it,
    the rate at which a first call copies the expression exactly, and per total digit count the
    greedy accuracy, call rate and the probability of starting a call at temperature 1."""
    model.eval()
    contexts = [e["prompt"] for e in examples]
    final = [None] * len(examples)
    called, first_call = [False] * len(examples), [None] * len(examples)
    active = list(range(len(examples)))
    for turn_no in range(max_turns):
        turns = greedy_turns(model, tokenizer, [contexts[i] for i in active], max_turn_tokens)
        still = []
        for i, turn in zip(active, turns):
            obs = observation(turn)
            if obs is None or turn_no == max_turns - 1:
                final[i] = turn
                continue
            called[i] = True
            first_call[i] = first_call[i] or turn
            contexts[i] += turn + obs
            still.append(i)
        active = still
        if not active:
            break
    correct = [f.strip() == e["answer"] for f, e in zip(final, examples)]
    copied = [c == CALL[0] + operands(e["prompt"]) + CALL[1] for c, e in zip(first_call, examples) if c]
    # temperature 1: the probability that the first token opens a call ("<")
    tokenizer.padding_side = "left"
    batch = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    logits = model(**batch).logits[:, -1].float()
    p_call = logits.softmax(-1)[:, tokenizer.convert_tokens_to_ids("<")].tolist()
    by_digits = {}
    for n in sorted({total_digits(e["prompt"]) for e in examples}):
        rows = [i for i, e in enumerate(examples) if total_digits(e["prompt"]) == n]
        by_digits[n] = {"n": len(rows), "accuracy": sum(correct[i] for i in rows) / len(rows),
                        "tool_calls": sum(called[i] for i in rows) / len(rows),
                        "p_call": sum(p_call[i] for i in rows) / len(rows)}
    n_called = sum(called)
    return {"accuracy": sum(correct) / len(examples), "tool_calls": n_called / len(examples),
            "accuracy_with_tool": sum(c for c, k in zip(correct, called) if k) / max(n_called, 1),
            "copied": sum(copied) / max(len(copied), 1), "by_digits": by_digits}


def report(m: dict) -> str:
    digits = ", ".join(f"{n}: {d['accuracy']:.2f}/{d['tool_calls']:.2f}/{d['p_call']:.2f}"
                       for n, d in m["by_digits"].items())
    return (f"held-out greedy accuracy {m['accuracy']:.3f}, tool-call rate {m['tool_calls']:.3f}, "
            f"accuracy when calling {m['accuracy_with_tool']:.3f}, expression copied {m['copied']:.3f}; "
            f"by total digits (accuracy/calls/p(call) at T=1) {digits}")


def main(args: Args) -> None:
    start = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # bit-for-bit reproducible across machines with the same torch
    task = load_task("multiply", seed=args.seed)
    tool_p = {2: args.tool_p2, 3: args.tool_p3, 4: args.tool_p4, 5: args.tool_p5, 6: args.tool_p6}
    tokenizer = make_tokenizer()
    model = Qwen2ForCausalLM(tiny_config(tokenizer, args, MAX_LEN))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / args.sft_steps)
    g = torch.Generator().manual_seed(args.seed)
    metrics = None
    for step in range(1, args.sft_steps + 1):
        model.train()
        idx = torch.randint(len(task.train), (args.batch_size,), generator=g).tolist()
        coins = torch.rand(args.batch_size, generator=g).tolist()
        examples = [task.train[i] for i in idx]
        episodes = [demonstration(e, coin < tool_p[total_digits(e["prompt"])]) for e, coin in zip(examples, coins)]
        loss = model(**sft_batch(tokenizer, episodes)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.sft_steps:
            metrics = evaluate(model, tokenizer, task.eval, args.max_turns, args.max_turn_tokens)
            print(f"sft step {step} ({time.time() - start:.0f} s): loss {loss.item():.3f}, {report(metrics)}",
                  flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    if not 0.1 <= metrics["accuracy"] <= 0.5:
        print(f"warning: held-out accuracy {metrics['accuracy']:.3f} is outside [0.1, 0.5]; adjust --tool-p*")
    if not 0 < metrics["tool_calls"] < 1:
        print(f"warning: tool-call rate {metrics['tool_calls']:.3f}: RL needs a model that calls the tool sometimes")
    print(f"saved {args.output_dir}: {sum(p.numel() for p in model.parameters())} parameters, {step} SFT steps, "
          f"{time.time() - start:.0f} s; {report(metrics)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
