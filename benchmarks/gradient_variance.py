"""The policy-gradient lecture's claim, measured: a baseline keeps the expected gradient
and lowers its variance. REINFORCE without a baseline, with the batch-mean baseline, RLOO's
leave-one-out baseline and GRPO's group normalization, on the same samples.

    python benchmarks/gradient_variance.py                          # 64 batches of 8 prompts x 8 completions
    python benchmarks/gradient_variance.py --task sort sort-partial # both rewards on the same completions
    python benchmarks/gradient_variance.py --batches 8              # faster

A fixed set of prompts from the task is drawn once. Each of --batches batches samples
fresh completions for those prompts from the initial policy (transformers, temperature T),
scores them with the task's reward, and computes the policy gradient of each estimator
with the scripts' own functions (reinforce.compute_advantages / update_baseline,
rloo.compute_advantages, grpo.compute_advantages, and their compute_loss at ratio 1: one
on-policy step, no clipping, no KL). Every estimator sees the same samples and the same
loss aggregation; only the advantage differs. Tasks with the same prompts (sort and
sort-partial) are measured on the very same completions: only the reward differs. Over the
batches, per task and estimator:

    trace of the covariance     tr Cov[g] = sum over parameters of the variance across batches
    relative variance           tr Cov[g] / |E g|^2, |E g|^2 estimated without bias as |mean g|^2 - tr Cov / N;
                                scale-free, so GRPO's 1/std scaling does not distort it
    vs. no baseline             relative variance / that of REINFORCE without a baseline, with a 95%
                                percentile bootstrap interval (batches resampled, the same for every estimator)
    cosine to the mean          mean over batches of cos(g_b, mean of the other batches' g): how well one
                                batch points where the estimator points on average
    cosine to no-baseline mean  cos(mean g, mean g of REINFORCE without a baseline): a baseline must not
                                change the expected direction (GRPO's per-prompt 1/std reweights it)
    b*                          the variance-optimal constant baseline E[R |grad log p|^2] / E[|grad log p|^2]
                                against the mean reward (which the batch-mean baseline subtracts)

Writes gradient_variance.md (the tasks side by side, sentences generated from the numbers,
then every statistic per task) and gradient_variance.json to --out.
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

from benchmarks.util import ROOT, environment, fmt, markdown_table, write_part  # noqa: E402

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
        return grpo.compute_loss(logprobs, logprobs.detach(), None, advantages[:, 0], mask, args,
                                 num_tokens, num_seqs)[0]
    return reinforce.compute_loss(logprobs, advantages, mask, reinforce.Args(loss_agg=loss_agg),
                                  num_tokens, num_seqs)[0]


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


def ratio_phrase(ratio: float, interval: tuple[float, float]) -> str:
    """'2.3 times lower (...)' / '1.8 times higher (...)' / 'no clear difference (...)'."""
    lo, hi = interval
    ci = f"ratio {ratio:.2f}, 95% bootstrap interval {lo:.2f}-{hi:.2f}"
    if hi < 1:
        return f"{1 / ratio:.1f} times lower ({ci})"
    if lo > 1:
        return f"{ratio:.1f} times higher ({ci})"
    return f"no clear difference ({ci} includes 1)"


def variance_findings(task: str, d: dict) -> list[str]:
    """Sentences stating what was measured on one task, generated from its numbers."""
    est = d["estimators"]
    out = []
    for name in ("batch-mean", "rloo", "grpo"):  # the lecture's baselines (Dr. GRPO: RLOO's numbers, see the note)
        if name in est:
            s = est[name]
            out.append(f"{s['label']}: relative gradient variance {s['relative_variance']:.3g} against "
                       f"{est['none']['relative_variance']:.3g} without a baseline, "
                       f"{ratio_phrase(s['relative_variance_vs_reference'], s['ratio_interval'])}.")
    sn = d["score_norms"]
    if sn["completions"] and sn["optimal_baseline"] is not None and sn["mean_reward"]:
        b, m = sn["optimal_baseline"], sn["mean_reward"]
        text = (f"The variance-optimal constant baseline b* = {b:.2f} against the mean reward {m:.2f} of the same "
                f"{sn['completions']} completions (b*/mean {b / m:.2f}; b* − mean R = Cov(R, ‖∇ log p‖²) / "
                f"E‖∇ log p‖² = {round(b - m, 2) + 0.0:+.2f})")
        if 0.8 <= b / m <= 1.25:
            text += ": a baseline at the mean reward is close to the variance-optimal constant"
        else:
            text += (f": reward and ‖∇ log p(y)‖² are {'negatively' if b < m else 'positively'} correlated, so a "
                     f"baseline at the mean reward is {'above' if b < m else 'below'} the variance-optimal constant")
        parts = [(k, lab) for k, lab in (("reward_1", "R = 1"), ("partial", "0 < R < 1"), ("reward_0", "R = 0"))
                 if sn[f"mean_sq_norm_{k}"] is not None]
        if parts:
            text += "; mean ‖∇ log p‖²: " + ", ".join(f"{fmt(sn[f'mean_sq_norm_{k}'], 0)} for {lab}"
                                                     for k, lab in parts)
        out.append(text + ".")
    return out


@torch.no_grad()
def sample_completions(policy, tokenizer, prompt_ids, n: int, max_new_tokens: int, temperature: float):
    """n sampled completions per prompt (consecutive), each up to and including its EOS."""
    width = max(len(p) for p in prompt_ids)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    out = policy.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=temperature,
                          top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=max_new_tokens,
                          pad_token_id=pad, eos_token_id=eos)
    completions = []
    for row in out[:, width:].tolist():
        completions.append(row[:row.index(eos) + 1] if eos in row else row)
    return completions


def measure(policy, tokenizer, params, tasks: dict, examples: dict, args) -> dict:
    """Gradients of every estimator on --batches batches for tasks that share their prompts:
    each batch's completions are sampled and scored by the policy once, and every task's
    reward is computed on those same completions. Returns {task: results}."""
    from common.ops import forward_logprobs, make_batch
    from common.tasks import encode_prompts

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
        completions = sample_completions(policy, tokenizer, prompt_ids, G, args.max_new_tokens, args.temperature)
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
        d = {"mean_reward": rewards.mean().item(), "reward_kind": reward_kind(rewards),
             "partial_frac": ((rewards > 0) & (rewards < 1)).float().mean().item(),
             "groups_all_equal_frac": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
             "shared_samples_with": [u for u in names if u != t], "seconds": seconds,
             "estimators": {name: {"label": ESTIMATORS[name], **s, "ratio_interval": list(intervals[name])}
                            for name, s in stats.items()},
             "score_norms": score_norm_stats(score_norms[t])}
        d["findings"] = variance_findings(t, d)
        out[t] = d
        grads[t] = None  # free the stored gradients before the next task's statistics
    return out


def task_table(d: dict) -> str:
    """Every statistic of one task's estimators."""
    header = ["estimator", "relative variance tr Cov / ‖E g‖²", "vs. no baseline (95% interval)", "tr Cov (raw)",
              "‖mean g‖", "cos(g_batch, mean g)", "cos(mean g, mean g no baseline)"]
    rows = [[s["label"], f"{s['relative_variance']:.3g}", ratio_cell(s), f"{s['trace_cov']:.3g}",
             f"{s['mean_grad_norm']:.3g}", f"{s['cosine_to_mean']:.2f}", f"{s['cosine_mean_vs_reference']:.2f}"]
            for s in d["estimators"].values()]
    return markdown_table(header, rows)


