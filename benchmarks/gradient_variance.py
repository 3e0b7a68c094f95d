"""The policy-gradient lecture's claim, measured (a part of benchmarks/run.py): a baseline keeps
the expected gradient and lowers its variance. REINFORCE without a baseline, with the batch-mean
baseline, RLOO's leave-one-out baseline and GRPO's group normalization, on the same samples.

A fixed set of prompts from the task is drawn once. Each of --batches batches samples fresh
completions for those prompts from the initial policy (transformers, temperature T), scores
them with the task's reward, and computes each estimator's policy gradient with the scripts'
own functions (reinforce.compute_advantages / update_baseline, rloo.compute_advantages,
grpo.compute_advantages, and their compute_loss at ratio 1: one on-policy step, no clipping,
no KL). Every estimator sees the same samples and loss aggregation; only the advantage
differs. Tasks with the same prompts (sort and sort-partial) are measured on the very same
completions: only the reward differs. Over the batches, per task and estimator:

    tr Cov[g]                   sum over parameters of the variance across batches
    relative variance           tr Cov[g] / |E g|^2, |E g|^2 estimated without bias as |mean g|^2 - tr Cov / N;
                                scale-free, so GRPO's 1/std scaling does not distort it
    vs. no baseline             relative variance / that of REINFORCE without a baseline, with a 95%
                                percentile bootstrap interval (batches resampled, the same for every estimator)
    cosine to the mean          mean over batches of cos(g_b, mean of the other batches' g)
    cosine to no-baseline mean  cos(mean g, mean g of REINFORCE without a baseline): a baseline must not
                                change the expected direction (GRPO's per-prompt 1/std reweights it)
    b*                          the variance-optimal constant baseline E[R |grad log p|^2] / E[|grad log p|^2],
                                against the mean reward (which the batch-mean baseline subtracts)

run.py starts it in its own process (importing the scripts imports vLLM) and reads --json.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # importing the scripts imports vllm

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

import torch  # noqa: E402

from benchmarks.rollout_engines import hf_generate  # noqa: E402
from benchmarks.util import environment, write_json  # noqa: E402

ESTIMATORS = {
    "none": "REINFORCE, no baseline",
    "batch-mean": "REINFORCE, batch-mean baseline",
    "rloo": "RLOO, leave-one-out baseline",
    "grpo": "GRPO, (R - group mean) / group std",
    "dr-grpo": "Dr. GRPO, R - group mean",
}


def estimator_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """[B, C] per-token advantages of each estimator, from the scripts' own functions
    (no KL penalty: the return of every token is the completion's reward)."""
    import grpo
    import reinforce
    import rloo

    returns = reinforce.compute_returns(rewards, torch.zeros_like(mask), mask, kl_coef=0.0)
    out = {}
    for name in ("none", "batch-mean"):
        b, _ = reinforce.update_baseline(None, returns, reinforce.Args(baseline=name))
        out[name] = reinforce.compute_advantages(returns, mask, b)
    out["rloo"] = rloo.compute_advantages(returns, mask, group_size)[0]
    out["grpo"] = grpo.compute_advantages(rewards, group_size, scale_rewards=True).unsqueeze(1) * mask
    out["dr-grpo"] = grpo.compute_advantages(rewards, group_size, scale_rewards=False).unsqueeze(1) * mask
    return out


def estimator_loss(name: str, logprobs, advantages, mask, loss_agg: str):
    """The script's compute_loss for this estimator, on-policy (ratio 1, no KL)."""
    import grpo
    import reinforce

    num_tokens, num_seqs = mask.sum(), mask.shape[0]
    if name in ("grpo", "dr-grpo"):
        args = grpo.Args(kl_coef=0.0, loss_agg=loss_agg)
        # one advantage per completion; old log-probs = current ones: ratio 1, clipping inactive
        return grpo.compute_loss(logprobs, logprobs.detach(), None, advantages[:, 0], torch.ones_like(logprobs), mask,
                                 args, num_tokens, num_seqs)[0]
    return reinforce.compute_loss(logprobs, advantages, torch.ones_like(logprobs), mask,
                                  reinforce.Args(loss_agg=loss_agg), num_tokens, num_seqs)[0]


def variance_stats(grads: torch.Tensor, G: torch.Tensor | None = None) -> dict:
    """Statistics of N gradient estimates [N, P] (N >= 2) of one estimator, from their Gram
    matrix G = g g^T (float64; computed here unless given): nothing of size N x P is copied.
        |mean|^2 = sum(G) / N^2, tr Cov = (tr G - N |mean|^2) / (N - 1),
        cos(g_b, mean of the others) = (rowsum_b - G_bb) / (|g_b| |total - g_b|)."""
    G = gram(grads) if G is None else G
    n = G.shape[0]
    diag, rowsum, total_sq = G.diagonal(), G.sum(1), G.sum()
    mean_sq = (total_sq / n ** 2).item()
    trace_cov = (diag.sum().item() - n * mean_sq) / (n - 1)
    signal = mean_sq - trace_cov / n  # unbiased estimate of |E g|^2
    others_sq = (total_sq - 2 * rowsum + diag).clamp_min(0)  # |total - g_b|^2
    cosines = (rowsum - diag) / (diag * others_sq).sqrt().clamp_min(1e-16)
    return {"trace_cov": trace_cov, "mean_grad_norm": math.sqrt(max(mean_sq, 0.0)), "signal_sq": signal,
            "relative_variance": trace_cov / signal if signal > 0 else math.inf,
            "cosine_to_mean": cosines.mean().item()}


def mean64(grads: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """The mean over the N estimates [N, P], in float64, a chunk of parameters at a time."""
    return torch.cat([grads[:, i:i + chunk].double().mean(0) for i in range(0, grads.shape[1], chunk)])


def compare_estimators(grads: dict[str, torch.Tensor], reference: str = "none",
                       grams: dict[str, torch.Tensor] | None = None) -> dict:
    """variance_stats of each estimator, plus ratios and direction agreement with `reference`."""
    grams = grams or {name: gram(g) for name, g in grads.items()}
    stats = {name: variance_stats(g, grams[name]) for name, g in grads.items()}
    ref_mean = mean64(grads[reference])
    for name, s in stats.items():
        s["relative_variance_vs_reference"] = s["relative_variance"] / stats[reference]["relative_variance"]
        s["trace_cov_vs_reference"] = s["trace_cov"] / stats[reference]["trace_cov"]
        s["cosine_mean_vs_reference"] = torch.nn.functional.cosine_similarity(
            mean64(grads[name]), ref_mean, dim=0).item()
    return stats


def score_norm_stats(pairs: list[tuple[float, float]]) -> dict:
    """From (reward, |grad log p(y)|^2) pairs: the mean / median squared score norm of the
    completions with reward 1, with partial credit (0 < R < 1) and with reward 0, and the
    constant baseline that minimizes the trace of the covariance of (R - b) grad log p(y):
    b* = E[R |s|^2] / E[|s|^2]. b* - E[R] = Cov(R, |s|^2) / E[|s|^2]: b* lies below the
    mean reward exactly when low-reward completions have the larger score norms."""
    import statistics

    groups = {"reward_1": [n for r, n in pairs if r >= 1.0], "partial": [n for r, n in pairs if 0.0 < r < 1.0],
              "reward_0": [n for r, n in pairs if r <= 0.0]}
    total = sum(n for _, n in pairs)
    out = {"completions": len(pairs), "mean_reward": statistics.fmean(r for r, _ in pairs) if pairs else None,
           "optimal_baseline": sum(r * n for r, n in pairs) / total if total > 0 else None}
    for key, norms in groups.items():
        out[f"count_{key}"] = len(norms)
        out[f"mean_sq_norm_{key}"] = statistics.fmean(norms) if norms else None
        out[f"median_sq_norm_{key}"] = statistics.median(norms) if norms else None
    return out


def gram(grads: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """[N, N] inner products of N gradient estimates [N, P], in float64, a chunk of
    parameters at a time (no float64 copy of all of them)."""
    G = torch.zeros(grads.shape[0], grads.shape[0], dtype=torch.float64)
    for start in range(0, grads.shape[1], chunk):
        part = grads[:, start:start + chunk].double()
        G += part @ part.T
    return G


def relative_variance_resampled(G: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """variance_stats' relative variance for each row of `weights` [R, N] (how often each of
    the N estimates is drawn, rows summing to N), from their Gram matrix G [N, N] alone:
    |mean|^2 = w'Gw / N^2, sum of squared deviations = sum_i w_i G_ii - N |mean|^2."""
    n = G.shape[0]
    w = weights.double()
    mean_sq = ((w @ G) * w).sum(1) / n ** 2
    trace_cov = ((w * G.diagonal()).sum(1) - n * mean_sq) / (n - 1)
    signal = mean_sq - trace_cov / n
    return torch.where(signal > 0, trace_cov / signal, torch.full_like(signal, math.inf))


def bootstrap_ratio_intervals(grams: dict[str, torch.Tensor], reference: str = "none", resamples: int = 2000,
                              seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap over batches of relative variance / the reference's relative
    variance: every estimator is resampled with the same batches (they share the samples)."""
    n = grams[reference].shape[0]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (resamples, n), generator=gen)
    weights = torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(resamples, n, dtype=torch.float64))
    ref = relative_variance_resampled(grams[reference], weights)
    out = {}
    for name, G in grams.items():
        ratio = relative_variance_resampled(G, weights) / ref
        ratio = torch.nan_to_num(ratio, nan=math.inf).sort().values  # inf / inf: no signal at all, counted high
        lo = ratio[int(math.floor((1 - level) / 2 * (resamples - 1)))].item()
        hi = ratio[int(math.ceil((1 + level) / 2 * (resamples - 1)))].item()
        out[name] = (lo, hi)
    return out


def reward_kind(rewards: torch.Tensor) -> str:
    """What the rewards look like, read off the samples (not the task's name)."""
    if bool(((rewards == 0) | (rewards == 1)).all()):
        return "0/1"
    return "partial credit" if bool(((rewards >= 0) & (rewards <= 1)).all()) else "real-valued"


def measure(policy, tokenizer, params, tasks: dict, examples: dict, args) -> dict:
    """Gradients of every estimator on --batches batches for tasks that share their prompts:
    each batch's completions are sampled and scored by the policy once, and every task's
    reward is computed on those same completions. Returns {task: results}."""
    from common.batch import make_batch
    from common.ops import forward_logprobs
    from common.models import encode_prompts

    names = list(tasks)
    first = examples[names[0]]
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in first])
    G, eos = args.completions, tokenizer.eos_token_id
    # [batches, parameters] per task and estimator, filled in place (float32: 4 bytes a parameter)
    num_params = sum(p.numel() for p in params)
    grads = {t: {name: torch.empty(args.batches, num_params) for name in ESTIMATORS} for t in names}
    rewards_all = {t: [] for t in names}
    score_norms: dict[str, list] = {t: [] for t in names}
    torch.manual_seed(args.seed)  # the same samples whichever tasks are measured together
    t0 = time.perf_counter()
    for b in range(args.batches):
        completions = hf_generate(policy, tokenizer, prompt_ids, G, args.max_new_tokens, args.temperature)
        texts = [tokenizer.decode([t for t in c if t != eos], skip_special_tokens=True) for c in completions]
        input_ids, attention_mask, mask = make_batch([p for p in prompt_ids for _ in range(G)], completions,
                                                     tokenizer.pad_token_id, "cpu")
        mask = mask.float()
        logprobs = forward_logprobs(policy, input_ids, attention_mask, mask.shape[1], args.temperature)
        for t in names:
            rewards = torch.tensor([tasks[t].reward(text, examples[t][i // G]) for i, text in enumerate(texts)])
            rewards_all[t].append(rewards)
            for name, adv in estimator_advantages(rewards, mask, G).items():
                loss = estimator_loss(name, logprobs, adv, mask, args.loss_agg)
                parts = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                # the gradient of the objective (minus the loss's), flattened
                grads[t][name][b] = -torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1)
                                                for p, d in zip(params, parts)])
        if b < args.score_norm_batches:  # one backward pass per completion: |grad log p(y)|^2
            for i in range(len(completions)):
                parts = torch.autograd.grad((logprobs[i] * mask[i]).sum(), params, retain_graph=True,
                                            allow_unused=True)
                norm = sum(float((d ** 2).sum()) for d in parts if d is not None)
                for t in names:
                    score_norms[t].append((rewards_all[t][-1][i].item(), norm))
        if (b + 1) % max(1, args.batches // 8) == 0 or b + 1 == args.batches:
            print(f"gradient variance: {', '.join(names)}: batch {b + 1}/{args.batches}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    out = {}
    for t in names:
        grams = {name: gram(g) for name, g in grads[t].items()}
        stats = compare_estimators(grads[t], grams=grams)
        intervals = bootstrap_ratio_intervals(grams, seed=args.seed)
        rewards = torch.stack(rewards_all[t])  # [batches, prompts * G]
        grouped = rewards.view(args.batches, args.prompts, G)
        out[t] = {"mean_reward": rewards.mean().item(), "reward_kind": reward_kind(rewards),
             "partial_frac": ((rewards > 0) & (rewards < 1)).float().mean().item(),
             "groups_all_equal_frac": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
             "shared_samples_with": [u for u in names if u != t], "seconds": seconds,
             "estimators": {name: {"label": ESTIMATORS[name], **s, "ratio_interval": list(intervals[name])}
                            for name, s in stats.items()},
             "score_norms": score_norm_stats(score_norms[t])}
        grads[t] = None  # free the stored gradients before the next task's statistics
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-sort")
    p.add_argument("--task", nargs="+", default=["sort", "sort-partial"],
                   help="tasks with the same prompts (sort, sort-partial) share their sampled completions")
    p.add_argument("--prompts", type=int, default=8, help="fixed prompts per batch")
    p.add_argument("--completions", type=int, default=8, help="completions per prompt (the group)")
    p.add_argument("--batches", type=int, default=64, help="independent batches (gradient estimates)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--loss-agg", default="seq-mean-token-sum",
                   help="the same aggregation for every estimator (seq-mean-token-sum: the gradient of E[R])")
    p.add_argument("--score-norm-batches", type=int, default=2,
                   help="batches on which to measure each completion's |grad log p(y)|^2 (explains the variance)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: nothing here is timed, and one thread never stalls on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = p.parse_args(argv)
    if args.batches < 2 or args.completions < 2:
        raise SystemExit("error: --batches and --completions must be >= 2")
    env = environment(None if argv is None else [__file__, *argv])
    t_main = time.perf_counter()
    from common.models import check_model, load_policy, load_tokenizer
    from common.tasks import load_task

    import grpo  # noqa: F401  (the scripts whose estimators are measured; they import vLLM, slowly)
    import reinforce  # noqa: F401
    import rloo  # noqa: F401

    torch.set_num_threads(args.threads)
    check_model(args.model)
    tokenizer = load_tokenizer(args.model)
    policy = load_policy(args.model, tokenizer, "float32", "cpu").eval()
    params = [p for p in policy.parameters() if p.requires_grad]
    # the fixed prompts of each task; tasks with the same prompts share their samples
    tasks, examples, groups = {}, {}, {}
    for name in dict.fromkeys(args.task):
        tasks[name] = load_task(name, seed=args.seed)
        idx = torch.randint(len(tasks[name].train), (args.prompts,), generator=torch.Generator().manual_seed(args.seed))
        examples[name] = [tasks[name].train[i] for i in idx.tolist()]
        groups.setdefault(tuple(e["prompt"] for e in examples[name]), []).append(name)
    results = {}
    for names in groups.values():
        results.update(measure(policy, tokenizer, params, {t: tasks[t] for t in names},
                               {t: examples[t] for t in names}, args))
    data = {"environment": env, "argv": list(sys.argv[1:] if argv is None else argv),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "parameters": sum(p.numel() for p in params), "tasks": {t: results[t] for t in tasks},
            "wall_s": time.perf_counter() - t_main}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
