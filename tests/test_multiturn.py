"""Multi-turn episodes (grpo_multiturn.py, common/env.py): the ids the engine sampled plus each
observation's own ids (token-in/token-out), the episode limits, the environment's errors and
timeouts, observations that are context without a loss term, the chat template's separators,
and the transformers engine's per-request max_tokens and stop strings.

No vLLM engine: ScriptedEngine answers generate() with scripted turns, stopping them as vLLM
does (a stop token or a stop string, kept; "length" at the request's own max_tokens)."""

import copy
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import common.batch
from common.batch import episode_batch
from common.engine import CompletionOutput, Logprob, RequestOutput, SamplingParams, create_engine, sync_weights
from common.env import Calculator, CheckedEnv, Episode, Step, episode_metrics, load_env, observation_ids
from common.errors import ConfigError
from common.models import encode_prompts, load_tokenizer, stop_token_ids
from common.ops import forward_logprobs
from common.tasks import Task
from grpo_multiturn import Args, check, compute_loss, run_episodes
from tests.conftest import ROOT, TINY_MODEL

TASK = Task("t", [{"prompt": "6*7=", "answer": "42"}], [{"prompt": "2*3=", "answer": "6"}], lambda c, e: 0.0)
SAMPLED_LOGPROB = -0.25  # what ScriptedEngine says it sampled each token with
EOS = "<|im_end|>"       # the tiny tokenizer's EOS


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """vLLM's generate(requests, params) for scripted turns. scripts: {prompt text: [its turns' texts]};
    each request is matched to its episode by its prompt's ids (a prefix of the request) and gets that
    episode's next turn, cut as vLLM cuts a sample: at a stop token (kept in token_ids, not in the
    text), at a stop string (kept in the text with include_stop_str_in_output), or at the request's
    own max_tokens ("length"). Records each call's requests and params."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = {tuple(ids(tokenizer, p)): list(turns) for p, turns in scripts.items()}
        self.calls = []

    def prompt_ids(self) -> list[list[int]]:
        return [list(p) for p in self.scripts]

    def generate(self, requests, params, use_tqdm=False):
        assert isinstance(params, list) and len(params) == len(requests)  # one SamplingParams a request
        self.calls.append(([list(r["prompt_token_ids"]) for r in requests], params))
        outputs = []
        for request, p in zip(requests, params):
            prompt = next(k for k in self.scripts if tuple(request["prompt_token_ids"][:len(k)]) == k)
            assert self.scripts[prompt], f"a turn past the script of {self.tokenizer.decode(prompt)!r}"
            outputs.append(RequestOutput([self.sample(ids(self.tokenizer, self.scripts[prompt].pop(0)), p)]))
        return outputs

    def sample(self, script: list[int], p) -> CompletionOutput:
        assert p.n == 1 and p.max_tokens >= 1, p
        token_ids = []
        for t in script:
            token_ids.append(t)
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            if t in p.stop_token_ids:
                reason = "stop"
                break
            found = [(text.find(s), s) for s in p.stop if s in text]
            if found:
                at, s = min(found)
                text, reason = text[:at + len(s) if p.include_stop_str_in_output else at], "stop"
                break
            if len(token_ids) == p.max_tokens:
                reason = "length"
                break
        else:
            raise AssertionError(f"scripted turn {self.tokenizer.decode(script)!r} neither ends nor reaches max_tokens")
        return CompletionOutput(token_ids, text, [{t: Logprob(SAMPLED_LOGPROB)} for t in token_ids], reason)


def args_of(**changes) -> Args:
    return Args(engine="transformers", **changes)  # the engine's own SamplingParams: no vLLM import


def calculator(timeout: float = 10.0):
    return load_env("calculator", TASK, timeout)


def episodes_of(tokenizer, scripts, env=None, **changes):
    """(episodes, engine) of run_episodes over scripted turns, one episode a prompt."""
    llm = ScriptedEngine(tokenizer, scripts)
    prompt_ids = llm.prompt_ids()
    episodes = run_episodes(llm, env or calculator(), tokenizer, prompt_ids, [TASK.train[0]] * len(prompt_ids),
                            args_of(**changes), temperature=1.0)
    return episodes, llm


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message and message.strip() == message and message, message
    return message


# ------------------------------------------------------------------------------------------
# 1. an episode: the sampled ids and the observation's own ids, concatenated
# ------------------------------------------------------------------------------------------

def test_a_calculator_episode_is_the_sampled_ids_and_the_observation_ids(tokenizer):
    call, result, answer = "<call>12*(3+4)</call>", "<result>84</result>", "84" + EOS
    (e, direct), llm = episodes_of(tokenizer, {"q1:": [call, answer], "q2:": ["5" + EOS]})
    t1, t2 = ids(tokenizer, call), ids(tokenizer, answer)
    obs = observation_ids(tokenizer, result, True, t1)
    assert obs == ids(tokenizer, result)  # no chat template: the text's own ids
    assert e.token_ids == t1 + obs + t2
    assert e.model_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    assert [lp[t].logprob for lp, t in zip(e.logprobs, e.token_ids)] == \
        [SAMPLED_LOGPROB] * len(t1) + [0.0] * len(obs) + [SAMPLED_LOGPROB] * len(t2)
    assert (e.ended_by, e.finish_reason, e.tool_calls, e.tool_errors) == ("answer", "stop", 1, 0)
    assert e.answer == "84"
    assert e.parts == [["model", call], ["env", result], ["model", "84"]]
    assert e.transcript == call + result + "84"
    # the engine continued from exactly these ids (never re-encoded text); the answered episode left
    first, second = llm.calls
    assert first[0] == llm.prompt_ids()
    assert second[0] == [llm.prompt_ids()[0] + t1 + obs]
    assert all(p.stop == ["</call>"] and p.include_stop_str_in_output and tokenizer.eos_token_id in p.stop_token_ids
               for p in first[1] + second[1])
    assert (direct.token_ids, direct.model_mask, direct.answer, direct.ended_by) == (ids(tokenizer, "5" + EOS), [1, 1],
                                                                                     "5", "answer")
    assert direct.tool_calls == 0 and direct.parts == [["model", "5"]]


# ------------------------------------------------------------------------------------------
# 2. limits: turns, tokens per turn, the episode's token budget
# ------------------------------------------------------------------------------------------

def test_max_turns_ends_after_a_call_without_a_trailing_observation(tokenizer):
    (e,), llm = episodes_of(tokenizer, {"q:": ["<call>1+1</call>", "<call>2+2</call>", "4" + EOS]}, max_turns=2,
                                max_new_tokens=128)
    t1, t2 = ids(tokenizer, "<call>1+1</call>"), ids(tokenizer, "<call>2+2</call>")
    assert (e.ended_by, e.finish_reason, e.tool_calls) == ("max_turns", "length", 2)
    assert e.token_ids == t1 + ids(tokenizer, "<result>2</result>") + t2  # no "<result>4</result>" after it
    assert e.parts[-1] == ["model", "<call>2+2</call>"] and [w for w, _ in e.parts] == ["model", "env", "model"]
    assert len(llm.calls) == 2


def test_max_turns_defaults_to_the_environments_own_then_to_the_budget(tokenizer):
    """No --max-turns: the calculator's own 3 turns end the episode; an environment without a limit
    (max_turns None) runs until the token budget ends it: 6 calls and 5 results, 6 x 16 + 5 x 18 = 186."""
    calls = ["<call>1+1</call>"] * 9
    (e,), llm = episodes_of(tokenizer, {"q:": calls}, max_new_tokens=256)
    assert (e.ended_by, e.tool_calls, len(llm.calls)) == ("max_turns", 3, 3)
    unlimited = calculator()
    unlimited.max_turns = None
    (e,), llm = episodes_of(tokenizer, {"q:": calls}, env=unlimited, max_new_tokens=186)
    assert (len(ids(tokenizer, "<call>1+1</call>")), len(ids(tokenizer, "<result>2</result>"))) == (16, 18)
    assert (e.ended_by, e.tool_calls, len(llm.calls)) == ("budget", 6, 6)


def test_a_turn_past_max_turn_tokens_ends_the_episode_truncated(tokenizer):
    (e, ok), llm = episodes_of(tokenizer, {"q1:": ["<call>123456789</call>"], "q2:": ["42" + EOS]}, max_turn_tokens=8)
    assert [p.max_tokens for p in llm.calls[0][1]] == [8, 8]
    assert e.token_ids == ids(tokenizer, "<call>12") and e.model_mask == [1] * 8
    assert (e.ended_by, e.finish_reason, e.tool_calls) == ("turn_tokens", "length", 0)  # the env never saw it
    assert (ok.ended_by, ok.finish_reason) == ("answer", "stop")
    assert len(llm.calls) == 1


def test_the_token_budget_bounds_each_turn_and_each_observation(tokenizer):
    """--max-new-tokens 40: 16 + 18 leaves 6 for the next turn; 19 + 21 = 40 leaves no room for a
    reply (no observation); 18 + 21 = 39 leaves 1."""
    (a, b, c), llm = episodes_of(tokenizer, {
        "qa:": ["<call>1+1</call>", "<call>2*3</call>"],
        "qb:": ["<call>100*10</call>", "1000" + EOS],
        "qc:": ["<call>999+1</call>", "7" + EOS]}, max_new_tokens=40, max_turn_tokens=24)
    assert [p.max_tokens for p in llm.calls[0][1]] == [24, 24, 24]
    assert [p.max_tokens for p in llm.calls[1][1]] == [40 - 34, 40 - 39]  # min(turn limit, budget left)
    assert len(llm.calls) == 2
    assert a.token_ids == ids(tokenizer, "<call>1+1</call><result>2</result><call>") and len(a.token_ids) == 40
    assert b.token_ids == ids(tokenizer, "<call>100*10</call>") and b.parts == [["model", "<call>100*10</call>"]]
    assert b.tool_calls == 1
    assert c.token_ids == ids(tokenizer, "<call>999+1</call><result>1000</result>7") and len(c.token_ids) == 40
    for e in (a, b, c):
        assert (e.ended_by, e.finish_reason) == ("budget", "length")


@pytest.mark.parametrize("budget", [12, 17, 25, 33, 40, 41, 57, 80])
def test_an_episode_never_exceeds_the_token_budget(tokenizer, budget):
    calls = ["<call>1+1</call>", "<call>12*12</call>", "<call>1/3</call>", "<call>9</call>"] * 3
    scripts = {f"q{i}:": calls[i:] + ["5" * 30 + EOS] for i in range(4)}
    scripts["qx:"] = ["1" * 100 + EOS]
    episodes, llm = episodes_of(tokenizer, scripts, max_new_tokens=budget, max_turn_tokens=20, max_turns=6)
    for e in episodes:
        assert len(e.token_ids) <= budget and len(e.model_mask) == len(e.logprobs) == len(e.token_ids)
        assert e.ended_by in ("answer", "turn_tokens", "budget", "max_turns"), e
    for requests, params in llm.calls:  # each request fits: prompt + ids so far + max_tokens <= prompt + budget
        for r, p in zip(requests, params):
            assert len(r) - 3 + p.max_tokens <= budget and 1 <= p.max_tokens <= min(budget, 20)


def test_check_refuses_impossible_limits():
    check(Args())
    check(Args(max_turn_tokens=65))  # more than the budget: each turn gets at most the budget left
    for changes, message in [({"max_turns": 0}, "--max-turns must be >= 1, got 0"),
                             ({"max_turn_tokens": 0}, "--max-turn-tokens must be >= 1, got 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            check(Args(**changes))
        one_line(e)


# ------------------------------------------------------------------------------------------
# 3. malformed calls: error observations, counted, and the episode goes on
# ------------------------------------------------------------------------------------------

def test_malformed_calls_are_error_observations_and_the_episode_goes_on(tokenizer):
    turns = ["<call>1+</call>", "<call>1/0</call>", "</call>", "3" + EOS]
    (e,), _ = episodes_of(tokenizer, {"q:": turns}, max_turns=4, max_new_tokens=256)
    errors = ["<result>error: unexpected end of expression</result>", "<result>error: division by zero</result>",
              "<result>error: </call> without <call></result>"]
    assert e.parts == [["model", turns[0]], ["env", errors[0]], ["model", turns[1]], ["env", errors[1]],
                       ["model", turns[2]], ["env", errors[2]], ["model", "3"]]
    assert (e.tool_calls, e.tool_errors, e.ended_by, e.answer) == (3, 3, "answer", "3")
    assert e.token_ids == ids(tokenizer, "".join(t for _, t in e.parts) + EOS)
    assert Calculator().step(None, "<call>2+2</call>") == Step("<result>4</result>", tool_call=True, error=False)


# ------------------------------------------------------------------------------------------
# 4. an environment that raises, hangs or returns something else
# ------------------------------------------------------------------------------------------

ENVS = '''
import time
from common.env import Environment, Step
from common.calculator import calculate

class Raising(Environment):
    stop = ("</call>",)
    def step(self, state, turn):
        if turn:
            raise ValueError("boom")
        return Step(None)

class Slow(Environment):
    stop = ("</call>",)
    def step(self, state, turn):
        if "slow" in turn:
            time.sleep(30)
        if "</call>" in turn:
            return Step("<result>" + calculate(turn[6:-7]) + "</result>", tool_call=True)
        return Step(None)

class Text(Environment):
    stop = ("</call>",)
    def step(self, state, turn):
        return Step(None) if not turn else "<result>2</result>"

class NotText(Environment):
    stop = ("</call>",)
    def step(self, state, turn):
        return Step(None) if not turn else Step(5)

def raising(): return Raising()
def slow(): return Slow()
def text(): return Text()
def not_text(): return NotText()
def needs_an_argument(x): return Raising()
def no_methods(): return object()
def stop_is_a_string():
    env = Raising(); env.stop = "</call>"; return env
def stop_holds_a_number():
    env = Raising(); env.stop = ("</call>", 3); return env
def stop_holds_an_empty_string():
    env = Raising(); env.stop = ("",); return env
def max_turns_zero():
    env = Raising(); env.max_turns = 0; return env
def max_turns_a_string():
    env = Raising(); env.max_turns = "3"; return env
def start_raises():
    env = Raising(); env.start = lambda example: 1 / 0; return env
'''


@pytest.fixture()
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(textwrap.dedent(ENVS))
    return str(path)


def test_a_step_that_raises_is_one_line_naming_the_env_and_the_turn(tokenizer, env_file):
    env = load_env(f"{env_file}:raising", TASK, 5.0)
    with pytest.raises(ConfigError) as e:
        episodes_of(tokenizer, {"q:": ["<call>1+1</call>"]}, env=env)
    message = one_line(e)
    assert message == f"--env '{env_file}:raising': step on turn '<call>1+1</call>' raised ValueError: boom"


def test_a_step_past_the_env_timeout_ends_that_episode_only(tokenizer, env_file):
    env = load_env(f"{env_file}:slow", TASK, 0.2)
    t = time.perf_counter()
    episodes, _ = episodes_of(tokenizer, {"q1:": ["<call>slow</call>"], "q2:": ["<call>1+1</call>", "2" + EOS],
                                          "q3:": ["<call>6*7</call>", "42" + EOS]}, env=env)
    assert time.perf_counter() - t < 10
    slow, ok, ok2 = episodes
    assert (slow.ended_by, slow.finish_reason) == ("timeout", "length")
    assert slow.token_ids == ids(tokenizer, "<call>slow</call>") and slow.parts == [["model", "<call>slow</call>"]]
    assert (ok.ended_by, ok.answer, ok.tool_calls) == ("answer", "2", 1)
    assert ok.parts[1] == ["env", "<result>2</result>"] and ok2.parts[1] == ["env", "<result>42</result>"]
    metrics = episode_metrics(episodes)
    assert metrics["env/timeouts"] == 1.0


def test_a_turns_steps_go_to_the_workers_at_once(tokenizer, env_file, monkeypatch):
    """Your environment's calls of one turn run in parallel: one WORKERS.map of them all (a turn of N
    hanging calls costs ceil(N / workers) limits, not N), each result back to its own episode."""
    import common.env

    env = load_env(f"{env_file}:slow", TASK, 0.5)
    batches, real = [], common.env.WORKERS.map
    monkeypatch.setattr(common.env.WORKERS, "map", lambda recipe, calls, timeout: (
        batches.append([c[0] for c in calls]), real(recipe, calls, timeout))[1])
    episodes, _ = episodes_of(tokenizer, {"q1:": ["<call>slow</call>"], "q2:": ["<call>1+1</call>", "2" + EOS],
                                          "q3:": ["<call>slow</call>"]}, env=env)
    assert batches == [["start"]] * 3 + [["step"] * 3, ["step"]]  # turn 1: all three; turn 2: q2's answer
    assert [e.ended_by for e in episodes] == ["timeout", "answer", "timeout"]
    assert episodes[1].parts[1] == ["env", "<result>2</result>"]
    metrics = episode_metrics(episodes)
    assert (metrics["env/calls"], metrics["env/timeouts"]) == (4.0, 2.0)


class Huge:
    """An observation of a million characters (the probe's 1 MB) for every call."""
    stop = ("</call>",)

    def start(self, example):
        return None

    def step(self, state, turn):
        return Step("<result>" + "7" * 1_000_000 + "</result>", tool_call=True)


def test_an_observation_too_long_for_the_budget_ends_the_episode_untokenized(tokenizer, monkeypatch):
    """Characters past what the budget left can hold are never tokenized (2.2 s a MB): the text is
    measured against (room + 1) x the longest token's characters first."""
    from common import env as env_module

    seen = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, *a, **k: (
        seen.append(len(text)), real(self, text, *a, **k))[1])
    episodes, _ = episodes_of(tokenizer, {"q:": ["<call>1+1</call>"]}, env=CheckedEnv(Huge(), "huge", 5.0),
                              max_new_tokens=40)
    assert episodes[0].ended_by == "budget" and episodes[0].parts == [["model", "<call>1+1</call>"]]
    assert all(n < 1000 for n in seen), seen
    # every token's text is at most longest_token characters (the bound's premise), and no more than that
    longest = env_module.longest_token(tokenizer)
    assert max(len(tokenizer.decode([t])) for t in range(len(tokenizer))) <= longest
    # below the cut the ids are the observation's whole ids, and None exactly where they leave no room
    text = "<result>12345</result>"
    whole = observation_ids(tokenizer, text, False, [])
    assert observation_ids(tokenizer, text, False, [], room=len(whole) + 1) == whole
    assert observation_ids(tokenizer, text, False, [], room=len(whole)) is None
    assert observation_ids(tokenizer, "7" * (2 * longest), False, [], room=1) is None