def ratio_cell(s: dict) -> str:
    lo, hi = s["ratio_interval"]
    return f"{s['relative_variance_vs_reference']:.2f}x ({lo:.2f}-{hi:.2f})"


def side_by_side_table(results: dict) -> str:
    """One row per estimator, the relative variance and its ratio to no baseline per task."""
    tasks = list(results)
    header = ["estimator"]
    for t in tasks:
        header += [f"{t}: relative variance", f"{t}: vs. no baseline (95% interval)", f"{t}: cos(g_batch, mean g)"]
    rows = []
    for name, label in ESTIMATORS.items():
        row = [label]
        for t in tasks:
            s = results[t]["estimators"][name]
            row += [f"{s['relative_variance']:.3g}", ratio_cell(s), f"{s['cosine_to_mean']:.2f}"]
        rows.append(row)
    return markdown_table(header, rows)


def diagnostic_table(results: dict) -> str:
    """Per task: the rewards, and the variance-optimal constant baseline against the mean reward."""
    header = ["task", "reward", "mean reward", "samples with 0 < R < 1", "groups with all-equal rewards",
              "b* = E[R‖∇log p‖²] / E[‖∇log p‖²]", "mean R of the same completions",
              "mean ‖∇log p‖²: R = 1", "0 < R < 1", "R = 0", "completions (R = 1 / partial / 0)"]
    rows = []
    for t, d in results.items():
        sn = d["score_norms"]
        rows.append([f"`{t}`", d["reward_kind"], f"{d['mean_reward']:.2f}", f"{100 * d['partial_frac']:.0f}%",
                     f"{100 * d['groups_all_equal_frac']:.0f}%", fmt(sn["optimal_baseline"], 2),
                     fmt(sn["mean_reward"], 2), fmt(sn["mean_sq_norm_reward_1"], 0),
                     fmt(sn["mean_sq_norm_partial"], 0), fmt(sn["mean_sq_norm_reward_0"], 0),
                     f"{sn['completions']} ({sn['count_reward_1']} / {sn['count_partial']} / {sn['count_reward_0']})"])
    return markdown_table(header, rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-sort")
    p.add_argument("--task", nargs="+", default=["sort"],
                   help="one or more tasks; tasks with the same prompts (sort, sort-partial) are measured on the "
                        "same sampled completions, only the reward differs")
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
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "full")
    args = p.parse_args(argv)
    if args.batches < 2 or args.completions < 2:
        raise SystemExit("error: --batches and --completions must be >= 2")
    args.task = list(dict.fromkeys(args.task))
    env = environment(None if argv is None else [__file__, *argv])
    t_main = time.perf_counter()
    from common.models import check_model, load_policy, load_tokenizer
    from common.tasks import load_task

    import grpo  # noqa: F401  (the scripts whose estimators are measured; they import vLLM, slowly)
    import reinforce  # noqa: F401
    import rloo  # noqa: F401

    torch.set_num_threads(args.threads)
    model_path = args.model if os.path.isabs(args.model) or not (ROOT / args.model).exists() else str(ROOT / args.model)
    check_model(model_path)
    tokenizer = load_tokenizer(model_path)
    policy = load_policy(model_path, tokenizer, "float32", "cpu").eval()
    params = [p for p in policy.parameters() if p.requires_grad]
    # the fixed prompts of each task; tasks with the same prompts share their samples
    tasks, examples, groups = {}, {}, {}
    for name in args.task:
        tasks[name] = load_task(name, seed=args.seed)
        g = torch.Generator().manual_seed(args.seed)
        idx = torch.randint(len(tasks[name].train), (args.prompts,), generator=g).tolist()
        examples[name] = [tasks[name].train[i] for i in idx]
        groups.setdefault(tuple(e["prompt"] for e in examples[name]), []).append(name)
    results = {}
    for names in groups.values():
        results.update(measure(policy, tokenizer, params, {t: tasks[t] for t in names},
                               {t: examples[t] for t in names}, args))
    results = {t: results[t] for t in args.task}

    data = {"environment": env, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "parameters": sum(p.numel() for p in params), "tasks": results}
    shared = [t for t, d in results.items() if d["shared_samples_with"]]
    note = (f"{args.batches} batches of the same {args.prompts} prompts x {args.completions} fresh completions "
            f"(`{args.model}`, its initial weights, temperature {args.temperature}"
            + (f"; {', '.join(f'`{t}`' for t in shared)} are measured on the very same completions, only the "
               f"reward differs" if shared else "")
            + f"). Same samples and the same loss aggregation (`{args.loss_agg}`) for every estimator; only the "
            f"advantage differs. Relative variance tr Cov[g] / ‖E g‖² of one batch's gradient (lower: a batch "
            f"points more reliably where the estimator points on average); 'vs. no baseline' is its ratio to "
            f"REINFORCE without a baseline (below 1: the baseline lowers the variance), with a 95% percentile "
            f"bootstrap interval over the batches. Dr. GRPO's gradient is RLOO's times (K-1)/K on every batch, so "
            f"their scale-free numbers coincide. {data['parameters']:,} parameters.\n")
    diag_note = ("b* is the constant baseline that minimizes tr Cov of (R − b) ∇log p(y), measured on the first "
                 f"{args.score_norm_batches} batch(es); the batch-mean baseline subtracts roughly the mean reward.\n")
    findings = "".join(f"\nOn `{t}` ({d['reward_kind']} reward, mean {d['mean_reward']:.2f}):\n\n"
                       + "".join(f"- {line}\n" for line in d["findings"]) for t, d in results.items())
    summary = f"{side_by_side_table(results)}\n{note}\n{diagnostic_table(results)}\n{diag_note}{findings}"
    details = "".join(f"\nAll statistics on `{t}`:\n\n{task_table(d)}" for t, d in results.items())
    data["argv"] = list(sys.argv[1:] if argv is None else argv)
    data["wall_s"] = time.perf_counter() - t_main
    data["markdown"] = f"{summary}{details}"
    data["markdown_parts"] = {"side_by_side": side_by_side_table(results), "note": note,
                              "diagnostic": diagnostic_table(results), "diagnostic_note": diag_note,
                              "findings": findings, "details": details}
    write_part(args.out, "gradient_variance", data["markdown"], data, env)
    return data


if __name__ == "__main__":
    main()
