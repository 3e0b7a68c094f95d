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
Every call is checked (checked_call: one line naming the function, the completion and what went
wrong) and may take --reward-timeout seconds (time_limit): past it, it scores 0 and is counted.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from common.errors import ConfigError, RunError, need

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
            except (Exception, SystemExit) as e:  # sys.exit() in the file too: not a silent exit
                raise ConfigError(f"{what} {spec!r}: importing {source!r} failed ({type(e).__name__}: {e})") from None
            _MODULES[path] = module
        module = _MODULES[path]
    else:
        try:
            module = importlib.import_module(source)
        except (Exception, SystemExit) as e:
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
# a checked call, in a time limit
# ---------------------------------------------------------------------------------------

FLOAT32_MAX = torch.finfo(torch.float32).max  # a Python float above it (1e39) is inf in the reward tensor


def checked_call(fn: Callable[[str, dict], float], completion: str, example: dict, source: str) -> float:
    """fn(completion, example) as a float, checked: an exception, or anything but a number that
    float32 holds (1e39 passes as a Python float, then becomes inf in the reward tensor, and the
    advantages, loss and weights NaN), is a ConfigError of one line naming source ("reward
    'my.py:fn'", "task 'gsm8k': reward function"), the completion and what went wrong. The reward
    terms (RewardTerm) and the task's own reward (Task.reward, in training and evaluation) are
    called through it."""
    try:
        r = fn(completion, example)
    except RunError:  # already one line (the task's own reward, inside the `correct` term)
        raise
    except (Exception, SystemExit) as e:
        raise ConfigError(f"{source} raised {type(e).__name__}: {e} on completion {completion[:80]!r}") from None
    # abs(r) <= FLOAT32_MAX compares an int exactly (no OverflowError for 10**400) and is False for NaN
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not abs(r) <= FLOAT32_MAX:
        raise ConfigError(f"{source} returned {shown(r)} for completion {completion[:80]!r}; it must return "
                          f"a finite number within float32's range (|r| <= {FLOAT32_MAX:.3g})")
    return float(r)


def shown(value) -> str:
    """A returned value for an error message: a huge integer by its size, not its digits."""
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:
        return f"an integer of about 10^{int(abs(value).bit_length() * math.log10(2))}"
    return repr(value)[:80]


class RewardTimeout(BaseException):
    """A reward call ran past its time limit. A BaseException, as KeyboardInterrupt is, so that a
    reward's own `except Exception` (math_reward has one) does not swallow it and carry on."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """with time_limit(s): the block, interrupted by RewardTimeout after s seconds of wall time
    (0: no limit). A SIGALRM timer (ITIMER_REAL): its handler raises in the main thread between two
    bytecodes or out of a blocking call (sleep, I/O), so a pure-Python infinite loop stops too; a
    worker thread could only be abandoned, spinning on and taking the GIL from training. The
    scripts call rewards in the main thread (under torchrun each rank is its own process); in
    another thread there is no limit. No in-process limit stops a single C call that holds the
    interpreter (a huge integer power): that would need a subprocess a call."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        return checked_call(self.fn, completion, example, f"reward {self.spec!r}")


TIMEOUTS = "timeouts"  # parts[TIMEOUTS]: how many of a completion's calls ran past the time limit


