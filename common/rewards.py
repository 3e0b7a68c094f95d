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
wrong) and may take --reward-timeout seconds: past it, it scores 0 and is counted. Your functions
(--reward FILE.py:FN, and a --task FILE.py:FN's reward) run in worker processes (common/workers.py,
InWorkers), a batch's calls in parallel; a call past the limit is killed with its worker, so
nothing it does (its own SIGALRM handler, `except BaseException`, a long C call, a never-ending
thread) can stall the run or keep it from exiting. The built-ins run in the run's own process,
under a SIGALRM limit (time_limit).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from common.errors import ConfigError, RunError, need
from common.workers import DIED, OK, RAISED, WORKERS, load_function

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

# torch.finfo(torch.float32).max: a Python float above it (1e39) is inf in the reward tensor. torch is
# imported where it is used: a worker imports this module (through common.tasks) but never needs torch,
# and a worker replaced after a timeout should start in a tenth of a second, not in seconds
FLOAT32_MAX = 3.4028234663852886e38


def checked_call(fn: Callable[[str, dict], float], completion: str, example: dict, source: str) -> float:
    """fn(completion, example) as a float, checked (checked): an exception, or anything but a number
    that float32 holds, is a ConfigError of one line naming source ("reward 'my.py:fn'", "task
    'gsm8k': reward function"), the completion and what went wrong. The reward terms (RewardTerm)
    and the task's own reward (Task.reward, in training and evaluation) are called through it. A
    function in the workers (InWorkers) is called there, without a time limit: Reward calls them
    in batches, in parallel, within one."""
    if isinstance(fn, InWorkers):
        value = checked(fn.map([(completion, example)], fn.timeout)[0], completion, fn.source)
        if value is None:
            raise RewardTimeout
        return value
    try:
        r = fn(completion, example)
    except RunError:  # already one line (the task's own reward, inside the `correct` term)
        raise
    except (Exception, SystemExit) as e:
        return checked((RAISED, f"{type(e).__name__}: {e}"), completion, source)
    return checked((OK, r), completion, source)


def checked(outcome: tuple[str, object], completion: str, source: str) -> float | None:
    """A call's outcome (common/workers.py: kind, value) as a float, or None for a call past its
    time limit or whose worker died. 1e39 passes as a Python float, then becomes inf in the reward
    tensor, and the advantages, loss and weights NaN: refused, as an exception is."""
    kind, r = outcome
    if kind == RAISED:
        raise ConfigError(f"{source} raised {r} on completion {completion[:80]!r}")
    if kind != OK:
        return None
    # abs(r) <= FLOAT32_MAX compares an int exactly (no OverflowError for 10**400) and is False for NaN
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not abs(r) <= FLOAT32_MAX:
        raise ConfigError(f"{source} returned {shown(r)} for completion {completion[:80]!r}; it must return "
                          f"a finite number within float32's range (|r| <= {FLOAT32_MAX:.3g})")
    return float(r)


class InWorkers:
    """A user's reward function (--reward FILE.py:FN, a --task FILE.py:FN's reward) that runs in the
    worker processes (common/workers.py), where `recipe` gives it; source names it in messages."""

    def __init__(self, recipe: tuple, source: str, timeout: float = 0.0):
        self.recipe, self.source, self.timeout = recipe, source, timeout

    def map(self, calls: list[tuple], timeout: float) -> list[tuple[str, object]]:
        return WORKERS.map(self.recipe, calls, timeout)

    def __call__(self, completion: str, example: dict) -> float:
        return checked_call(self, completion, example, self.source)


def in_workers(fn) -> InWorkers | None:
    """The InWorkers behind fn: fn itself, or a Task's reward (task.reward) whose reward_fn is one."""
    fn = fn if isinstance(fn, InWorkers) else getattr(getattr(fn, "__self__", None), "reward_fn", None)
    return fn if isinstance(fn, InWorkers) else None


def shown(value) -> str:
    """A returned value for an error message: a huge integer by its size, not its digits."""
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:
        return f"an integer of about 10^{int(abs(value).bit_length() * math.log10(2))}"
    return repr(value)[:80]


class RewardTimeout(BaseException):
    """A reward call ran past its time limit (or its worker died). A BaseException, as KeyboardInterrupt is, so that a
    reward's own `except Exception` (math_reward has one) does not swallow it and carry on."""


_NO_SIGALRM_SAID = False


