"""grpo_async.py: K = 0 is grpo.py, a batch is never more than K versions old (and exactly as old as
the order of sampling and syncing says), and the stale batches' tokens are weighted by the
decoupled correction min(pi_prox / pi_behav, 2)."""

import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.guard import SyncGuard
from tests.test_grpo_e2e import SMALL, read_metrics

TIMED = ("time/", "throughput/", "memory/")  # wall-clock measurements: never the same twice
# the transformers engine seeds each sample by (seed, call count, index): two runs sample alike
RUN = ["--engine", "transformers", "--steps", "4", "--eval-every", "0", "--save-every", "0", *SMALL]


def test_max_staleness_0_is_grpo_step_for_step(tmp_path, run_main):
    """The same batches (rewards, lengths), losses, gradient norms and final weights, to fp32 rounding."""
    run_main("grpo.py", *RUN, "--output-dir", tmp_path / "grpo")
    run_main("grpo_async.py", *RUN, "--max-staleness", "0", "--output-dir", tmp_path / "async")
    grpo, async_ = read_metrics(tmp_path / "grpo"), read_metrics(tmp_path / "async")
    assert len(grpo) == len(async_) == 5
    for a, b in zip(grpo[1:], async_[1:]):
        assert b["async/staleness_mean"] == 0 and b["async/logprob_gap"] == b["rollout/logprob_mismatch"]
        for k in a:
            if not k.startswith(TIMED):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)
    assert grpo[-1]["eval/accuracy"] == async_[-1]["eval/accuracy"]
    weights = [AutoModelForCausalLM.from_pretrained(tmp_path / run / "final").state_dict()
               for run in ("grpo", "async")]
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])


@pytest.mark.parametrize("K, sync_every, staleness", [
    (0, 1, [0, 0, 0, 0, 0, 0]),
    (1, 1, [0, 1, 1, 1, 1, 1]),  # batches 0 and 1 sampled by version 0, then each by the step before
    (2, 1, [0, 1, 2, 2, 2, 2]),
    (1, 2, [0, 1, 0, 1, 0, 1]),  # weights after steps 2, 4, 6: batch 2 waits for version 2 (a 1-step-old one would do)
    (2, 3, [0, 1, 2, 0, 1, 2]),
])
def test_each_batch_is_as_old_as_the_order_of_sampling_and_syncing_makes_it(K, sync_every, staleness, tmp_path,
                                                                             run_main):
    run_main("grpo_async.py", "--engine", "vllm", "--steps", "6", "--eval-every", "0", "--save-every", "0", *SMALL,
             "--max-staleness", K, "--sync-every", sync_every, "--output-dir", tmp_path / "run")
    metrics = read_metrics(tmp_path / "run")[1:]
    assert [m["async/staleness_mean"] for m in metrics] == staleness
    # fresh batches measure the sync (the guard's); stale ones are the policy's own moves, larger
    fresh = [m["rollout/logprob_mismatch"] for m, s in zip(metrics, staleness) if s == 0]
    stale = [m["async/logprob_gap"] for m, s in zip(metrics, staleness) if s > 0]
    assert all(g < 1e-4 for g in fresh) and all(g > 1e-3 for g in stale), (fresh, stale)


def test_stale_tokens_are_weighted_by_the_truncated_ratio_of_proximal_to_behaviour(tmp_path, run_main, monkeypatch):
    """--rollout-correction auto at K = 1 in fp32: w_t = min(pi_prox / pi_behav, 2), far from 1 on the stale
    batches (pi_behav is the policy a step earlier), ~1 on the fresh batch 0 (fp32 numerics alone)."""
    import grpo_async

    seen = []
    rollout_correction = grpo_async.rollout_correction

    def recorded(old_logprobs, engine_logprobs, mask, correction):
        weights = rollout_correction(old_logprobs, engine_logprobs, mask, correction)
        seen.append((old_logprobs, engine_logprobs, mask.bool(), correction, weights))
        return weights

    monkeypatch.setattr(grpo_async, "rollout_correction", recorded)
    run_main("grpo_async.py", "--engine", "vllm", "--steps", "3", "--eval-every", "0", "--save-every", "0", *SMALL,
             "--num-minibatches", "1", "--micro-batch-size", "16", "--output-dir", tmp_path / "run")
    assert len(seen) == 3  # one micro-batch a step
    for step, (old, behaviour, mask, correction, weights) in enumerate(seen):
        assert (correction.mode, correction.cap) == ("token-truncate", 2.0)
        expected = torch.where(mask, torch.exp(old - behaviour).clamp(max=2.0), 1.0)
        assert torch.allclose(weights, expected, atol=1e-6), step
        off_one = (weights - 1).abs()[mask].max()
        assert off_one < 1e-3 if step == 0 else off_one > 1e-2, (step, off_one)


