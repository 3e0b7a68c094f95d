"""grpo_async.py measured: what overlapping rollouts with training buys here (throughput), and what
training on samples up to K versions old costs and the decoupled correction buys (learning).

    .venv/bin/python benchmarks/async_overlap.py --part throughput --json benchmarks/results/async_throughput.json
    .venv/bin/python benchmarks/async_overlap.py --part throughput --job smollm2 \
        --json benchmarks/results/async_throughput_smollm2.json
    .venv/bin/python benchmarks/async_overlap.py --part learning --json benchmarks/results/async_learning.json

Throughput, the same work on the same machine: samples trained per second (prompts x completions a
step over the mean step time, the first step left out: start-up) for
    (a) grpo.py in one process (torch on every core),
    (b) grpo.py under `torchrun --nproc-per-node 2` (each rank samples and trains its half),
    (c) grpo_async.py under torchrun, 1 rollout + 1 trainer rank, K = 0 (the two sides alternate),
    (d) the same with K = 1 and K = 2 (the rollout rank samples the next batches while the trainer trains).
With each side's busy share of the step: the trainer's is 1 - its wait for a batch (time/rollout), the
engine's its sampling seconds over the step. The limit of overlap is (c)'s (engine + trainer) /
max(engine, trainer), from (c)'s own section times: what separate devices, each as fast as here, give.

Learning: held-out accuracy at the end (and the curve against samples and seconds) for
K = 0, 1, 2, 4, with the correction (auto: token-truncate min(pi_prox / pi_behav, 2)) and without it
(--rollout-correction off: plain GRPO on stale samples), seeds 0-2, on `sort` (30 steps, evaluated every 2)
and `sort:9-11` (100 steps, every 5: benchmarks/run.py's budgets); each run under torchrun with 1 rollout +
1 trainer rank. K = 0 has no correction to switch off (auto is off in fp32). Beside --json, a plot a task
(JSON_sort.png, ...; for one --tasks, JSON.png): accuracy and reward against step (256 samples each) and
against training seconds.

Each run is a subprocess with a fresh run folder under --out; a finished run (summary.json) is reused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from benchmarks import run as bench  # noqa: E402
from benchmarks.util import (ROOT, environment, fmt, fmt_mean_std, markdown_table, provenance_md,  # noqa: E402
                             run_reused, write_json)

JOBS = {  # the work of one step, the same for every layout
    "tiny": ["--prompts-per-step", "32", "--completions-per-prompt", "8"],
    "smollm2": ["--model", "smollm2", "--task", "basic_arithmetic", "--prompts-per-step", "8",
                "--completions-per-prompt", "4", "--max-new-tokens", "64", "--lora-rank", "16", "--lr", "2e-4"],
}
LAYOUTS = [  # (label, launcher processes, script, flags)
    ("(a) grpo.py, one process", 1, "grpo.py", []),
    ("(b) grpo.py, torchrun 2 ranks", 2, "grpo.py", []),
    ("(c) grpo_async.py 1 + 1, K = 0", 2, "grpo_async.py", ["--max-staleness", "0"]),
    ("(d) grpo_async.py 1 + 1, K = 1", 2, "grpo_async.py", ["--max-staleness", "1"]),
    ("(d) grpo_async.py 1 + 1, K = 2", 2, "grpo_async.py", ["--max-staleness", "2", "--sync-every", "1"]),
]
TASKS = {  # learning's budget a task, (steps, evaluate every, target accuracy, flags): benchmarks/run.py's
    "sort": (30, 2, 0.8, []),  # full and hard modes
    "sort:9-11": (100, 5, 0.5, ["--max-new-tokens", "16"]),
}
SAMPLES_PER_STEP = 32 * 8  # learning's: grpo_async.py's default prompts x completions


def run(out: Path, processes: int, script: str, flags: list[str]) -> list[dict]:
    """SCRIPT FLAGS in one process or under torchrun, into out (reused when finished); its metrics."""
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                          "--nproc-per-node", str(processes)]
    return run_reused(out, [*launcher, script, *flags], out.name)


def mean(steps: list[dict], key: str) -> float | None:
    values = [m[key] for m in steps if key in m]
    return statistics.mean(values) if values else None


def throughput(args) -> tuple[dict, str]:
    job = JOBS[args.job]
    prompts, completions = (int(job[job.index(f) + 1]) for f in ("--prompts-per-step", "--completions-per-prompt"))
    samples_per_step = prompts * completions
    results, rows = {}, []
    for label, processes, script, flags in LAYOUTS:
        name = f"{args.job}-{script[:-3]}-{processes}-{'_'.join(flags[1::2]) or 'sync'}"
        metrics = run(args.out / name, processes, script,
                      [*job, "--steps", str(args.steps), "--eval-every", "0", "--save-every", "0", *flags])
        steps = [m for m in metrics if "time/step" in m][1:]  # the first left out: start-up
        step_s = mean(steps, "time/step")
        r = {"samples_per_s": samples_per_step / step_s, "step_s": step_s,
             "trainer_busy": None if script == "grpo.py" else 1 - mean(steps, "async/trainer_idle_frac"),
             "engine_busy": mean(steps, "async/engine_busy_frac"),
             "rollout_s": mean(steps, "time/rollout"), "train_s": mean(steps, "time/train")}
        results[label] = r
        rows.append([label, fmt(r["samples_per_s"], 1), fmt(step_s, 2), fmt(r["trainer_busy"], 2),
                     fmt(r["engine_busy"], 2)])
    c = results[LAYOUTS[2][0]]
    engine, trainer = c["engine_busy"] * c["step_s"], c["trainer_busy"] * c["step_s"]
    limit = (engine + trainer) / max(engine, trainer)
    results["limit_over_c"] = limit
    for label, r in results.items():
        if isinstance(r, dict):
            r["speedup_over_c"] = r["samples_per_s"] / c["samples_per_s"]
    for row, r in zip(rows, (results[label] for label, *_ in LAYOUTS)):
        row.append(f"{r['speedup_over_c']:.2f}x")
    table = markdown_table(["layout", "samples / s", "step (s)", "trainer busy", "engine busy", "over (c)"], rows)
    table += (f"\n\nThe limit of overlap from (c)'s sections: engine {engine:.2f} s + trainer {trainer:.2f} s a step, "
              f"(engine + trainer) / max = {limit:.2f}x over (c).\n")
    return results, table


def learning(args) -> tuple[dict, str]:
    configs = [(K, c) for K in args.staleness for c in (("auto",) if K == 0 else ("auto", "off"))]
    results, rows = {}, []
    for task in args.tasks:
        steps_per_run, eval_every, target, task_flags = TASKS[task]
        curves = {}
        for K, correction in configs:
            per_seed = []
            for seed in args.seeds:
                name = f"learn-{task.replace(':', '_')}-K{K}-{correction}-seed{seed}"
                metrics = run(args.out / name, 2, "grpo_async.py", [
                    "--task", task, *task_flags, "--steps", str(steps_per_run), "--eval-every", str(eval_every),
                    "--save-every", "0", "--max-staleness", str(K), "--rollout-correction", correction,
                    "--seed", str(seed)])
                steps = [m for m in metrics if "time/step" in m]
                per_seed.append({**bench.run_stats(metrics, target), "staleness": mean(steps, "async/staleness_mean"),
                                 "logprob_gap": mean(steps, "async/logprob_gap"),
                                 "truncated_frac": mean(steps, "rollout/is_truncated_frac") or 0.0})
            agg = {**bench.aggregate(per_seed), **{k: bench.mean_std(r[k] for r in per_seed)
                                                   for k in ("staleness", "logprob_gap", "truncated_frac")}}
            label = f"K={K}" + ("" if K == 0 else " truncate" if correction == "auto" else " off")
            curves[label] = agg["curves"]
            results[f"{task} K={K} {correction}"] = {
                "label": label, "aggregate": agg, "per_seed": [{k: v for k, v in r.items() if k != "curves"}
                                                               for r in per_seed]}
            reached = agg["steps_to_target"]
            rows.append([f"`{task}`", K, "token-truncate" if K and correction == "auto" else "off",
                         fmt_mean_std(agg["accuracy_end"]["mean"], agg["accuracy_end"]["std"], 3),
                         f"{reached['mean']:.1f} ({reached['reached']}/{reached['seeds']})" if reached["reached"]
                         else "not reached",
                         fmt(agg["train_time_s"]["mean"], 1), fmt(agg["staleness"]["mean"], 2),
                         fmt(agg["logprob_gap"]["mean"], 3), fmt(agg["truncated_frac"]["mean"], 3)])
        if args.json:  # accuracy and reward against step (x SAMPLES_PER_STEP samples) and training seconds
            plot = args.json.with_suffix(".png") if len(args.tasks) == 1 else \
                args.json.with_name(f"{args.json.stem}_{task.replace(':', '_')}.png")
            bench.plot_curves(curves, plot, f"grpo_async.py on {task}, 1 rollout + 1 trainer rank "
                              f"({SAMPLES_PER_STEP} samples a step; mean and min-max over seeds {args.seeds})", target)
            results[f"{task} plot"] = str(plot.relative_to(ROOT) if plot.is_relative_to(ROOT) else plot)
    targets = ", ".join(f"{task} {TASKS[task][2]}" for task in args.tasks)
    table = markdown_table(["task", "K", "correction", "held-out accuracy", f"steps to target ({targets}; seeds)",
                            "train seconds", "staleness", "log-prob gap", "tokens truncated"], rows)
    return results, table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["throughput", "learning"], required=True)
    p.add_argument("--job", choices=sorted(JOBS), default="tiny", help="throughput's work a step")
    p.add_argument("--steps", type=int, default=8, help="throughput's steps a run (the first is left out)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="learning's --max-staleness values")
    p.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "async_overlap", help="the runs' folder")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    env = environment()
    results, table = throughput(args) if args.part == "throughput" else learning(args)
    print("\n" + provenance_md(env) + "\n" + table, flush=True)
    if args.json:
        write_json(args.json, {"environment": env, "results": results, "table": table})


if __name__ == "__main__":
    main()
