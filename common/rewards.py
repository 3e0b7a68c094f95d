"""Your own code on the command line: a task or reward functions from a Python file or module.

    --task my_task.py:make_task          a function returning a Task (common/tasks.py), called
                                         with seed=SEED if it takes a `seed` argument
    --reward my_rewards.py:correct       a reward function fn(completion: str, example: dict) -> float
    --reward my_rewards.py:format:0.2    ... with a weight (default 1)
    --reward correct --reward format:0.2 the built-ins (BUILTIN_REWARDS)

FILE.py:NAME loads a file (its folder is put on sys.path, so it can import its neighbours);
MODULE:NAME imports an installed or local module (package.module:NAME).

The rule: given --reward flags REPLACE the task's reward by their weighted sum,

    R = sum_k w_k r_k(completion, example)

and `correct`, the task's own verifier, is one of them when you want it. Each r_k is logged
as reward/<name>_mean. Held-out accuracy is always the task's own verifier (reward >= 1).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from common.errors import ConfigError, RunError

_MODULES: dict[str, object] = {}  # one module object per file: a task and rewards from one file share it


def load_function(spec: str, what: str) -> Callable:
    """'path/to/file.py:name' or 'package.module:name' -> the function; one-line errors that
    name the file, the function and what is wrong."""
    source, colon, name = spec.rpartition(":")
    if not colon or not source or not name:
        raise ConfigError(f"{what} {spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION")
    if source.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(source))
        if not os.path.isfile(path):
            raise ConfigError(f"{what} {spec!r}: file {source!r} does not exist")
        if path not in _MODULES:
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_name = "user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                raise ConfigError(f"{what} {spec!r}: importing {source!r} failed ({type(e).__name__}: {e})") from None
            _MODULES[path] = module
        module = _MODULES[path]
    else:
        try:
            module = importlib.import_module(source)
        except Exception as e:
            raise ConfigError(f"{what} {spec!r}: cannot import module {source!r} ({type(e).__name__}: {e}); "
                              f"a file is written FILE.py:FUNCTION") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{what} {spec!r}: {source!r} has no function {name!r} "
                          f"(it has: {', '.join(public) or 'none'})")
    return fn


# ---------------------------------------------------------------------------------------
# built-in rewards
# ---------------------------------------------------------------------------------------

# something in the tags or the box: an empty \boxed{} is not an answer (SmolLM2 learned to
# write "within \boxed{}" over and over for a format reward that counted it)
ANSWER_TAGS = re.compile(r"<answer>\s*[^\s<].*?</answer>", re.DOTALL)
BOXED = re.compile(r"\\boxed\{\s*[^\s}].*?\}", re.DOTALL)


def format_reward(completion: str, example: dict) -> float:
    """1 if the completion gives an answer in the form the tasks ask for: inside
    <answer></answer> tags (reasoning-gym) or \\boxed{} (gsm8k, jsonl), not empty; else 0."""
    return 1.0 if ANSWER_TAGS.search(completion) or BOXED.search(completion) else 0.0


# name -> function of the task: `correct` is the task's own verifier
BUILTIN_REWARDS: dict[str, Callable] = {
    "correct": lambda task: task.reward,
    "format": lambda task: format_reward,
}


# ---------------------------------------------------------------------------------------
# the weighted sum
# ---------------------------------------------------------------------------------------

@dataclass
class RewardTerm:
    name: str
    fn: Callable[[str, dict], float]
    weight: float
    spec: str  # as given on the command line, for error messages

    def __call__(self, completion: str, example: dict) -> float:
        try:
            r = self.fn(completion, example)
        except RunError:
            raise
        except Exception as e:
            raise RunError(f"reward {self.spec!r} raised {type(e).__name__}: {e} on completion "
                           f"{completion[:80]!r}") from None
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RunError(f"reward {self.spec!r} returned {r!r} for completion {completion[:80]!r}; "
                           f"it must return a finite number")
        return float(r)


class Reward:
    """rewards, parts = reward(completions, examples): the total R = sum_k w_k r_k of each
    completion ([N] tensor) and each term r_k unweighted ({name: [N] tensor})."""

    def __init__(self, terms: list[RewardTerm]):
        self.terms = terms

    def __call__(self, completions: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts = {t.name: torch.tensor([t(c, e) for c, e in zip(completions, examples)], dtype=torch.float32)
                 for t in self.terms}
        total = sum(t.weight * parts[t.name] for t in self.terms)
        return total, parts


WEIGHT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """'my.py:fn:0.2' -> ('my.py:fn', 0.2); 'format:0.5' -> ('format', 0.5); 'my.py:fn' -> ('my.py:fn', 1.0)."""
    head, colon, tail = spec.rpartition(":")
    if not WEIGHT.fullmatch(tail):  # a function's name (also one called nan or inf)
        return spec, 1.0
    weight = float(tail)
    if not colon or not head:
        raise ConfigError(f"--reward {spec!r}: expected NAME[:WEIGHT] or FILE.py:FUNCTION[:WEIGHT]")
    if not math.isfinite(weight):
        raise ConfigError(f"--reward {spec!r}: the weight must be a finite number, got {tail!r}")
    return head, weight


def load_reward(specs: tuple[str, ...], task) -> Reward:
    """The run's reward: the task's own (`correct`) without --reward flags, else their weighted
    sum. Each function is checked now, before anything heavy: it must take (completion,
    example) and return a finite number on a probe, the first train example's own answer."""
    terms = []
    for spec in specs or ("correct",):
        target, weight = parse_reward_spec(spec)
        if target in BUILTIN_REWARDS:
            name, fn = target, BUILTIN_REWARDS[target](task)
        else:
            fn = load_function(target, "--reward")
            name = target.rpartition(":")[2]
            try:
                inspect.signature(fn).bind("completion", {})
            except TypeError:
                raise ConfigError(f"--reward {spec!r}: a reward function takes (completion, example), "
                                  f"{name} has the signature {inspect.signature(fn)}") from None
            except ValueError:  # no signature to inspect (some builtins): the probe below checks it
                pass
        if any(t.name == name for t in terms):
            raise ConfigError(f"--reward {spec!r}: two reward terms are named {name!r}; each is logged as "
                              f"reward/<name>_mean, so names must differ")
        terms.append(RewardTerm(name, fn, weight, spec))
    probe = task.train[0]
    for term in terms:
        try:
            term(str(probe.get("answer", "")), probe)
        except RunError as e:
            raise ConfigError(f"{e} (a probe call with the first train example, before training)") from None
    return Reward(terms)