def test_a_stale_step_neither_counts_nor_resets_the_sync_guard():
    guard = SyncGuard(2, "fp32")
    assert guard.check(1.0) is None and guard.check(float("nan")) is None
    assert guard.check(1.0).startswith("the engine is not sampling from the policy")


@pytest.mark.parametrize("per_request", [True, False])
def test_an_evaluation_split_among_rollout_ranks_comes_back_in_the_requests_order(per_request, monkeypatch):
    """7 requests, 3 rollout ranks: ranks 1, 2, 3 decode requests 0-2, 3-4, 5-6 (each with its own
    SamplingParams where there is one a request) and the replies are joined in that order."""
    from common import dist
    from common.rollouts import Remote

    monkeypatch.setattr(dist, "ROLLOUT_RANKS", [1, 2, 3])
    asked = {}

    def ask(self, commands):  # a rollout rank's reply: each request's completion, tagged with its params
        asked.update(commands)
        return [[f"{q}|{p}" for q, p in zip(c[1], c[2] if per_request else [c[2]] * len(c[1]))]
                for c in commands.values()]

    monkeypatch.setattr(Remote, "ask", ask)
    monkeypatch.setattr(Remote, "close", lambda self: None)
    requests = [f"q{i}" for i in range(7)]
    params = [f"p{i}" for i in range(7)] if per_request else "greedy"
    completions = Remote("vllm").generate(requests, params, use_tqdm=True)
    assert list(asked) == [1, 2, 3]
    assert [command[1] for command in asked.values()] == [["q0", "q1", "q2"], ["q3", "q4"], ["q5", "q6"]]
    assert [command[3] for command in asked.values()] == [True, False, False]  # one progress bar
    assert completions == [f"q{i}|{f'p{i}' if per_request else 'greedy'}" for i in range(7)]


@pytest.mark.parametrize("flags, message", [
    (["--max-staleness", "-1"], "--max-staleness must be >= 0, got -1"),
    (["--max-staleness", "1", "--sync-every", "3"], "--sync-every must be in [1, --max-staleness + 1 = 2]"),
    (["--engine", "transformers", "--sync-every", "2", "--max-staleness", "2"], "--sync-every > 1 with --engine "),
])
def test_bad_async_flags_are_one_line(flags, message, run_main, tmp_path):
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("+", r"\+")):
        run_main("grpo_async.py", *flags, "--output-dir", tmp_path / "run")


def launch(tmp_path, name: str, *flags, processes: int = 2) -> list[dict]:
    """grpo_async.py under torchrun; its metrics."""
    from tests.test_dist import torchrun

    job = torchrun("grpo_async.py", *flags, "--output-dir", tmp_path / name, processes=processes)
    output = job.communicate(timeout=900)[0]
    assert job.returncode == 0, output[-3000:]
    return read_metrics(tmp_path / name)


@pytest.mark.slow
def test_rollout_ranks_and_trainer_ranks_at_k0_are_grpo_in_one_process(tmp_path, run_main):
    """torchrun: the last rank samples (its own engine and copy of the policy, synced by broadcast), the others
    train, one or two of them (FSDP2 over the trainer side's world). At K = 0 the two sides take turns exactly
    as grpo.py's one process: the same batches, losses and final weights (to the rounding of one thread against
    two, and of two ranks' sums); at K = 1 each batch after the first is one version old."""
    # one minibatch: N trainer ranks draw minibatches of their own rows, one process of all of them
    run = [*RUN, "--num-minibatches", 1]
    run_main("grpo.py", *run, "--output-dir", tmp_path / "grpo")
    grpo = read_metrics(tmp_path / "grpo")
    async1 = launch(tmp_path, "async1", *run, "--rollout-ranks", 1, "--max-staleness", 1)
    assert [m["async/staleness_mean"] for m in async1[1:]] == [0, 1, 1, 1]
    for trainers in (1, 2):
        name = f"async0_{trainers}"
        async0 = launch(tmp_path, name, *run, "--rollout-ranks", 1, "--max-staleness", 0, processes=trainers + 1)
        for a, b in zip(grpo[1:], async0[1:]):
            assert b["async/staleness_mean"] == 0
            # metrics are each rank's averaged over ranks: a std or a token mean of two halves is not the whole's
            for k in ("reward/mean", "response/length_mean", "loss/total", "optim/grad_norm",
                      *(("reward/std", "kl/ref") if trainers == 1 else ())):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (trainers, a["step"], k)
        assert grpo[-1]["eval/accuracy"] == async0[-1]["eval/accuracy"]
        weights = [AutoModelForCausalLM.from_pretrained(tmp_path / run / "final").state_dict()
                   for run in ("grpo", name)]
        assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-5) for k in weights[0]), trainers