@pytest.mark.parametrize("function, message", [
    ("text", "step returned <result>2</result> on turn '<call>1+1</call>'; it must return a Step"),
    ("not_text", "step returned a Step whose observation is int 5 on turn '<call>1+1</call>'; "
                 "it must return a Step"),
])
def test_a_step_that_returns_no_step_is_one_line(tokenizer, env_file, function, message):
    env = load_env(f"{env_file}:{function}", TASK, 5.0)
    with pytest.raises(ConfigError, match=re.escape(f"--env '{env_file}:{function}': {message}")) as e:
        episodes_of(tokenizer, {"q:": ["<call>1+1</call>"]}, env=env)
    one_line(e)


# ------------------------------------------------------------------------------------------
# 5. load_env: each bad --env one line, before anything heavy
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown environment 'nope'; known: calculator, or FILE.py:FUNCTION"),
    ("/nonexistent.py:f", "--env '/nonexistent.py:f': file '/nonexistent.py' does not exist"),
    ("{file}:missing", "--env '{file}:missing': '{file}' has no function 'missing'"),
    ("{file}:needs_an_argument", "--env '{file}:needs_an_argument': an environment function takes no argument"),
    ("{file}:no_methods", "--env '{file}:no_methods': returned object, not an environment"),
    ("{file}:stop_is_a_string", "--env '{file}:stop_is_a_string': returned Raising, not an environment"),
    ("{file}:stop_holds_a_number", "--env '{file}:stop_holds_a_number': returned Raising, not an environment"),
    ("{file}:stop_holds_an_empty_string", "--env '{file}:stop_holds_an_empty_string': returned Raising, not an "
                                          "environment"),
    ("{file}:max_turns_zero", "--env '{file}:max_turns_zero': max_turns must be None or an int >= 1, got 0"),
    ("{file}:max_turns_a_string", "--env '{file}:max_turns_a_string': max_turns must be None or an int >= 1, "
                                  "got '3'"),
    ("{file}:start_raises", "--env '{file}:start_raises': start raised ZeroDivisionError: division by zero"),
])
def test_a_bad_env_is_one_line(env_file, spec, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message.format(file=env_file))) as e:
        load_env(spec.format(file=env_file), TASK, 5.0)
    one_line(e)