# ---------------------------------------------------------------------------------------
# a reward model (--reward-model of ppo.py): a learned score instead of a verifier
# ---------------------------------------------------------------------------------------

def load_reward_model(name_or_path: str, dtype: str, device: str):
    """(model, tokenizer) of a sequence-classification reward model with one label, frozen. Its
    tokenizer pads on the right (scores are read at the last real token), with EOS if it has no pad."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.models import freeze, load_pretrained, resolve_model

    model = freeze(load_pretrained(AutoModelForSequenceClassification, name_or_path, dtype, num_labels=1)[0].to(device))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, texts: list[str], device: str, micro_batch_size: int):
    """The reward model's score of each text (prompt + completion as generated, end-of-turn
    token included: what a reward model is trained to read), at its last real token, a
    micro-batch at a time. A text that starts with BOS (a decoded prompt) gets no second one."""
    bos = rm_tokenizer.bos_token
    if bos is not None and rm_tokenizer("")["input_ids"][:1] == [rm_tokenizer.bos_token_id]:
        texts = [t.removeprefix(bos) for t in texts]
    scores = []
    for i in range(0, len(texts), micro_batch_size):
        batch = rm_tokenizer(texts[i:i + micro_batch_size], return_tensors="pt", padding=True,
                             padding_side="right").to(device)
        hidden = reward_model.base_model(**batch, use_cache=False).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        scores.append(reward_model.score(hidden[torch.arange(len(last), device=device), last]).squeeze(-1).float())
    return torch.cat(scores)
