"""Run the six algorithm scripts side by side on one task, with the same budget and seeds,
and summarise their metrics.jsonl files: a markdown table, learning curves, and where
each step's time goes.

    python benchmarks/compare.py --mode quick     # a few minutes: every script, 1 seed, 2 steps
    python benchmarks/compare.py --mode full      # 3 seeds x 30 steps of the scripts' default batch

Every configuration runs on the scripts' default task (sort, reward 0/1); the policy-gradient
lecture's four estimators (REINFORCE without / with a batch-mean baseline, RLOO, GRPO) also
run on sort-partial (partial credit) with the same budget and seeds (--lecture-tasks,
--lecture-estimators; quick mode runs only REINFORCE without a baseline there).

Each run is a plain subprocess `python <script>.py --seed S --steps N ... --output-dir
<out>/runs/<name>/seed<S>` (<out>/runs/<task>/<name>/seed<S> for the lecture's other tasks);
the scripts stay standalone. A run whose folder already holds
the outputs of the same command is reused (an interrupted benchmark loses nothing; --force
reruns). Writes to <out>/ (default benchmarks/results/<mode>/):

    table.md            held-out accuracy, steps / time to the target, steps/s, tokens/s, memory
    time_breakdown.md   share of rollout / log-probs / update / weight sync per step, sync cost
    curves.png          accuracy and mean reward against step and against training time
    time_breakdown.png  the shares as stacked bars
    compare.json        every number above, per seed and aggregated (the lecture's other tasks under
                        "lecture_tasks"; run.py turns them into lecture.md / lecture.png)
    runs/               each run's metrics.jsonl, summary.json, args.json (and its console log)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from benchmarks.util import ROOT, environment, fmt, fmt_mean_std, markdown_table, provenance_md, write_json  # noqa: E402


@dataclass(frozen=True)
class Config:
    """One line in the comparison: a script plus the flags that make this variant."""
    name: str          # folder name and key in the JSON
    label: str         # what tables and legends show
    script: str
    flags: tuple[str, ...] = ()


# the six algorithms, each with its own default hyperparameters (reinforce's baseline spelled out)
ALGORITHMS = [
    Config("reinforce", "REINFORCE", "reinforce.py", ("--baseline", "batch-mean")),
    Config("rloo", "RLOO", "rloo.py"),
    Config("ppo", "PPO", "ppo.py"),
    Config("grpo", "GRPO", "grpo.py"),
    Config("gspo", "GSPO", "gspo.py"),
    Config("cispo", "CISPO", "cispo.py"),
]
# the policy-gradient lecture's comparison: the same estimator with better and better baselines
NO_BASELINE = Config("reinforce-no-baseline", "REINFORCE, no baseline", "reinforce.py", ("--baseline", "none"))
LECTURE = [
    (NO_BASELINE, "REINFORCE, no baseline"),
    (ALGORITHMS[0], "REINFORCE, batch-mean baseline"),
    (ALGORITHMS[1], "RLOO, leave-one-out baseline"),
    (ALGORITHMS[3], "GRPO, group mean / std"),
]
ALL_CONFIGS = ALGORITHMS + [NO_BASELINE]
DEFAULT_TASK = "sort"  # the scripts' default task: the one every configuration above runs on
# the lecture's four estimators run on these tasks too (the same budget and seeds): sort-partial
# gives partial credit, never negative, so without a baseline every sample is reinforced
LECTURE_TASKS = ["sort-partial"]


def lecture_configs(task: str, names: list[str] | None = None) -> list[tuple[Config, str]]:
    """The lecture's estimators (or those in `names`) on another task: the script's own
    `--task` flag added, runs in runs/<task>/<name>/seed<S>."""
    return [(Config(f"{task}/{c.name}", label, c.script, (*c.flags, "--task", task)), label)
            for c, label in LECTURE if names is None or c.name in names]


# budgets: the same for every script; flags every script takes.
# lecture_tasks: the extra tasks of the lecture's comparison; lecture_estimators: which of its four
# estimators run there (None: all; quick mode runs one, only to check that the path works)
MODES = {
    "quick": dict(seeds=[0], steps=2, prompts_per_step=8, completions_per_prompt=4, eval_every=1, jobs=2,
                  lecture_tasks=LECTURE_TASKS, lecture_estimators=["reinforce-no-baseline"]),
    "full": dict(seeds=[0, 1, 2], steps=30, prompts_per_step=32, completions_per_prompt=8, eval_every=2, jobs=1,
                 lecture_tasks=LECTURE_TASKS, lecture_estimators=None),
}
TIME_PARTS = ["rollout", "logprobs", "train", "sync"]
TIME_PART_LABELS = {"rollout": "rollout (vLLM)", "logprobs": "old/ref log-probs", "train": "update",
                    "sync": "weight sync", "other": "other (reward, advantages, logging)"}


# ---------------------------------------------------------------------------------------
# running the scripts
# ---------------------------------------------------------------------------------------

@dataclass
class Run:
    config: Config
    seed: int
    out_dir: Path
    budget: list[str]
    extra: list[str] = field(default_factory=list)

    @property
    def args(self) -> list[str]:
        """The script and its flags (the output folder is part of the command)."""
        return [self.config.script, "--seed", str(self.seed), *self.budget, *self.config.flags, *self.extra,
                "--output-dir", str(self.out_dir)]

    @property
    def title(self) -> str:
        return f"{self.config.name} seed {self.seed}"

    def done(self) -> bool:
        """The same command already finished here: its outputs are reused."""
        marker = self.out_dir / "benchmark_run.json"
        if not (marker.exists() and (self.out_dir / "summary.json").exists()):
            return False
        try:
            return json.loads(marker.read_text())["args"] == self.args
        except (ValueError, KeyError):
            return False


def budget_flags(steps: int, prompts_per_step: int, completions_per_prompt: int, eval_every: int) -> list[str]:
    return ["--steps", str(steps), "--prompts-per-step", str(prompts_per_step),
            "--completions-per-prompt", str(completions_per_prompt), "--eval-every", str(eval_every),
            "--save-every", "0"]


class _OutputTail(threading.Thread):
    """Copies a child's output to its log file and keeps its latest line (tqdm rewrites one
    line with carriage returns) for the progress display."""

    def __init__(self, stream, log_path: Path):
        super().__init__(daemon=True)
        self.stream, self.log_path = stream, log_path
        self.last = ""
        self.lines: deque[str] = deque(maxlen=25)

    def run(self):
        buffer = b""
        with open(self.log_path, "wb") as log:
            while chunk := os.read(self.stream.fileno(), 65536):
                log.write(chunk)
                log.flush()
                parts = re.split(rb"[\r\n]", buffer + chunk)
                buffer = parts.pop()
                for part in parts:
                    text = part.decode(errors="replace").strip()
                    if text:
                        self.last = text
                        self.lines.append(text)
        if buffer.strip():
            self.lines.append(buffer.decode(errors="replace").strip())


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def run_all(runs: list[Run], jobs: int = 1, force: bool = False, keep_models: bool = False,
            print_every: float = 20.0) -> dict[tuple[str, int], dict]:
    """Run every script that has not run yet, `jobs` at a time, showing progress.

    Returns {(config name, seed): {"status": "ok" | "reused" | "failed" | "missing", ...}}."""
    status: dict[tuple[str, int], dict] = {}
    todo = []
    for i, run in enumerate(runs, 1):
        key = (run.config.name, run.seed)
        if not (ROOT / run.config.script).exists():
            status[key] = {"status": "missing"}
            print(f"[{i}/{len(runs)}] {run.title}: skipped, {run.config.script} does not exist (yet)", flush=True)
        elif run.done() and not force:
            status[key] = {"status": "reused", **json.loads((run.out_dir / "benchmark_run.json").read_text())}
            print(f"[{i}/{len(runs)}] {run.title}: reused {_rel(run.out_dir)}", flush=True)
        else:
            todo.append((i, run))
    if not todo:
        return status

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if jobs > 1:  # share the cores instead of oversubscribing them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    tty, total = sys.stdout.isatty(), len(todo)
    t0, last_print = time.perf_counter(), 0.0
    active: list[tuple[int, Run, subprocess.Popen, _OutputTail, float]] = []
    finished = 0

    def show(force_line: bool = False):
        nonlocal last_print
        now = time.perf_counter()
        parts = [f"{run.config.name}/s{run.seed}: {tail.last[-70:]}" for _, run, _, tail, _ in active]
        line = f"[{finished}/{total} done, {_clock(now - t0)}] " + " | ".join(parts)
        if tty:
            width = shutil.get_terminal_size().columns
            print("\r" + line[:width - 1].ljust(width - 1), end="", flush=True)
        elif force_line or now - last_print >= print_every:
            print(line, flush=True)
            last_print = now

    try:
        while todo or active:
            while todo and len(active) < jobs:
                i, run = todo.pop(0)
                if run.out_dir.exists():
                    shutil.rmtree(run.out_dir)  # a stale or different run: start clean
                run.out_dir.mkdir(parents=True)
                if tty:
                    print()
                print(f"[{i}/{len(runs)}] {run.title}: python {' '.join(run.args)}", flush=True)
                proc = subprocess.Popen([sys.executable, *run.args], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                tail = _OutputTail(proc.stdout, run.out_dir / "console.log")
                tail.start()
                active.append((i, run, proc, tail, time.perf_counter()))
            time.sleep(0.5)
            for item in list(active):
                i, run, proc, tail, started = item
                if proc.poll() is None:
                    continue
                tail.join()
                active.remove(item)
                finished += 1
                wall = time.perf_counter() - started
                key = (run.config.name, run.seed)
                if tty:
                    print()
                if proc.returncode == 0 and (run.out_dir / "summary.json").exists():
                    record = {"args": run.args, "returncode": 0, "process_wall_s": wall}
                    write_json(run.out_dir / "benchmark_run.json", record)
                    if not keep_models:
                        shutil.rmtree(run.out_dir / "final", ignore_errors=True)
                        shutil.rmtree(run.out_dir / "checkpoints", ignore_errors=True)
                    status[key] = {"status": "ok", **record}
                    summary = json.loads((run.out_dir / "summary.json").read_text())
                    print(f"[{i}/{len(runs)}] {run.title}: done in {wall:.0f} s, held-out accuracy "
                          f"{summary.get('eval/accuracy_start')} -> {summary.get('eval/accuracy_end')}", flush=True)
                else:
                    status[key] = {"status": "failed", "args": run.args, "returncode": proc.returncode}
                    print(f"[{i}/{len(runs)}] {run.title}: FAILED (exit code {proc.returncode}); last lines of "
                          f"{run.out_dir / 'console.log'}:\n    " + "\n    ".join(tail.lines), flush=True)
            show()
    except KeyboardInterrupt:
        for _, run, proc, _, _ in active:
            proc.kill()
        print("\ninterrupted; the same command continues where this stopped (finished runs are reused)",
              flush=True)
        raise
    if tty:
        print()
    return status


# ---------------------------------------------------------------------------------------
# aggregation: per run, then over seeds
# ---------------------------------------------------------------------------------------

def read_metrics(run_dir) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda m: m["step"])


def run_stats(metrics: list[dict], target: float) -> dict:
    """The numbers of one run. Training time is the sum of time/step (rollout, log-probs,
    update, sync and bookkeeping), without the held-out evaluations and the start-up."""
    steps = [m for m in metrics if m["step"] > 0 and "time/step" in m]
    elapsed, t = {0: 0.0}, 0.0
    for m in steps:
        t += m["time/step"]
        elapsed[m["step"]] = t
    evals = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    eval_rewards = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
    reached = next((s for s, a in evals if a >= target), None)
    tokens = sum(m["throughput/tokens_per_s"] * m["time/step"] for m in steps if "throughput/tokens_per_s" in m)
    shares = {k: sum(m.get(f"time/{k}", 0.0) for m in steps) / t if t > 0 else None for k in TIME_PARTS}
    shares["other"] = 1.0 - sum(shares.values()) if t > 0 else None
    syncs = [m["time/sync"] for m in steps if "time/sync" in m]
    memory = [m["memory/peak_gib"] for m in metrics if "memory/peak_gib" in m]
    return {
        "accuracy_start": evals[0][1] if evals and evals[0][0] == 0 else None,
        "accuracy_end": evals[-1][1] if evals else None,
        "accuracy_peak": max(a for _, a in evals) if evals else None,
        "eval_reward_end": eval_rewards[-1] if eval_rewards else None,  # held-out mean reward (greedy)
        "steps_to_target": reached,
        "time_to_target_s": elapsed.get(reached) if reached is not None else None,
        "steps": len(steps),
        "train_time_s": t,
        "steps_per_s": len(steps) / t if t > 0 else None,
        "tokens_per_s": tokens / t if t > 0 else None,
        "peak_memory_gib": max(memory) if memory else None,
        "step_ms": 1000 * t / len(steps) if steps else None,
        "time_share": shares,
        "sync_ms_median": 1000 * statistics.median(syncs) if syncs else None,
        "curves": {
            "eval_step": [s for s, _ in evals],
            "eval_time_s": [elapsed.get(s) for s, _ in evals],
            "eval_accuracy": [a for _, a in evals],
            "step": [m["step"] for m in steps],
            "time_s": [elapsed[m["step"]] for m in steps],
            "reward_mean": [m.get("reward/mean") for m in steps],
        },
    }


def mean_std(values) -> dict:
    """Mean and sample standard deviation (ddof 1) over seeds; None where undefined."""
    vals = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals)}


SCALARS = ["accuracy_start", "accuracy_end", "accuracy_peak", "eval_reward_end", "train_time_s", "steps_per_s",
           "tokens_per_s", "peak_memory_gib", "step_ms", "sync_ms_median"]


def _band(per_seed: list[dict], x_key: str, y_key: str, step_key: str) -> dict:
    """Mean and min / max over seeds at the steps every seed has; x is the mean over seeds."""
    common = set.intersection(*(set(c[step_key]) for c in per_seed))
    out = {"step": [], "x": [], "mean": [], "min": [], "max": []}
    for s in sorted(common):
        xs, ys = [], []
        for c in per_seed:
            j = c[step_key].index(s)
            xs.append(c[x_key][j])
            ys.append(c[y_key][j])
        if any(v is None for v in xs + ys):
            continue
        out["step"].append(s)
        out["x"].append(statistics.fmean(xs))
        out["mean"].append(statistics.fmean(ys))
        out["min"].append(min(ys))
        out["max"].append(max(ys))
    return out


def aggregate(per_seed: list[dict]) -> dict:
    """Over seeds: mean / std of each number, how many seeds reached the target, and the
    curves (mean with a min-max band)."""
    agg = {k: mean_std(r[k] for r in per_seed) for k in SCALARS}
    reached = [r for r in per_seed if r["steps_to_target"] is not None]
    agg["steps_to_target"] = {**mean_std(r["steps_to_target"] for r in reached), "reached": len(reached),
                              "seeds": len(per_seed)}
    agg["time_to_target_s"] = {**mean_std(r["time_to_target_s"] for r in reached), "reached": len(reached),
                               "seeds": len(per_seed)}
    agg["time_share"] = {k: mean_std(r["time_share"][k] for r in per_seed)["mean"]
                         for k in per_seed[0]["time_share"]}
    curves = [r["curves"] for r in per_seed]
    agg["curves"] = {
        "accuracy_vs_step": _band(curves, "eval_step", "eval_accuracy", "eval_step"),
        "accuracy_vs_time": _band(curves, "eval_time_s", "eval_accuracy", "eval_step"),
        "reward_vs_step": _band(curves, "step", "reward_mean", "step"),
        "reward_vs_time": _band(curves, "time_s", "reward_mean", "step"),
    }
    return agg


def _to_target(entry: dict, digits: int) -> str:
    if not entry["reached"]:
        return "not reached"
    text = fmt_mean_std(entry["mean"], entry["std"], digits)
    return text if entry["reached"] == entry["seeds"] else f"{text} ({entry['reached']}/{entry['seeds']} seeds)"


def comparison_table(results: dict, target: float) -> str:
    header = ["algorithm", "flags", "seeds", "held-out acc. start", "end", "peak", f"steps to {target:g}",
              f"train time to {target:g} (s)", "steps/s", "tokens/s", "peak mem. (GiB)"]
    rows = []
    for name, r in results.items():
        a = r.get("aggregate")
        if a is None:
            rows.append([r["label"], f"`{' '.join(r['flags'])}`" if r["flags"] else "", 0,
                         r["status"]] + ["-"] * (len(header) - 4))
            continue
        rows.append([
            r["label"], f"`{' '.join(r['flags'])}`" if r["flags"] else "", len(r["seeds"]),
            fmt_mean_std(a["accuracy_start"]["mean"], a["accuracy_start"]["std"]),
            fmt_mean_std(a["accuracy_end"]["mean"], a["accuracy_end"]["std"]),
            fmt_mean_std(a["accuracy_peak"]["mean"], a["accuracy_peak"]["std"]),
            _to_target(a["steps_to_target"], 1), _to_target(a["time_to_target_s"], 1),
            fmt_mean_std(a["steps_per_s"]["mean"], a["steps_per_s"]["std"]),
            fmt_mean_std(a["tokens_per_s"]["mean"], a["tokens_per_s"]["std"], 0),
            fmt(a["peak_memory_gib"]["mean"]),
        ])
    return markdown_table(header, rows, ["l", "l"] + ["r"] * (len(header) - 2))


def time_table(results: dict) -> str:
    parts = TIME_PARTS + ["other"]
    header = ["algorithm", "step (ms)"] + [TIME_PART_LABELS[p] for p in parts] + ["one weight sync (ms, median)"]
    rows = []
    for r in results.values():
        a = r.get("aggregate")
        if a is None:
            continue
        rows.append([r["label"], fmt(a["step_ms"]["mean"], 0)]
                    + [f"{100 * a['time_share'][p]:.1f}%" if a["time_share"][p] is not None else "-" for p in parts]
                    + [fmt(a["sync_ms_median"]["mean"], 1)])
    return markdown_table(header, rows)


# ---------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PANELS = [("accuracy_vs_step", "held-out greedy accuracy", "step"),
          ("accuracy_vs_time", "held-out greedy accuracy", "training time (s, mean over seeds)"),
          ("reward_vs_step", "mean reward of the rollouts", "step"),
          ("reward_vs_time", "mean reward of the rollouts", "training time (s, mean over seeds)")]


def draw_panel(ax, curves: dict[str, dict], key: str, ylabel: str, xlabel: str, target: float | None = None,
               color_of: dict[str, tuple] | None = None):
    """Mean line and min-max band of each algorithm's curve `key`; returns the line labels.
    Colors: color_of[label] where given, else tab10 in the order of `curves`."""
    from matplotlib.ticker import MaxNLocator

    colors = _pyplot().get_cmap("tab10").colors
    for i, (label, c) in enumerate(curves.items()):
        band = c[key]
        if not band["x"]:
            continue
        color = (color_of or {}).get(label, colors[i % len(colors)])
        ax.plot(band["x"], band["mean"], label=label, color=color, lw=1.8,
                marker="o" if len(band["x"]) <= 12 else None, ms=3)
        if band["max"] != band["min"]:
            ax.fill_between(band["x"], band["min"], band["max"], color=color, alpha=0.15, lw=0)
    if target is not None and "accuracy" in key:
        ax.axhline(target, color="grey", ls=":", lw=1)
    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def plot_curves(curves: dict[str, dict], path, title: str, panels=PANELS, ncols: int = 2,
                target: float | None = None) -> dict:
    """One line per algorithm (mean over seeds) with a min-max band over seeds, one panel
    per (metric, x axis). Returns the labels of the lines drawn in each panel."""
    plt = _pyplot()
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.4 * nrows + 0.6), squeeze=False)
    drawn = [draw_panel(ax, curves, *panel, target=target) for ax, panel in zip(axes.flat, panels)]
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07 if nrows > 1 else 0.12, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"panels": [p[0] for p in panels], "lines": drawn}


def plot_time_breakdown(results: dict, path) -> dict:
    """Stacked horizontal bars: the share of each part of a training step, per algorithm."""
    plt = _pyplot()
    names = [n for n, r in results.items() if r.get("aggregate")]
    parts = TIME_PARTS + ["other"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.9))
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(names)
    for j, part in enumerate(parts):
        widths = [100 * (results[n]["aggregate"]["time_share"][part] or 0.0) for n in names]
        ax.barh(range(len(names)), widths, left=left, color=colors[j], label=TIME_PART_LABELS[part])
        left = [l + w for l, w in zip(left, widths)]
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{results[n]['label']} ({results[n]['aggregate']['step_ms']['mean']:.0f} ms/step)"
                        for n in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of training-step time (%)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"bars": [results[n]["label"] for n in names]}


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------

def collect(configs: list[Config], seeds: list[int], runs_dir: Path, status: dict, target: float) -> dict:
    results = {}
    for cfg in configs:
        entry = {"label": cfg.label, "script": cfg.script, "flags": list(cfg.flags), "seeds": [], "per_seed": {}}
        states = [status.get((cfg.name, s), {}).get("status", "ok") for s in seeds]
        for seed in seeds:
            run_dir = runs_dir / cfg.name / f"seed{seed}"
            if (run_dir / "summary.json").exists() and (run_dir / "metrics.jsonl").exists():
                entry["per_seed"][seed] = run_stats(read_metrics(run_dir), target)
                entry["seeds"].append(seed)
        entry["status"] = ("missing" if "missing" in states else "failed" if not entry["seeds"] else
                           "ok" if len(entry["seeds"]) == len(seeds) else "partial")
        if entry["seeds"]:
            entry["aggregate"] = aggregate(list(entry["per_seed"].values()))
        results[cfg.name] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="quick", help="budget preset (the flags below override it)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<mode>)")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--completions-per-prompt", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--jobs", type=int, help="scripts run at once (timings are cleanest with 1)")
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy for 'steps / time to target'")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="a subset of: " + ", ".join(c.name for c in ALL_CONFIGS) + " (on every task)")
    p.add_argument("--lecture-tasks", nargs="*", metavar="TASK",
                   help=f"tasks the lecture's four estimators also run on (default {' '.join(LECTURE_TASKS)}; "
                        f"none: just the flag)")
    p.add_argument("--lecture-estimators", nargs="+", metavar="NAME", choices=[c.name for c, _ in LECTURE],
                   help="which of the lecture's estimators run on those tasks (default: the mode's)")
    p.add_argument("--script-flags", default="", help="extra flags for every script, e.g. '--model PATH'")
    p.add_argument("--force", action="store_true", help="rerun runs whose outputs already exist")
    p.add_argument("--keep-models", action="store_true", help="keep each run's final/ model folder")
    args = p.parse_args(argv)
    settings = {**MODES[args.mode]}
    for k in settings:
        if getattr(args, k, None) is not None:
            settings[k] = getattr(args, k)
    out = args.out or ROOT / "benchmarks" / "results" / args.mode
    result = compare(out, settings, args.target, args.only, args.script_flags.split(), args.force, args.keep_models)
    every = [*result["algorithms"].values(), *(r for o in result["lecture_tasks"].values()
                                                for r in o["algorithms"].values())]
    return 0 if all(r["status"] in ("ok", "missing") for r in every) else 1


def compare(out: Path, settings: dict, target: float = 0.8, only: list[str] | None = None,
            script_flags: list[str] | None = None, force: bool = False, keep_models: bool = False,
            env: dict | None = None) -> dict:
    """Run (or reuse) every run and write the tables, plots and compare.json to `out`."""
    out = Path(out).resolve()
    configs = [c for c in ALL_CONFIGS if not only or c.name in only]
    unknown = set(only or []) - {c.name for c in ALL_CONFIGS}
    if unknown:
        raise SystemExit(f"error: unknown run name(s) {sorted(unknown)}; known: {[c.name for c in ALL_CONFIGS]}")
    # the lecture's estimators on the other tasks (runs/<task>/<name>/seed<S>)
    names = settings.get("lecture_estimators")
    names = [n for n in (names or [c.name for c, _ in LECTURE]) if not only or n in only]
    lecture_tasks = {t: lecture_configs(t, names) for t in settings.get("lecture_tasks") or [] if t != DEFAULT_TASK}
    lecture_tasks = {t: pairs for t, pairs in lecture_tasks.items() if pairs}
    extra = [c for pairs in lecture_tasks.values() for c, _ in pairs]
    budget = budget_flags(settings["steps"], settings["prompts_per_step"], settings["completions_per_prompt"],
                          settings["eval_every"])
    runs_dir = out / "runs"
    runs = [Run(c, s, runs_dir / c.name / f"seed{s}", budget, list(script_flags or [])) for c in configs + extra
            for s in settings["seeds"]]
    env = env or environment()
    also = "".join(f", + {len(pairs)} lecture estimator(s) on {t}" for t, pairs in lecture_tasks.items())
    print(f"compare: {len(runs)} runs ({len(configs)} configurations on {DEFAULT_TASK}{also}; "
          f"x {len(settings['seeds'])} seeds), {settings['jobs']} at a time, budget: {' '.join(budget)} -> {out}",
          flush=True)
    t0 = time.perf_counter()
    status = run_all(runs, jobs=settings["jobs"], force=force, keep_models=keep_models)
    elapsed = time.perf_counter() - t0

    results = collect(configs, settings["seeds"], runs_dir, status, target)
    other_tasks = {t: {"algorithms": collect([c for c, _ in pairs], settings["seeds"], runs_dir, status, target),
                       "lecture": [[c.name, label] for c, label in pairs]} for t, pairs in lecture_tasks.items()}
    main_names = [c.name for c in ALGORITHMS if c.name in results]
    main_results = {n: results[n] for n in main_names}
    plots = {}
    curves = {r["label"]: r["aggregate"]["curves"] for r in main_results.values() if r.get("aggregate")}
    band = "band: min-max over seeds" if len(settings["seeds"]) > 1 else "one seed"
    title = (f"{len(curves)} algorithms, {settings['steps']} steps of {settings['prompts_per_step']} prompts x "
             f"{settings['completions_per_prompt']} completions, seeds {settings['seeds']} ({band})")
    if curves:
        plots["curves.png"] = plot_curves(curves, out / "curves.png", title, target=target)
        plots["time_breakdown.png"] = plot_time_breakdown(main_results, out / "time_breakdown.png")
    table = comparison_table(main_results, target)
    times = time_table(main_results)
    budget_md = (f"Budget, the same for every script: `{' '.join(budget)}`, seeds {settings['seeds']}; "
                 f"every other hyperparameter is the script's default. Mean ± std over seeds. Training time is the "
                 f"sum of the steps' times (no start-up, no held-out evaluation); 'steps to {target:g}' is the first "
                 f"evaluated step (every {settings['eval_every']}) with held-out greedy accuracy >= {target:g}.\n")
    times_md = (f"{times}\nShare of the summed step time (`time/<part>` / `time/step` in metrics.jsonl), mean over "
                f"seeds; 'other' is the untimed rest of a step (reward, advantages, metrics). One weight sync is the "
                f"median `time/sync`, mean over seeds.\n")
    (out / "table.md").write_text(f"{table}\n{budget_md}\n{provenance_md(env)}")
    (out / "time_breakdown.md").write_text(f"{times_md}\n{provenance_md(env)}")
    data = {"environment": env, "settings": {**settings, "target": target, "budget_flags": budget,
                                             "script_flags": list(script_flags or [])},
            "elapsed_s": elapsed, "task": DEFAULT_TASK, "algorithms": results, "main": main_names,
            # process time of every run, also of runs reused from an earlier invocation
            "runs_process_s": sum(v.get("process_wall_s", 0.0) for v in status.values()),
            "runs_reused": sum(v["status"] == "reused" for v in status.values()),
            "lecture": [[c.name, label] for c, label in LECTURE if c.name in results],
            # the lecture's estimators on the other tasks: {task: {"algorithms": ..., "lecture": ...}}
            "lecture_tasks": other_tasks, "plots": plots,
            "markdown": {"table": f"{table}\n{budget_md}", "time_breakdown": times_md}}
    write_json(out / "compare.json", data)
    print(f"\n{table}\n{times}\nwrote {out / 'table.md'}, {out / 'time_breakdown.md'}, {out / 'curves.png'}, "
          f"{out / 'compare.json'} ({_clock(elapsed)} of runs)", flush=True)
    for name, r in [*results.items(), *((n, r) for o in other_tasks.values() for n, r in o["algorithms"].items())]:
        if r["status"] not in ("ok",):
            print(f"note: {name}: {r['status']}", flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main())