@pytest.mark.parametrize("timeout", [-1.0, math.nan])
def test_a_bad_env_timeout_is_the_flags_fault_in_one_line(timeout):
    with pytest.raises(ConfigError, match=re.escape(f"--env-timeout must be >= 0 seconds (0: no limit), got {timeout}")):
        load_env("calculator", TASK, timeout)


def test_a_reward_that_reads_the_transcript_passes_the_start_up_probe(tmp_path, monkeypatch):
    """docs/multiturn.md: --reward terms read example["transcript"]; the probe's example has one too."""
    from common.args import parse_args
    from common.setup import prepare
    from common.scripts import load_script

    monkeypatch.chdir(ROOT)
    user = tmp_path / "reads.py"
    user.write_text('def reads(completion, example):\n    return float(example["transcript"].endswith(completion))\n')
    script = load_script("grpo_multiturn.py")
    _, reward, _, _ = prepare(parse_args(script.Args, ["--task", "multiply", "--reward", f"{user}:reads"]), script.check)
    assert [t.name for t in reward.terms] == ["reads"]


def test_the_example_env_loads_and_retries(tokenizer):
    env = load_env(str(ROOT / "examples" / "my_env.py") + ":retry", TASK, 5.0)
    assert isinstance(env, CheckedEnv) and env.stop == ()
    (wrong, right), _ = episodes_of(tokenizer, {"q1:": ["41" + EOS, "42" + EOS], "q2:": ["42" + EOS]}, env=env)
    assert wrong.parts == [["model", "41"], ["env", "\nwrong, try again: "], ["model", "42"]]
    assert (wrong.ended_by, wrong.tool_calls, right.parts, right.ended_by) == ("answer", 0, [["model", "42"]], "answer")