class Reward:
    """rewards, parts = reward(completions, examples): the total R = sum_k w_k r_k of each
    completion ([N] tensor) and each term r_k unweighted ({name: [N] tensor}), in float32 as
    training uses them (a total beyond its range is one line). Each call may take `timeout`
    seconds (--reward-timeout; 0: no limit): one that runs past it scores 0, parts["timeouts"]
    counts them per completion (the metrics log their sum, reward/timeouts) and stderr says so,
    once a batch. The run goes on."""

    def __init__(self, terms: list[RewardTerm], timeout: float = 0.0):
        self.terms, self.timeout = terms, timeout

    def call(self, term: RewardTerm, completion: str, example: dict) -> float | None:
        """term(completion, example), or None if it ran past the time limit."""
        try:
            with time_limit(self.timeout):
                return term(completion, example)
        except RewardTimeout:
            return None

    def __call__(self, completions: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = {t.name: [self.call(t, c, e) for c, e in zip(completions, examples)] for t in self.terms}
        parts = {name: torch.tensor([0.0 if v is None else v for v in vs], dtype=torch.float32)
                 for name, vs in values.items()}
        total = sum(t.weight * parts[t.name] for t in self.terms)
        if not torch.isfinite(total).all():
            i = int((~torch.isfinite(total)).nonzero()[0])
            terms = " + ".join(f"{t.weight:g} x {t.name} {parts[t.name][i].item():.3g}" for t in self.terms)
            raise ConfigError(f"the weighted sum of the reward terms ({terms}) is beyond float32's range for "
                              f"completion {completions[i][:80]!r}; scale the terms or their weights down")
        late = {name: sum(v is None for v in vs) for name, vs in values.items()}
        parts[TIMEOUTS] = sum(torch.tensor([v is None for v in vs], dtype=torch.float32) for vs in values.values())
        if any(late.values()):
            tqdm.write(f"reward calls past --reward-timeout {self.timeout:g} s scored 0: " + ", ".join(
                f"{name} {n} of {len(completions)}" for name, n in late.items() if n), file=sys.stderr)
        return total, parts


WEIGHT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """'my.py:fn:0.2' -> ('my.py:fn', 0.2); 'format:0.5' -> ('format', 0.5); 'my.py:fn' -> ('my.py:fn', 1.0).
    After a built-in's name or a FUNCTION, the last part is a weight; otherwise a function's name
    if it is not a number (my.py:nan is the function nan)."""
    head, colon, tail = spec.rpartition(":")
    weighted = head in BUILTIN_REWARDS or ":" in head
    if not weighted and not WEIGHT.fullmatch(tail):
        return spec, 1.0
    if not colon or not head:
        raise ConfigError(f"--reward {spec!r}: expected NAME[:WEIGHT] or FILE.py:FUNCTION[:WEIGHT]")
    try:
        weight = float(tail)
    except ValueError:
        raise ConfigError(f"--reward {spec!r}: the weight {tail!r} is not a number") from None
    if not math.isfinite(weight):
        raise ConfigError(f"--reward {spec!r}: the weight must be a finite number, got {tail!r}")
    return head, weight


def term_name(spec: str) -> str:
    """The name a --reward term is logged under (reward/<name>_mean): 'my.py:fn:0.5' -> 'fn'."""
    return parse_reward_spec(spec)[0].rpartition(":")[2]


def load_reward(specs: tuple[str, ...], task, timeout: float = 0.0) -> Reward:
    """The run's reward: the task's own (`correct`) without --reward flags, else their weighted
    sum; each call may take `timeout` seconds (--reward-timeout, 0: no limit). Each function is
    checked now, before anything heavy: it must take (completion, example) and return a finite
    number in time on a probe, the first train example's own answer."""
    need(math.isfinite(timeout) and timeout >= 0, f"--reward-timeout must be >= 0 seconds (0: no limit), got {timeout}")
    terms = []
    for spec in specs or ("correct",):
        target, weight = parse_reward_spec(spec)
        name = term_name(spec)
        if target in BUILTIN_REWARDS:
            fn = BUILTIN_REWARDS[target](task)
        else:
            fn = load_function(target, "--reward")
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
        need(name != TIMEOUTS, f"--reward {spec!r}: the name {TIMEOUTS!r} is taken (reward/timeouts counts the "
                               f"calls past --reward-timeout); rename the function")
        terms.append(RewardTerm(name, fn, weight, spec))
    reward, probe = Reward(terms, timeout), task.train[0]
    for term in terms:
        try:
            value = reward.call(term, str(probe.get("answer", "")), probe)
        except RunError as e:
            raise ConfigError(f"{e} (a probe call with the first train example, before training)") from None
        need(value is not None, f"reward {term.spec!r} ran past --reward-timeout {timeout:g} s on a probe call with "
                                f"the first train example, before training: fix it, or give it more time")
    return reward


# ---------------------------------------------------------------------------------------
# a reward model (--reward-model of ppo.py): a learned score instead of a verifier
# ---------------------------------------------------------------------------------------

def check_reward_model(name_or_path: str) -> None:
    """--reward-model, before anything heavy: found (check_model), and a sequence-classification model
    whose checkpoint holds every weight, its score head included. A causal LM loads as one too, with a
    new, random head (transformers reports it MISSING): refused. Loaded on the meta device, so only
    the checkpoint's weight names are read."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from common.models import check_model, resolve_model

    check_model(name_or_path, "--reward-model")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' report of the missing weights: ours is one line
    try:
        _, info = AutoModelForSequenceClassification.from_pretrained(
            resolve_model(name_or_path), num_labels=1, device_map="meta", output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--reward-model {name_or_path!r} does not load as a sequence-classification model with "
                          f"one label ({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info["missing_keys"])
    need(not missing, f"--reward-model {name_or_path!r} has no trained score head: its checkpoint lacks "
                      f"{', '.join(missing[:3])}, which would start at random (a causal LM is no reward model); "
                      f"give a sequence-classification model with one label")


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