@contextlib.contextmanager
def time_limit(seconds: float):
    """with time_limit(s): the block, interrupted by RewardTimeout after s seconds of wall time
    (0: no limit): the limit of the built-in rewards, which run in the run's own process. A SIGALRM
    timer (ITIMER_REAL): its handler raises in the main thread between two bytecodes or out of a
    blocking call (sleep, I/O), so a pure-Python infinite loop stops too; in another thread there is
    no limit. It cannot stop a single C call that holds the interpreter, nor code that replaces the
    handler or catches BaseException: the user's code runs in workers instead (InWorkers). Where
    signal has no SIGALRM (Windows) there is no limit either, said once."""
    global _NO_SIGALRM_SAID
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    if not hasattr(signal, "SIGALRM"):
        if not _NO_SIGALRM_SAID:
            tqdm.write("no SIGALRM on this platform (Windows): the built-in rewards and the calculator run without "
                       f"their {seconds:g} s time limit", file=sys.stderr)
            _NO_SIGALRM_SAID = True
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
    once a batch. A user's function (InWorkers) runs in the worker processes, a term's calls in
    parallel: one past the limit is killed with its worker, and a call whose worker dies (a
    segfault, os._exit, out of memory) scores 0 and is counted the same, in a line of its own.
    The built-ins run here, under time_limit. The run goes on."""

    def __init__(self, terms: list[RewardTerm], timeout: float = 0.0):
        self.terms, self.timeout = terms, timeout
        self.died: dict[str, int] = {}  # term -> its calls of the last batch whose worker died

    def call(self, term: RewardTerm, completion: str, example: dict) -> float | None:
        """term(completion, example), or None if it ran past the time limit."""
        return self.values(term, [completion], [example])[0]

    def values(self, term: RewardTerm, completions: list[str], examples: list[dict]) -> list[float | None]:
        """term on each completion, None for a call past the time limit or whose worker died."""
        remote = in_workers(term.fn)
        self.died[term.name] = 0
        if remote is None:
            out = []
            for completion, example in zip(completions, examples):
                try:
                    with time_limit(self.timeout):
                        out.append(term(completion, example))
                except RewardTimeout:
                    out.append(None)
            return out
        outcomes = remote.map(list(zip(completions, examples)), self.timeout)
        died = [(c, how) for (kind, how), c in zip(outcomes, completions) if kind == DIED]
        self.died[term.name] = len(died)
        if died:
            tqdm.write(f"{remote.source}: its worker died ({died[0][1]}) on {len(died)} of {len(completions)} "
                       f"completions (the first: {died[0][0][:80]!r}); they scored 0", file=sys.stderr)
        return [checked(o, c, remote.source) for o, c in zip(outcomes, completions)]

    def __call__(self, completions: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        values = {t.name: self.values(t, completions, examples) for t in self.terms}
        parts = {name: torch.tensor([0.0 if v is None else v for v in vs], dtype=torch.float32)
                 for name, vs in values.items()}
        total = sum(t.weight * parts[t.name] for t in self.terms)
        if not torch.isfinite(total).all():
            i = int((~torch.isfinite(total)).nonzero()[0])
            terms = " + ".join(f"{t.weight:g} x {t.name} {parts[t.name][i].item():.3g}" for t in self.terms)
            raise ConfigError(f"the weighted sum of the reward terms ({terms}) is beyond float32's range for "
                              f"completion {completions[i][:80]!r}; scale the terms or their weights down")
        late = {name: sum(v is None for v in vs) - self.died.get(name, 0) for name, vs in values.items()}
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


def load_reward(specs: tuple[str, ...], task, timeout: float = 0.0, transcript: bool = False) -> Reward:
    """The run's reward: the task's own (`correct`) without --reward flags, else their weighted
    sum; each call may take `timeout` seconds (--reward-timeout, 0: no limit). A function of the
    user's runs in the worker processes (InWorkers), which import its file again. Each function is
    checked now, before anything heavy: it must take (completion, example) and return a finite
    number in time on a probe, the first train example's own answer. transcript: the examples carry
    the episode's "transcript" and the environment's "env_reward" (grpo_multiturn.py, common/env.py
    episode_examples), and so does the probe's (the answer, one turn; no reward of the environment)."""
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
            fn = InWorkers(("common.workers", "load_function", (target, "--reward")), f"reward {spec!r}")
        if any(t.name == name for t in terms):
            raise ConfigError(f"--reward {spec!r}: two reward terms are named {name!r}; each is logged as "
                              f"reward/<name>_mean, so names must differ")
        need(name != TIMEOUTS, f"--reward {spec!r}: the name {TIMEOUTS!r} is taken (reward/timeouts counts the "
                               f"calls past --reward-timeout); rename the function")
        terms.append(RewardTerm(name, fn, weight, spec))
    reward, probe = Reward(terms, timeout), task.train[0]
    if transcript:
        probe = {**probe, "transcript": str(probe.get("answer", "")), "env_reward": None}
    for term in terms:
        try:
            value = reward.call(term, str(probe.get("answer", "")), probe)
        except RunError as e:
            raise ConfigError(f"{e} (a probe call with the first train example, before training)") from None
        need(not reward.died[term.name], f"reward {term.spec!r}: its worker died on a probe call with the first train "
                                         f"example, before training (its output above says why)")
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


def reward_model_scores(reward_model, rm_tokenizer, texts: list[str], device: str, micro_batch_size: int):
    """The reward model's score of each text (prompt + completion as generated, end-of-turn
    token included: what a reward model is trained to read), at its last real token, a
    micro-batch at a time. A text that starts with BOS (a decoded prompt) gets no second one."""
    import torch

    bos = rm_tokenizer.bos_token
    if bos is not None and rm_tokenizer("")["input_ids"][:1] == [rm_tokenizer.bos_token_id]:
        texts = [t.removeprefix(bos) for t in texts]
    scores = []
    for i in range(0, len(texts), micro_batch_size):
        batch = rm_tokenizer(texts[i:i + micro_batch_size], return_tensors="pt", padding=True,
                             padding_side="right").to(device)
        with torch.no_grad():
            hidden = reward_model.base_model(**batch, use_cache=False).last_hidden_state
            last = batch["attention_mask"].sum(1) - 1
            scores.append(reward_model.score(hidden[torch.arange(len(last), device=device), last]).squeeze(-1).float())
    return torch.cat(scores)