def test_a_missing_env_file_from_the_command_line_is_one_line_before_vllm(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "grpo_multiturn.py", "--model", TINY_MODEL, "--env", "/nonexistent.py:f",
                        "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == ["error: --env '/nonexistent.py:f': file '/nonexistent.py' does not exist"]
    assert not re.search(r"vllm|INFO|WARNING|Traceback|Loading safetensors", r.stdout + r.stderr, re.IGNORECASE)
    assert not out.exists()  # the run folder is made after the environment is checked


# ------------------------------------------------------------------------------------------
# 6. observations are context: in the input, without a loss or KL term
# ------------------------------------------------------------------------------------------

def crafted_episodes(tokenizer):
    """Two prompts of different lengths, one episode each: call, observation, answer; and a turn
    cut by the turn limit (truncated)."""
    def turn(text, reason="stop"):
        t = ids(tokenizer, text)
        return CompletionOutput(t, text, [{i: Logprob(-0.5)} for i in t], reason)

    prompts = [ids(tokenizer, "q:"), ids(tokenizer, "long q:")]
    a = Episode(prompts[0], None)
    a.add_turn(turn("<call>2*3</call>"))
    a.add_observation(ids(tokenizer, "<result>6</result>"), "<result>6</result>")
    a.add_turn(turn("6" + EOS))
    a.end("answer")
    b = Episode(prompts[1], None)
    b.add_turn(turn("<call>12", "length"))
    b.end("turn_tokens")
    return prompts, [a, b]


def test_the_loss_mask_holds_the_models_tokens_only(tokenizer):
    prompts, episodes = crafted_episodes(tokenizer)
    a, b = episodes
    P = max(map(len, prompts))
    for mask_truncated in (False, True):
        input_ids, attention_mask, completion_mask, loss_mask, truncated = episode_batch(
            prompts, episodes, tokenizer.pad_token_id, "cpu", mask_truncated)
        C = completion_mask.shape[1]
        assert C == len(a.token_ids) and truncated.tolist() == [False, True]
        assert completion_mask[0].tolist() == a.model_mask
        assert completion_mask[1].tolist() == b.model_mask + [0] * (C - len(b.token_ids))
        assert loss_mask[0].tolist() == a.model_mask
        assert loss_mask[1].tolist() == ([0] * C if mask_truncated else completion_mask[1].tolist())
        # the observation's tokens are still the input, attended to
        assert input_ids[0, P:].tolist() == a.token_ids and attention_mask[0, P:].tolist() == [1] * C
        assert input_ids[1, P:P + len(b.token_ids)].tolist() == b.token_ids
        assert attention_mask[1].tolist() == [0] * (P - len(prompts[1])) + [1] * (len(prompts[1]) + len(b.token_ids)) \
            + [0] * (C - len(b.token_ids))
    assert 0 in a.model_mask and 1 in a.model_mask  # a real mix


def test_observation_tokens_get_no_gradient_in_the_loss(tokenizer):
    prompts, episodes = crafted_episodes(tokenizer)
    loss_mask = episode_batch(prompts, episodes, tokenizer.pad_token_id, "cpu")[3]
    args = Args()
    assert args.kl_coef > 0
    B, C = loss_mask.shape
    torch.manual_seed(0)
    logprobs = (-torch.rand(B, C) - 0.1).requires_grad_()
    ref_logprobs = logprobs.detach() - 0.3
    num_tokens, num_seqs = loss_mask.sum(), B
    loss, _ = compute_loss(logprobs, logprobs.detach(), ref_logprobs, torch.tensor([1.0, -0.5]), torch.ones(B, C),
                           loss_mask, args, num_tokens, num_seqs)
    loss.backward()
    grad = logprobs.grad
    model_tokens = torch.zeros(B, C, dtype=torch.bool)
    for i, e in enumerate(episodes):
        model_tokens[i, :len(e.model_mask)] = torch.tensor(e.model_mask, dtype=torch.bool)
    assert (grad[model_tokens] != 0).all()
    assert (grad[~model_tokens] == 0).all()  # observation tokens and padding
    observation = torch.tensor([m == 0 for m in episodes[0].model_mask])
    assert observation.sum() == len(ids(tokenizer, "<result>6</result>")) and (grad[0, observation] == 0).all()


def test_observation_tokens_are_context_of_the_policy(tokenizer, tiny_policy, monkeypatch):
    """Through the policy: the loss's gradient reaches the observation tokens' input embeddings
    (later model tokens read them), but no per-token term scores them."""
    prompts, episodes = crafted_episodes(tokenizer)
    input_ids, attention_mask, _, loss_mask, _ = episode_batch(prompts, episodes, tokenizer.pad_token_id, "cpu")
    B, C = loss_mask.shape
    P = input_ids.shape[1] - C
    # the padded batch (not packed): the embedding output's [i, P + j] is completion token j of row i
    monkeypatch.setattr(common.batch, "pack", lambda *a, **k: None)
    embedded = []

    def keep(module, inputs, output):
        output.retain_grad()
        embedded.append(output)

    handle = tiny_policy.get_input_embeddings().register_forward_hook(keep)
    try:
        logprobs = forward_logprobs(tiny_policy, input_ids, attention_mask, C)
    finally:
        handle.remove()
    logprobs.retain_grad()
    loss, _ = compute_loss(logprobs, logprobs.detach(), logprobs.detach() - 0.3, torch.tensor([1.0, -0.5]),
                           torch.ones(B, C), loss_mask, Args(), loss_mask.sum(), B)
    loss.backward()
    (embeddings,) = embedded
    observation = [j for j, m in enumerate(episodes[0].model_mask) if m == 0]
    # model tokens follow the observation
    assert observation and all(episodes[0].model_mask[j] == 1 for j in range(observation[-1] + 1, C))
    row_grad = embeddings.grad[0, P:].abs().sum(-1)
    assert (row_grad[observation] > 0).all()  # context: the answer's log-prob depends on them
    assert (logprobs.grad[0, observation] == 0).all()  # no loss term of their own
    assert (logprobs.grad[0, [j for j in range(C) if j not in observation]] != 0).all()


# ------------------------------------------------------------------------------------------
# 7. observations under a chat template: the separators between turns
# ------------------------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chatml_tokenizer(tmp_path_factory):
    """The tiny tokenizer with a ChatML template (as tests/test_chat.py builds it; EOS <|im_end|>)."""
    dst = tmp_path_factory.mktemp("chatml") / "model"
    shutil.copytree(TINY_MODEL, dst)
    (dst / "chat_template.jinja").write_text(CHATML)
    assert json.loads((dst / "tokenizer_config.json").read_text())["eos_token"] == EOS
    return load_tokenizer(str(dst))


def test_observation_ids_under_a_chat_template_keep_the_separators(tokenizer, chatml_tokenizer):
    tok, text = chatml_tokenizer, "<result>84</result>"
    im_end = tok.convert_tokens_to_ids(EOS)
    turn = ids(tok, "<call>12*(3+4)</call>")  # ended by the stop string: the turn's <|im_end|> is the observation's
    obs = observation_ids(tok, text, True, turn)
    assert tok.decode(obs) == f"<|im_end|>\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert obs.count(im_end) == 2  # the special token, not its characters
    ended = ids(tok, "84" + EOS)  # a turn that ended with <|im_end|>: not repeated
    assert ended[-1] == im_end
    assert observation_ids(tok, text, True, ended) == obs[1:]
    assert tok.decode(obs[1:]) == f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"
    # without a template, or with --no-chat-template: the text's own ids
    assert observation_ids(tok, text, False, turn) == ids(tok, text) == observation_ids(tokenizer, text, True, turn)


USER_AND_ASSISTANT_ONLY = ("{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
                           "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}" + CHATML[len("{% for m in messages %}"):])


def test_a_template_without_a_tool_role_gets_user_messages_and_one_that_cannot_continue_is_one_line(
        chatml_tokenizer, tmp_path):
    from common.env import observation_frame

    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = USER_AND_ASSISTANT_ONLY
    with pytest.raises(Exception, match="unknown role tool"):  # the template really refuses a tool message
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    ended = ids(tok, "84" + EOS)
    assert observation_ids(tok, "feedback", True, ended) == ids(
        tok, "\n<|im_start|>user\nfeedback<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = "{{ raise_exception('no conversation goes on') }}"
    observation_frame.cache_clear()
    with pytest.raises(ConfigError, match="cannot render a tool or user message after an assistant turn"):
        load_env("calculator", TASK, 5.0, tok, chat_template=True)
    load_env("calculator", TASK, 5.0, tok, chat_template=False)  # raw prompts: no template needed


def test_a_chat_template_episode_is_the_conversation_the_template_renders(chatml_tokenizer):
    tok = chatml_tokenizer
    prompt = encode_prompts(tok, ["6*7="])[0]
    llm = ScriptedEngine(tok, {})
    llm.scripts = {tuple(prompt): ["<call>6*7</call>", "42" + EOS]}
    (e,) = run_episodes(llm, calculator(), tok, [prompt], [TASK.train[0]], args_of(max_new_tokens=128),
                        temperature=1.0)
    assert e.ended_by == "answer" and e.answer == "42"
    conversation = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "<call>6*7</call>"},
                    {"role": "tool", "content": "<result>42</result>"}, {"role": "assistant", "content": "42"}]
    # the template puts "\n" after the last <|im_end|>; the episode ends at <|im_end|>
    assert tok.decode(prompt + e.token_ids) + "\n" == tok.apply_chat_template(conversation, tokenize=False)
    assert e.token_ids[:len(ids(tok, "<call>6*7</call>"))] == ids(tok, "<call>6*7</call>")  # sampled ids kept


