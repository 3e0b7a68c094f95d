"""The metrics every script logs the same way: section times, memory, and a step's generic metrics."""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from common import dist
from common.ops import RolloutCorrection, masked_mean, rollout_correction_terms
from common.rewards import TIMEOUTS

try:
    import resource  # Unix only
except ImportError:  # Windows
    resource = None


@contextlib.contextmanager
def timed(times: dict, name: str):
    """with timed(times, "rollout"): ...  stores the section's wall time in times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0


def memory_metrics(llm) -> dict:
    """memory/engine_gib: what the vLLM engine took when it started (weights and KV cache; on
    CPU the process memory it added). memory/peak_gib: the trainer's peak since the previous
    call, i.e. this step, on CUDA (torch's peak allocation, less the engine's tensors); on CPU
    the process's peak resident memory so far, engine included (it cannot be reset there), and
    not logged on Windows, which has no getrusage."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() - llm.memory["allocated"]
        torch.cuda.reset_peak_memory_stats()
    else:
        peak = peak_rss()
    peak_gib = {} if peak is None else {"memory/peak_gib": peak / 2**30}
    return {**peak_gib, "memory/engine_gib": llm.memory["device"] / 2**30}


def peak_rss() -> int | None:
    """The process's peak resident memory so far, in bytes (getrusage's ru_maxrss is in KiB on
    Linux, in bytes on macOS); None on Windows, which has no getrusage."""
    if resource is None:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def minibatch_stats(step_stats: dict, micro_stats: list[dict]) -> torch.Tensor:
    """Adds a minibatch's statistics (micro_stats: each micro-batch's, tensors) to step_stats and returns
    its loss, loss/total. A micro-batch's loss, and each "loss/..." term, is its share of the minibatch's
    (divided by the minibatch's global counts, see common/dist.py), so these are summed over micro-batches
    and ranks: a logged loss is the minibatch's whatever the micro-batch size and world size. The other
    statistics are kept per micro-batch (step_metrics averages them). No host transfer here."""
    losses = [k for k in micro_stats[0] if k.startswith("loss/")]
    totals = dist.all_sum(torch.stack([sum(s[k] for s in micro_stats) for k in losses]))
    for k, total in zip(losses, totals):
        step_stats[k].append(total)
    for k in micro_stats[0].keys() - set(losses):
        step_stats[k].extend(s[k] for s in micro_stats)
    return step_stats["loss/total"][-1]


def update_metrics(step_stats: dict) -> dict:
    """The update's statistics as a step logs them: each averaged over its entries."""
    return {k: sum(v) / len(v) for k, v in step_stats.items()}


def rollout_metrics(old_logprobs, engine_logprobs, mask, correction: RolloutCorrection) -> dict:
    """The engine's mismatch as --rollout-correction sees it, over the whole batch (mask: the sampled
    tokens): the ratio rho_t = pi_old / pi_engine before truncation, per token (is_ratio_*) and per
    sequence (is_seq_ratio_*, rho_i = prod_t rho_t; log-ratios clamped to +-20), the weights' mean, and
    the fraction truncated and masked, of the tokens and of the sequences (one with such a token). Under
    torchrun *_min and *_max reduce by min and max (common/dist.py mean_over_ranks)."""
    terms = rollout_correction_terms(old_logprobs, engine_logprobs, mask, correction)
    mask = mask.bool()
    seqs = mask.any(-1)
    metrics = {"rollout/is_weight_mean": masked_mean(terms.weights, mask)}
    for name, ratio, where in (("is_ratio", terms.rho, mask), ("is_seq_ratio", terms.seq_rho, seqs)):
        metrics[f"rollout/{name}_mean"] = masked_mean(ratio, where)
        metrics[f"rollout/{name}_min"] = ratio[where].min() if where.any() else 1.0
        metrics[f"rollout/{name}_max"] = ratio[where].max() if where.any() else 1.0
    for name, flags in (("truncated", terms.truncated), ("masked", terms.masked)):
        metrics[f"rollout/is_{name}_frac"] = masked_mean(flags.float(), mask)
        metrics[f"rollout/is_seq_{name}_frac"] = masked_mean(flags.any(-1).float(), seqs)
    return metrics


def step_metrics(step_stats: dict, rewards, reward_parts: dict, completion_mask, truncated, old_logprobs,
                 vllm_logprobs, ref_logprobs, correction: RolloutCorrection, scheduler, times: dict, llm) -> dict:
    """The metrics every script logs the same way for a step: the update's statistics (mean over
    minibatches for the losses, see minibatch_stats; over micro-batches for the others), reward and
    its terms, reward calls past --reward-timeout (reward/timeouts, per process under torchrun),
    completion length and truncation, vLLM's log-prob mismatch and its correction (rollout_metrics), the
    learning rate, section times, throughput, memory, and KL(pi_old || pi_ref) (k3) where there is a reference."""
    metrics = update_metrics(step_stats)
    metrics.update({
        "reward/mean": rewards.mean(), "reward/std": rewards.std(),
        **{f"reward/{k}_mean": v.mean() for k, v in reward_parts.items() if k != TIMEOUTS},
        "reward/timeouts": reward_parts[TIMEOUTS].sum(),
        "response/length_mean": completion_mask.sum(1).float().mean(),
        "response/truncated_frac": truncated.float().mean(),
        "rollout/logprob_mismatch": masked_mean((vllm_logprobs - old_logprobs).abs(), completion_mask),
        **rollout_metrics(old_logprobs, vllm_logprobs, completion_mask, correction),
        "optim/lr": scheduler.get_last_lr()[0],
        **{f"time/{k}": v for k, v in times.items()},
        "throughput/tokens_per_s": completion_mask.sum() / times["step"],
        **memory_metrics(llm),
    })
    if ref_logprobs is not None:
        log_ref_ratio = ref_logprobs - old_logprobs
        metrics["kl/ref"] = masked_mean(torch.exp(log_ref_ratio) - log_ref_ratio - 1, completion_mask)
    return metrics