LORA = ["--lora-rank", 8, "--lr", 2e-3]


@pytest.mark.slow
@pytest.mark.parametrize("engine, flags", [("vllm", []), ("transformers", []), ("vllm", LORA)],
                         ids=["vllm", "transformers", "lora"])
def test_two_rollout_ranks_sample_the_weights_the_trainer_sent(engine, flags, tmp_path):
    """One trainer rank, two rollout ranks with an engine each (each side a world of its own: vLLM's
    groups span the rollout ranks only). At K = 0 every batch is sampled by the weights of the step before,
    broadcast to both engines: their log-probs equal the trainer's to fp32 rounding at every step, which
    weights left unsynced (or half synced) after step 1 would not give. Under LoRA the trainer sends the
    merged weights (the adapters moved the policy: kl/ref, far above the mismatch, is the gap the base
    weights would leave)."""
    metrics = launch(tmp_path, engine, "--engine", engine, "--steps", 4, "--eval-every", 0, "--save-every", 0,
                     *SMALL, *flags, "--rollout-ranks", 2, "--max-staleness", 0, processes=3)[1:]
    assert len(metrics) == 4 and all(m["async/staleness_mean"] == 0 for m in metrics)
    assert all(m["rollout/logprob_mismatch"] < 1e-4 for m in metrics), [m["rollout/logprob_mismatch"] for m in metrics]
    assert len({m["reward/mean"] for m in metrics}) > 1  # the batches differ: the weights moved
    if flags:
        assert metrics[-1]["kl/ref"] > 1e-3, metrics[-1]["kl/ref"]


def test_a_resumed_run_draws_the_prompts_the_uninterrupted_run_drew(tmp_path, run_main):
    """At K = 2 the checkpoint after step 2 was taken with the batches of steps 3 and 4 already drawn; they are
    not saved, and the resumed run draws them again from the sampler's state after step 2's batch."""
    def prompts(run):
        import json

        lines = [json.loads(line) for line in open(tmp_path / run / "completions.jsonl")]
        return [[r["prompt"] for r in lines if r["step"] == s] for s in (3, 4)]

    flags = ["--engine", "transformers", "--eval-every", "0", *SMALL, "--max-staleness", "2"]
    run_main("grpo_async.py", *flags, "--steps", "4", "--save-every", "2", "--output-dir", tmp_path / "whole")
    run_main("grpo_async.py", "--resume", tmp_path / "whole" / "checkpoints" / "step_2", "--output-dir",
             tmp_path / "resumed")
    assert prompts("resumed") == prompts("whole") and all(prompts("whole"))


@pytest.mark.slow
def test_a_sigterm_to_torchrun_saves_on_the_trainer_stops_the_rollout_rank_and_the_run_resumes(tmp_path):
    """SIGTERM to torchrun (forwarded to both ranks): the trainer rank finishes its step and saves, the rollout
    rank leaves the signal to it and stops when told, saying nothing; the checkpoint resumes under torchrun."""
    from tests.conftest import ROOT
    from tests.test_launchers import finish, torchrun, wait_for_step

    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    flags = ["--engine", "transformers", "--eval-every", 0, *SMALL]
    proc = torchrun(["--nproc-per-node", 2], ["grpo_async.py", *flags, "--steps", 1000, "--save-every", 0,
                                               "--output-dir", out], ROOT, log)
    wait_for_step(proc, out, log, 2)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc, log, 300)
    last = read_metrics(out)[-1]["step"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last}"], output[-3000:]
    # the trainer's; the rollout rank ignores it
    assert output.count("SIGTERM: finishing this step") == 1, output[-3000:]
    # the rollout rank stopped when told: torchrun did not have to kill it (30 s after the SIGTERM it forwarded)
    assert "forcefully exiting" not in output and "[rank1]" not in output, output[-3000:]
    resumed = launch(tmp_path, "resumed", "--resume", out / "checkpoints" / f"step_{last}", "--steps", last + 2)
    assert [m["step"] for m in resumed if "loss/total" in m] == [last + 1, last + 2]