# ------------------------------------------------------------------------------------------
# 8. episode metrics
# ------------------------------------------------------------------------------------------

def test_episode_metrics_by_hand():
    def episode(parts, tool_calls, tool_errors, ended_by):
        e = Episode([5], None, tool_calls=tool_calls, tool_errors=tool_errors,
                    env_calls=sum(who == "env" for who, _ in parts) + (ended_by == "timeout"))
        for who, n in parts:
            e.token_ids += [7] * n
            e.model_mask += [int(who == "model")] * n
            e.parts.append([who, "x" * n])
        e.end(ended_by)
        return e

    episodes = [episode([("model", 3), ("env", 2), ("model", 2)], 1, 0, "budget"),
                episode([("model", 4), ("env", 3), ("model", 1), ("env", 2), ("model", 2)], 2, 1, "max_turns"),
                episode([("model", 2)], 0, 0, "timeout")]
    expected = {"turns_mean": (2 + 3 + 1) / 3, "tool_calls_mean": 1.0, "tool_errors_mean": 1 / 3,
                "observation_tokens_mean": (2 + 5 + 0) / 3, "budget_frac": 1 / 3, "max_turns_frac": 1 / 3,
                "timeouts": 1.0, "calls": 1 + 2 + 1, "invalid_moves_mean": 0.0}
    assert episode_metrics(episodes) == pytest.approx({f"env/{k}": v for k, v in expected.items()})
    assert episode_metrics(episodes, "eval/env/") == pytest.approx({f"eval/env/{k}": v for k, v in expected.items()})
    episodes[2].end("answer")
    assert episode_metrics(episodes)["env/timeouts"] == 0.0
    # where the environment scores episodes (a game): invalid moves, and the turns of the won ones only
    episodes[0].env_reward, episodes[1].env_reward, episodes[2].env_reward = 1.0, 0.4, 1.0
    episodes[1].invalid_moves = 2
    game = episode_metrics(episodes)
    assert game["env/turns_per_win"] == (2 + 1) / 2 and game["env/invalid_moves_mean"] == 2 / 3
    episodes[0].env_reward = episodes[2].env_reward = 0.5
    assert math.isnan(episode_metrics(episodes)["env/turns_per_win"])  # none won


# ------------------------------------------------------------------------------------------
# 9. the transformers engine: per-request max_tokens and stop strings
# ------------------------------------------------------------------------------------------

@pytest.fixture()
def engine(tiny_policy):
    llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
    sync_weights(llm, tiny_policy)
    return llm


def greedy(tokenizer, **changes):
    return SamplingParams(**{"n": 1, "temperature": 0.0, "max_tokens": 12, "logprobs": 0,
                             "stop_token_ids": stop_token_ids(tokenizer), **changes})


# the tiny model's greedy answers: "12358", "970", "6443210", "61", each then EOS
PROMPTS = ["sort 52813:", "sort 907:", "sort 4410236:", "sort 61:"]


def test_the_transformers_engine_takes_each_requests_max_tokens(engine, tokenizer):
    requests = [{"prompt_token_ids": p} for p in encode_prompts(tokenizer, PROMPTS)]
    free = [o.outputs[0] for o in engine.generate(requests, greedy(tokenizer))]
    assert [c.text for c in free] == ["12358", "970", "6443210", "61"] and {c.finish_reason for c in free} == {"stop"}
    limits = [2, 12, 3, 12]
    cut = [o.outputs[0] for o in engine.generate(requests, [greedy(tokenizer, max_tokens=m) for m in limits])]
    assert [c.token_ids for c in cut] == [free[0].token_ids[:2], free[1].token_ids, free[2].token_ids[:3],
                                         free[3].token_ids]
    assert [c.finish_reason for c in cut] == ["length", "stop", "length", "stop"]
    assert [c.text for c in cut] == ["12", "970", "644", "61"]
    assert [len(c.logprobs) for c in cut] == [2, 4, 3, 3]


def test_the_transformers_engine_stops_at_stop_strings(engine, tokenizer):
    requests = [{"prompt_token_ids": p} for p in encode_prompts(tokenizer, PROMPTS[:2])]
    for include, text in [(True, "1235"), (False, "12")]:
        params = greedy(tokenizer, stop=["35", "x"], include_stop_str_in_output=include)
        stopped, other = [o.outputs[0] for o in engine.generate(requests, [params, params])]
        assert (stopped.text, stopped.finish_reason) == (text, "stop")
        assert stopped.token_ids == ids(tokenizer, "1235")  # the token that completes the stop string is kept
        assert (other.text, other.finish_reason, other.token_ids) == ("970", "stop", ids(tokenizer, "970" + EOS))


def test_the_transformers_engine_refuses_params_differing_beyond_max_tokens(engine, tokenizer):
    requests = [{"prompt_token_ids": p} for p in encode_prompts(tokenizer, PROMPTS[:2])]
    for other in (greedy(tokenizer, temperature=1.0), greedy(tokenizer, stop=["3"]), greedy(tokenizer, n=2)):
        with pytest.raises(ConfigError, match="differ in max_tokens only") as e:
            engine.generate(requests, [greedy(tokenizer), other])
        one_line(e)
