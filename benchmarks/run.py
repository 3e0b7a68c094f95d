"""All benchmarks in one command, on the bundled tiny model and the default task `sort`:

1. the algorithm scripts (every one common/scripts.py finds) side by side, with the same budget
   and seeds, each a plain `python <script>.py ...` subprocess: held-out accuracy, speed,
   memory, where a step's time goes;
2. the policy-gradient lecture's claim (a baseline keeps the expected gradient and lowers its
   variance): REINFORCE without / with the batch-mean baseline, RLOO and GRPO learning on `sort`
   (0/1 reward) and `sort-partial` (partial credit), and their gradient variance on fixed batches
   (gradient_variance.py);
3. the rollout engine: vLLM as the scripts create it against transformers `generate`
   (rollout_engines.py), on the tiny model and, in full mode, SmolLM2-135M-Instruct.

    python benchmarks/run.py --mode quick                    # every part, smallest settings: a few minutes
    python benchmarks/run.py --mode full --update-readme     # the committed results: ~30-35 min
    python benchmarks/run.py --mode full --report-only       # tables and plots again from results.json
    python benchmarks/run.py --mode hard --only sapo         # one algorithm's rows, merged into results.json

Writes to benchmarks/results/<mode>/ (or --out): results.json (every number, with where, when
and how it was measured), report.md (every table), curves.png, time_breakdown.png, lecture.png,
and runs/ (each run's folder and log, each part's JSON: scratch, not committed). The same
command again reuses the runs and parts that finished (--force reruns them). --update-readme
puts report.md between the `<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->` lines of
benchmarks/README.md, so that no number there is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from common import scripts  # noqa: E402
from common.args import vllm_installed  # noqa: E402
from benchmarks.util import (ROOT, environment, fmt, fmt_mean_std, markdown_table,  # noqa: E402
                             provenance_md, write_json)


@dataclass(frozen=True)
class Config:
    """One line in the comparison: a script plus the flags that make this variant."""
    name: str          # its folder under runs/ and its key in results.json
    label: str         # what tables and legends show
    script: str
    flags: tuple[str, ...] = ()


# every algorithm script, found (not listed), each with its own default hyperparameters
ALGORITHMS = [Config(s.removesuffix(".py"), scripts.label(s), s) for s in scripts.algorithm_scripts()]
BY_NAME = {c.name: c for c in ALGORITHMS}
NO_BASELINE = Config("reinforce-no-baseline", "REINFORCE, no baseline", "reinforce.py", ("--baseline", "none"))
# The lecture's four estimators, each with the gradient_variance.py estimator of the same advantage.
# On `sort` they are the comparison's runs; on LECTURE_TASK (partial credit, never negative: without
# a baseline every sample is reinforced, the lecture's setting) they run again with `--task`.
LECTURE = [(NO_BASELINE, "none"), (BY_NAME["reinforce"], "batch-mean"), (BY_NAME["rloo"], "rloo"),
           (BY_NAME["grpo"], "grpo")]
TASK, LECTURE_TASK = "sort", "sort-partial"
MODEL = "models/tiny-sort"  # the bundled tiny model, trained on TASK
TASK_NOTES = {"sort": "`sort`: reward 1 for the exact sorted digits, else 0",
              "sort-partial": "`sort-partial`: the same prompts and splits, reward = the fraction of positions "
                              "holding the right digit over the longer of completion and answer, 1 only for "
                              "the exact answer, never negative"}
# gradient_variance.py's estimators: in tables, in sentences, on the bars of lecture.png
LABEL = {"none": "REINFORCE, no baseline", "batch-mean": "REINFORCE, batch-mean baseline",
         "rloo": "RLOO, leave-one-out baseline", "grpo": "GRPO, group mean / std",
         "dr-grpo": "Dr. GRPO, R - group mean"}
NAMED = {"none": "REINFORCE without a baseline", "batch-mean": "REINFORCE with the batch-mean baseline",
         "rloo": "RLOO", "grpo": "GRPO"}
SHORT = {"batch-mean": "batch mean", "rloo": "RLOO", "grpo": "GRPO", "dr-grpo": "Dr. GRPO"}

# budgets: the same for every script, flags every script takes; the parts' own flags
MODES = {
    "quick": dict(seeds=[0], steps=2, prompts_per_step=8, completions_per_prompt=4, eval_every=1, jobs=2,
                  lecture_estimators=["none"],  # on sort-partial only to check the path: a shorter test
                  engines=["--sizes", "8x4", "--repeats", "2"],
                  variance=["--prompts", "4", "--completions", "4", "--batches", "4", "--score-norm-batches", "1"]),
    "full": dict(seeds=[0, 1, 2], steps=30, prompts_per_step=32, completions_per_prompt=8, eval_every=2, jobs=1,
                 lecture_estimators=["none", "batch-mean", "rloo", "grpo"],
                 engines=["--sizes", "32x8", "128x8", "--repeats", "5"],
                 variance=["--prompts", "8", "--completions", "8", "--batches", "64", "--score-norm-batches", "2"],
                 # the same engine comparison on a real 135M instruct model with longer completions
                 engines_smollm2=["--model", "smollm2-135m-instruct", "--task", "basic_arithmetic", "--sizes", "8x4",
                                  "32x4", "--max-new-tokens", "64", "--repeats", "3"]),
    # a task on which the algorithms need many steps and differ: sorting 9 to 11 digits, longer lists
    # than any of the tiny model's demonstrations (3 to 8); only the comparison runs. 16 new tokens: the
    # longest answer (11 digits and EOS) stays clear of dapo.py's overlong penalty (its last 3 tokens)
    "hard": dict(seeds=[0, 1, 2], steps=100, prompts_per_step=32, completions_per_prompt=8, eval_every=5,
                 jobs=2, task="sort:9-11", max_new_tokens=16, target=0.5),
}
TARGET = 0.8  # held-out accuracy for "steps / time to target"
TIME_PARTS = ["rollout", "logprobs", "train", "sync"]
TIME_LABELS = {"rollout": "rollout (vLLM)", "logprobs": "old/ref log-probs", "train": "update",
               "sync": "weight sync", "other": "other (reward, advantages, logging)"}
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"  # full mode's; another mode's: markers()


def markers(mode: str = "full") -> tuple[str, str]:
    """The README block of a mode's report: full mode keeps the original markers."""
    return (BEGIN, END) if mode == "full" else (f"<!-- benchmarks:{mode}:begin -->", f"<!-- benchmarks:{mode}:end -->")


# ---------------------------------------------------------------------------------------
# running: the scripts (runs) and the two parts, each in its own process
# ---------------------------------------------------------------------------------------

def lecture_configs(estimators: list[str]) -> list[Config]:
    """The lecture's estimators on LECTURE_TASK: the script's own --task flag added."""
    return [Config(f"{LECTURE_TASK}/{c.name}", c.label, c.script, (*c.flags, "--task", LECTURE_TASK))
            for c, est in LECTURE if est in estimators]


def budget_flags(s: dict) -> list[str]:
    """The same for every script, model and task included: a script whose defaults are another
    model and task (grpo_multiturn.py's tiny-tool on multiply) runs here on the bundled sort."""
    return ["--model", MODEL, "--task", s.get("task", TASK), "--steps", str(s["steps"]),
            "--prompts-per-step", str(s["prompts_per_step"]),
            "--completions-per-prompt", str(s["completions_per_prompt"]), "--eval-every", str(s["eval_every"]),
            "--save-every", "0",
            *(["--max-new-tokens", str(s["max_new_tokens"])] if "max_new_tokens" in s else [])]


def _env(threads: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return {**env, "OMP_NUM_THREADS": str(threads)} if threads else env


def _tail(log: Path, lines: int = 25) -> str:
    return "    " + "\n    ".join(log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Run:
    """One script run: `python <cmd>`, writing to `folder`."""
    title: str
    folder: Path
    cmd: list[str]

    @property
    def log(self) -> Path:
        return self.folder.with_suffix(".log")  # beside the folder: the scripts refuse a non-empty one


def run_scripts(runs: list[Run], jobs: int, force: bool) -> dict[Path, dict]:
    """Run the scripts `jobs` at a time; returns {folder: record}. A run whose folder holds the
    outputs of the same command is reused, so that an interrupted benchmark continues."""
    records, todo = {}, []
    for i, run in enumerate(runs, 1):
        marker = run.folder / "benchmark_run.json"
        record = json.loads(marker.read_text()) if marker.exists() else {}
        if record.get("args") == run.cmd and not force:
            records[run.folder] = {**record, "reused": True}
            print(f"[{i}/{len(runs)}] {run.title}: reused", flush=True)
        else:
            todo.append((i, run))
    env = _env(max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None)  # share the cores, don't oversubscribe
    active = []  # (i, run, process, start time)
    try:
        while todo or active:
            while todo and len(active) < jobs:
                i, run = todo.pop(0)
                shutil.rmtree(run.folder, ignore_errors=True)  # a stale or different run: the script gets a new one
                run.folder.parent.mkdir(parents=True, exist_ok=True)
                print(f"[{i}/{len(runs)}] {run.title}: python {' '.join(run.cmd)}", flush=True)
                with open(run.log, "w") as log:
                    proc = subprocess.Popen([sys.executable, *run.cmd], cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)
                active.append((i, run, proc, time.perf_counter()))
            time.sleep(0.5)
            for item in [a for a in active if a[2].poll() is not None]:
                active.remove(item)
                i, run, proc, started = item
                if proc.returncode != 0 or not (run.folder / "summary.json").exists():
                    print(f"[{i}/{len(runs)}] {run.title}: FAILED (exit code {proc.returncode}); the end of "
                          f"{run.log}:\n{_tail(run.log)}", flush=True)
                    continue
                records[run.folder] = {"args": run.cmd, "process_wall_s": time.perf_counter() - started}
                write_json(run.folder / "benchmark_run.json", records[run.folder])
                shutil.rmtree(run.folder / "final", ignore_errors=True)  # models are not results
                summary = json.loads((run.folder / "summary.json").read_text())
                print(f"[{i}/{len(runs)}] {run.title}: done in {records[run.folder]['process_wall_s']:.0f} s, "
                      f"held-out accuracy {summary.get('eval/accuracy_start')} -> {summary.get('eval/accuracy_end')}",
                      flush=True)
    except KeyboardInterrupt:
        for _, _, proc, _ in active:
            proc.kill()
        print("\ninterrupted; the same command continues where this stopped (finished runs are reused)", flush=True)
        raise
    return records


def run_part(name: str, script: str, argv: list[str], runs_dir: Path, force: bool) -> dict | None:
    """rollout_engines.py or gradient_variance.py in its own process (vLLM and the scripts change
    process-wide settings); its JSON is reused when it was made by the same command."""
    path, log = runs_dir / f"{name}.json", runs_dir / f"{name}.log"
    argv = [*argv, "--json", str(path)]
    if path.exists() and not force and json.loads(path.read_text()).get("argv") == argv:
        print(f"{name}: reused", flush=True)
        return {**json.loads(path.read_text()), "reused": True}
    print(f"{name}: python benchmarks/{script} {' '.join(argv)}", flush=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], cwd=ROOT, env=_env(),
                              stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0 or not path.exists():
        print(f"{name}: FAILED (exit code {code}); the end of {log}:\n{_tail(log)}", flush=True)
        return None
    data = json.loads(path.read_text())
    print(f"{name}: done in {data['wall_s']:.0f} s", flush=True)
    return data


# ---------------------------------------------------------------------------------------
# aggregation: per run, then over seeds
# ---------------------------------------------------------------------------------------

def read_metrics(run_dir) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda m: m["step"])


def run_stats(metrics: list[dict], target: float = TARGET) -> dict:
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
        xs = [c[x_key][c[step_key].index(s)] for c in per_seed]
        ys = [c[y_key][c[step_key].index(s)] for c in per_seed]
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
    for k in ("steps_to_target", "time_to_target_s"):
        agg[k] = {**mean_std(r[k] for r in reached), "reached": len(reached), "seeds": len(per_seed)}
    agg["time_share"] = {k: mean_std(r["time_share"][k] for r in per_seed)["mean"] for k in per_seed[0]["time_share"]}
    curves = [r["curves"] for r in per_seed]
    agg["curves"] = {
        "accuracy_vs_step": _band(curves, "eval_step", "eval_accuracy", "eval_step"),
        "accuracy_vs_time": _band(curves, "eval_time_s", "eval_accuracy", "eval_step"),
        "reward_vs_step": _band(curves, "step", "reward_mean", "step"),
        "reward_vs_time": _band(curves, "time_s", "reward_mean", "step"),
    }
    return agg


def collect(configs: list[Config], seeds: list[int], runs_dir: Path, target: float = TARGET) -> dict:
    """{config name: its flags, per-seed numbers (the curves only aggregated: the plots show them)
    and aggregate} from the run folders."""
    results = {}
    for cfg in configs:
        per_seed = {}
        for seed in seeds:
            run_dir = runs_dir / cfg.name / f"seed{seed}"
            if (run_dir / "summary.json").exists() and (run_dir / "metrics.jsonl").exists():
                per_seed[seed] = run_stats(read_metrics(run_dir), target)
        entry = {"label": cfg.label, "script": cfg.script, "flags": list(cfg.flags), "seeds": list(per_seed),
                 "status": "ok" if len(per_seed) == len(seeds) else "partial" if per_seed else "failed",
                 "per_seed": {s: {k: v for k, v in r.items() if k != "curves"} for s, r in per_seed.items()}}
        if per_seed:
            entry["aggregate"] = aggregate(list(per_seed.values()))
        results[cfg.name] = entry
    return results


# ---------------------------------------------------------------------------------------
# tables and sentences, from results.json alone
# ---------------------------------------------------------------------------------------

def _to_target(entry: dict, digits: int = 1) -> str:
    if not entry["reached"]:
        return "not reached"
    text = fmt_mean_std(entry["mean"], entry["std"], digits)
    return text if entry["reached"] == entry["seeds"] else f"{text} ({entry['reached']}/{entry['seeds']} seeds)"


def _ms(a: dict | None, key: str, digits: int = 2) -> str:
    return fmt_mean_std(a[key]["mean"], a[key]["std"], digits) if a and key in a else "-"


def comparison_table(results: dict, target: float = TARGET) -> str:
    header = ["algorithm", "flags", "seeds", "held-out acc. start", "end", "peak", f"steps to {target:g}",
              f"train time to {target:g} (s)", "steps/s", "tokens/s", "peak mem. (GiB)"]
    rows = []
    for r in results.values():
        a, flags = r.get("aggregate"), f"`{' '.join(r['flags'])}`" if r["flags"] else ""
        if a is None:
            rows.append([r["label"], flags, 0, r["status"]] + ["-"] * (len(header) - 4))
            continue
        rows.append([r["label"], flags, len(r["seeds"]), _ms(a, "accuracy_start"), _ms(a, "accuracy_end"),
                     _ms(a, "accuracy_peak"), _to_target(a["steps_to_target"]), _to_target(a["time_to_target_s"]),
                     _ms(a, "steps_per_s"), _ms(a, "tokens_per_s", 0), fmt(a["peak_memory_gib"]["mean"])])
    return markdown_table(header, rows, "ll" + "r" * (len(header) - 2))


def time_table(results: dict) -> str:
    parts = TIME_PARTS + ["other"]
    header = ["algorithm", "step (ms)"] + [TIME_LABELS[p] for p in parts] + ["one weight sync (ms, median)"]
    rows = [[r["label"], fmt(a["step_ms"]["mean"], 0)]
            + [f"{100 * a['time_share'][p]:.1f}%" if a["time_share"][p] is not None else "-" for p in parts]
            + [fmt(a["sync_ms_median"]["mean"], 1)]
            for r in results.values() if (a := r.get("aggregate"))]
    return markdown_table(header, rows)


def plateau_step(curve: dict, share: float = 0.95) -> int | None:
    """The first evaluated step at which the mean-over-seeds accuracy curve reaches `share` of
    its own peak: where the algorithm's plateau starts."""
    if not curve["mean"] or max(curve["mean"]) <= 0:
        return None
    peak = max(curve["mean"])
    return next(step for step, acc in zip(curve["step"], curve["mean"]) if acc >= share * peak)


def ranking_findings(results: dict) -> list[str]:
    """The algorithms ordered by final held-out accuracy, and for each neighbour pair whether
    the gap is larger than the spread over seeds (every seed of one above every seed of the
    other) or not."""
    ends = {r["label"]: [p["accuracy_end"] for p in r["per_seed"].values()] for r in results.values()
            if len(r["per_seed"]) > 1}
    if len(ends) < 2:
        return []
    order = sorted(ends, key=lambda k: -statistics.fmean(ends[k]))
    pairs = [f"{a} {'>' if min(ends[a]) > max(ends[b]) else '≈'} {b}" for a, b in zip(order, order[1:])]
    separated = sum(min(ends[a]) > max(ends[b]) for a, b in zip(order, order[1:]))
    return [f"Ranked by final held-out accuracy: {', '.join(pairs)} ('>': every seed of the first ends above every "
            f"seed of the second; '≈': their seeds overlap). {separated} of {len(pairs)} neighbouring gaps are larger "
            f"than the spread over {min(len(v) for v in ends.values())} seeds."]


def ranking_md(results: dict, s: dict) -> list[str]:
    """Steps to the plateau of each algorithm and the ranking, for a task meant to separate them."""
    if "task" not in s:
        return []
    rows = [[r["label"], _ms(a, "accuracy_end"), _ms(a, "accuracy_peak"),
             fmt(plateau_step(a["curves"]["accuracy_vs_step"]), 0)]
            for r in results.values() if (a := r.get("aggregate"))]
    table = markdown_table(["algorithm", "held-out acc. end", "peak", "steps to its plateau"], rows)
    return [table, "'Steps to its plateau': the first evaluated step at which the mean over seeds reaches 95% of "
            "its own peak.\n", *(f"- {line}\n" for line in ranking_findings(results))]


def engines_md(e: dict) -> str:
    header = ["prompts x completions", "vLLM completions/s", "transformers completions/s", "vLLM / transformers",
              "vLLM tokens/s", "transformers tokens/s", "mean completion tokens (vLLM / transformers)"]
    rows = [[f"{r['prompts']} x {r['completions_per_prompt']}", fmt(r["vllm"]["completions_per_s"], 0),
             fmt(r["transformers"]["completions_per_s"], 0), f"{r['ratio_completions_per_s']:.2f}x",
             fmt(r["vllm"]["tokens_per_s"], 0), fmt(r["transformers"]["tokens_per_s"], 0),
             f"{r['vllm']['mean_completion_tokens']:.1f} / {r['transformers']['mean_completion_tokens']:.1f}"]
            for r in e["sizes"]]
    cpu = " (CPU: plain linear weights, so that weight sync works)" if e["device"] == "cpu" else ""
    return (f"`{e['model']}` on {e['device']} ({e['dtype']}), `{e['task']}` prompts, up to {e['max_new_tokens']} new "
            f"tokens:\n\n{markdown_table(header, rows)}\nTemperature {e['temperature']}, the same prompts for both "
            f"engines; median of {e['repeats']} timed calls after one warm-up call. vLLM is created as the training "
            f"scripts create it{cpu}. Start-up: vLLM engine {e['startup_s']['vllm']:.1f} s, transformers model "
            f"{e['startup_s']['transformers']:.1f} s.\n")


def lecture_rows(data: dict, task: str) -> list[dict]:
    """One row per lecture estimator on `task` (its learning runs and / or gradient variance),
    plus Dr. GRPO's gradient variance."""
    est = (((data.get("gradient_variance") or {}).get("tasks") or {}).get(task) or {}).get("estimators", {})
    rows = []
    for cfg, name in LECTURE:
        run = data["runs"].get(cfg.name if task == TASK else f"{task}/{cfg.name}", {})
        rows.append({"estimator": name, "run": run if run.get("aggregate") else None, "variance": est.get(name)})
    if "dr-grpo" in est:
        rows.append({"estimator": "dr-grpo", "run": None, "variance": est["dr-grpo"]})
    return rows


def lecture_table(rows: list[dict], target: float = TARGET) -> str:
    header = ["estimator", "held-out acc. end", "peak", f"steps to {target:g}", "held-out mean reward end",
              "gradient: relative variance", "vs. no baseline (95% interval)", "cos(one batch, mean)"]
    out = []
    for row in rows:
        a, v = (row["run"] or {}).get("aggregate"), row["variance"]
        to_target = _to_target(a["steps_to_target"]) if a else "-" if row["estimator"] == "dr-grpo" else "not run"
        out.append([LABEL[row["estimator"]], _ms(a, "accuracy_end"), _ms(a, "accuracy_peak"), to_target,
                    _ms(a, "eval_reward_end"), f"{v['relative_variance']:.3g}" if v else "-",
                    _ratio_cell(v) if v else "-", f"{v['cosine_to_mean']:.2f}" if v else "-"])
    return markdown_table(header, out)


def _ratio_cell(v: dict) -> str:
    lo, hi = v["ratio_interval"]
    return f"{v['relative_variance_vs_reference']:.2f}x ({lo:.2f}-{hi:.2f})"


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def learning_findings(rows: list[dict]) -> list[str]:
    """Whether REINFORCE without a baseline differs from each baseline by more than the spread
    over seeds: every seed's final held-out accuracy below / above every seed of the other."""
    done = [r for r in rows if r["run"]]
    ref = next((r for r in done if r["estimator"] == "none"), None)
    others = [r for r in done if r is not ref]
    if ref is None or not others:
        return []
    n = min(len(r["run"]["per_seed"]) for r in done)
    if n < 2:
        return ["One seed per estimator: no spread over seeds to tell a difference from seed noise."]
    mine = [s["accuracy_end"] for s in ref["run"]["per_seed"].values()]
    below, above, overlap = [], [], []
    for r in others:
        theirs = [s["accuracy_end"] for s in r["run"]["per_seed"].values()]
        (below if max(mine) < min(theirs) else above if min(mine) > max(theirs) else overlap).append(
            NAMED[r["estimator"]])
    parts = ([f"every seed of REINFORCE without a baseline ends below every seed of {_join(below)}"] if below else []) \
        + ([f"every seed of REINFORCE without a baseline ends above every seed of {_join(above)}"] if above else []) \
        + ([f"its seeds overlap those of {_join(overlap)} (no difference beyond the spread over {n} seeds)"]
           if overlap else [])
    return [parts[0][0].upper() + parts[0][1:] + "".join(f"; {p}" for p in parts[1:]) + "."]


def ratio_phrase(ratio: float, interval: tuple[float, float]) -> str:
    """'2.3 times lower (...)' / '1.8 times higher (...)' / 'no clear difference (...)'."""
    lo, hi = interval
    ci = f"ratio {ratio:.2f}, 95% bootstrap interval {lo:.2f}-{hi:.2f}"
    if hi < 1:
        return f"{1 / ratio:.1f} times lower ({ci})"
    if lo > 1:
        return f"{ratio:.1f} times higher ({ci})"
    return f"no clear difference ({ci} includes 1)"


def variance_findings(d: dict) -> list[str]:
    """What the gradient variance on one task shows, in sentences generated from its numbers."""
    est, out = d["estimators"], []
    for name in ("batch-mean", "rloo", "grpo"):  # the lecture's baselines (Dr. GRPO: RLOO's numbers, see the note)
        if name in est:
            s = est[name]
            out.append(f"{LABEL[name]}: relative gradient variance {s['relative_variance']:.3g} against "
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
        parts = [f"{fmt(sn[f'mean_sq_norm_{k}'], 0)} for {lab}" for k, lab in
                 (("reward_1", "R = 1"), ("partial", "0 < R < 1"), ("reward_0", "R = 0"))
                 if sn[f"mean_sq_norm_{k}"] is not None]
        out.append(text + ("; mean ‖∇ log p‖²: " + ", ".join(parts) if parts else "") + ".")
    return out


def variance_md(v: dict) -> str:
    """The settings of the gradient-variance measurement and its per-task diagnostics."""
    s, tasks = v["settings"], v["tasks"]
    shared = [t for t, d in tasks.items() if d["shared_samples_with"]]
    header = ["task", "reward", "mean reward", "samples with 0 < R < 1", "groups with all-equal rewards",
              "b* = E[R‖∇log p‖²] / E[‖∇log p‖²]", "mean R of the same completions",
              "mean ‖∇log p‖²: R = 1", "0 < R < 1", "R = 0", "completions (R = 1 / partial / 0)"]
    rows = []
    for t, d in tasks.items():
        sn = d["score_norms"]
        rows.append([f"`{t}`", d["reward_kind"], f"{d['mean_reward']:.2f}", f"{100 * d['partial_frac']:.0f}%",
                     f"{100 * d['groups_all_equal_frac']:.0f}%", fmt(sn["optimal_baseline"]), fmt(sn["mean_reward"]),
                     fmt(sn["mean_sq_norm_reward_1"], 0), fmt(sn["mean_sq_norm_partial"], 0),
                     fmt(sn["mean_sq_norm_reward_0"], 0),
                     f"{sn['completions']} ({sn['count_reward_1']} / {sn['count_partial']} / {sn['count_reward_0']})"])
    shared_note = (f"; {', '.join(f'`{t}`' for t in shared)} are measured on the very same completions, only the "
                   f"reward differs" if shared else "")
    return (f"#### How the gradient variance was measured\n\n{s['batches']} batches of the same {s['prompts']} "
            f"prompts x {s['completions']} fresh completions (`{s['model']}`, its initial weights, temperature "
            f"{s['temperature']}{shared_note}). Same samples and the same loss aggregation (`{s['loss_agg']}`) for "
            f"every estimator; only the advantage differs. Relative variance tr Cov[g] / ‖E g‖² of one batch's "
            f"gradient (lower: a batch points more reliably where the estimator points on average); 'vs. no "
            f"baseline' is its ratio to REINFORCE without a baseline (below 1: the baseline lowers the variance), "
            f"with a 95% percentile bootstrap interval over the batches. Dr. GRPO's gradient is RLOO's times (K-1)/K "
            f"on every batch, so their scale-free numbers coincide. {v['parameters']:,} parameters.\n\n"
            f"{markdown_table(header, rows)}\nb* is the constant baseline that minimizes tr Cov of (R − b) ∇log p(y), "
            f"measured on the first {s['score_norm_batches']} batch(es); the batch-mean baseline subtracts roughly "
            f"the mean reward.\n")


def lecture_md(data: dict) -> str:
    tasks = [TASK, LECTURE_TASK]
    vt = ((data.get("gradient_variance") or {}).get("tasks")) or {}
    parts = ["The lecture's claim: subtracting a baseline leaves the expected policy gradient unchanged and lowers "
             "its variance, so the same budget learns faster. Measured on " + " and ".join(f"`{t}`" for t in tasks)
             + " (" + "; ".join(TASK_NOTES[t] for t in tasks) + "). Learning: the four estimators with the budget of "
             f"the comparison above (`{TASK}`: the same runs; REINFORCE without a baseline is reinforce.py `--baseline "
             "none`); held-out accuracy is exact (reward >= 1) on every task, the held-out mean reward is the task's "
             "own reward of the greedy completions. Gradient: relative variance tr Cov[g] / ‖E g‖² of one batch's "
             "policy gradient on fixed prompts, from the initial policy (gradient_variance.py); below 1x, the "
             "baseline lowers it.\n"]
    for t in tasks:
        rows = lecture_rows(data, t)
        lines = learning_findings(rows) + (variance_findings(vt[t]) if t in vt else [])
        parts.append(f"\n#### `{t}`" + (f": {vt[t]['reward_kind']} reward" if t in vt else "") + "\n\n"
                     + lecture_table(rows) + "".join(f"\n- {line}" for line in lines) + ("\n" if lines else ""))
    if data.get("gradient_variance"):
        parts.append("\n" + variance_md(data["gradient_variance"]))
    return "".join(parts)


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
               color_of: dict[str, tuple] | None = None) -> list[str]:
    """Mean line and min-max band of each curve `key`; returns the labels of the lines drawn.
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


def plot_curves(curves: dict[str, dict], path, title: str, target: float | None = TARGET) -> list[list[str]]:
    """Accuracy and reward against step and training time: one line per algorithm (mean over
    seeds) with a min-max band over seeds. Returns the labels drawn in each panel."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.4))
    drawn = [draw_panel(ax, curves, *panel, target=target) for ax, panel in zip(axes.flat, PANELS)]
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plot_time_breakdown(results: dict, path) -> list[str]:
    """Stacked horizontal bars: the share of each part of a training step, per algorithm."""
    plt = _pyplot()
    done = [r for r in results.values() if r.get("aggregate")]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(done) + 1.9))
    left = [0.0] * len(done)
    for color, part in zip(plt.get_cmap("tab10").colors, TIME_PARTS + ["other"]):
        widths = [100 * (r["aggregate"]["time_share"][part] or 0.0) for r in done]
        ax.barh(range(len(done)), widths, left=left, color=color, label=TIME_LABELS[part])
        left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(range(len(done)))
    ax.set_yticklabels([f"{r['label']} ({r['aggregate']['step_ms']['mean']:.0f} ms/step)" for r in done])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of training-step time (%)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [r["label"] for r in done]


def plot_lecture(task_rows: dict[str, list[dict]], path, target: float = TARGET) -> dict:
    """One row per task: held-out accuracy and rollout reward against step for the four
    estimators, and each baseline's relative gradient variance over that of no baseline, with
    its bootstrap interval, on a log scale. Returns the lines and bars drawn per task."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    labels = [LABEL[name] for _, name in LECTURE]
    color_of = dict(zip(labels, plt.get_cmap("tab10").colors))
    bars_of = {t: [r for r in rows if r["variance"] and r["estimator"] != "none"] for t, rows in task_rows.items()}
    # one x range for every task's variance panel, so that the rows compare at a glance
    ends = [x for bars in bars_of.values() for r in bars
            for x in (r["variance"]["relative_variance_vs_reference"], *r["variance"]["ratio_interval"])
            if 0 < x < float("inf")] + [1.0]
    left, right = min(ends) / 3, max(ends) * 3
    height = 3.5 * len(task_rows) + 0.7
    fig, axes = plt.subplots(len(task_rows), 3, figsize=(15, height), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1, 0.9]})
    drawn = {"lines": {}, "bars": {}}
    for ax_row, (t, rows) in zip(axes, task_rows.items()):
        curves = {LABEL[r["estimator"]]: r["run"]["aggregate"]["curves"] for r in rows if r["run"]}
        drawn["lines"][t] = []
        for ax, panel in zip(ax_row, [PANELS[0], PANELS[2]]):
            drawn["lines"][t].append(draw_panel(ax, curves, *panel, target=target, color_of=color_of))
            ax.set_title(f"{t}: {panel[1]}" + (" (exact)" if "accuracy" in panel[0] else ""), fontsize=10)
            if not curves:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax, bars = ax_row[2], bars_of[t]
        drawn["bars"][t] = [SHORT[r["estimator"]] for r in bars]
        if not bars:
            ax.axis("off")
            continue
        values = [r["variance"]["relative_variance_vs_reference"] for r in bars]
        lo = [r["variance"]["ratio_interval"][0] for r in bars]
        hi = [min(r["variance"]["ratio_interval"][1], right) for r in bars]
        # bars start at 1 (no baseline): to the left, the baseline lowers the variance
        ax.barh(range(len(bars)), [v - 1 for v in values], left=1, alpha=0.85,
                color=[color_of.get(LABEL[r["estimator"]], "grey") for r in bars])
        ax.errorbar(values, range(len(bars)), fmt="none", ecolor="black", lw=1, capsize=3,
                    xerr=[[v - a for v, a in zip(values, lo)], [b - v for v, b in zip(values, hi)]])
        for k, (v, a, b) in enumerate(zip(values, lo, hi)):  # the value beyond the interval's outer end
            ax.text(a / 1.08 if v < 1 else b * 1.08, k, f"{v:.2f}x", ha="right" if v < 1 else "left", va="center",
                    fontsize=8)
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_xlim(left, right)
        ticks = [x for x in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if left <= x <= right]
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(range(len(bars)), drawn["bars"][t])
        ax.invert_yaxis()
        ax.set_xlabel("relative gradient variance / no baseline's (log)")
        ax.set_title(f"{t}: gradient variance (< 1: baseline helps)", fontsize=10)
        ax.grid(axis="x", alpha=0.3, which="both")
    fig.legend([plt.Line2D([], [], color=color_of[label], lw=2) for label in labels], labels, loc="upper center",
               ncol=4, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------------------------------
# the report and the command
# ---------------------------------------------------------------------------------------

def write_report(data: dict, out: Path) -> str:
    """report.md and the three plots from results.json's numbers alone; returns the report."""
    s, main = data["settings"], {c.name: data["runs"][c.name] for c in ALGORITHMS if c.name in data["runs"]}
    target, task = s.get("target", TARGET), s.get("task", TASK)
    reused = (f"; {data['reused']} results were reused from an earlier run of the same command "
              f"({data['process_s'] / 60:.1f} min of process time in all)" if data["reused"] else "")
    parts = [f"## Results ({data['mode']} mode)\n",
             provenance_md(data["environment"]) + f"Duration: {data['elapsed_s'] / 60:.1f} min{reused}.\n"]
    for later in data.get("remeasured", []):  # rows measured afterwards with --only
        parts.append(f"Rows {', '.join(later['names'])} measured later (--only): " + provenance_md(later["environment"])
                     + f"Duration: {later['elapsed_s'] / 60:.1f} min.\n")
    curves = {r["label"]: r["aggregate"]["curves"] for r in main.values() if r.get("aggregate")}
    if curves:
        band = "band: min-max over seeds" if len(s["seeds"]) > 1 else "one seed"
        plot_curves(curves, out / "curves.png", f"{len(curves)} algorithms on {task}, {s['steps']} steps of "
                    f"{s['prompts_per_step']} prompts x {s['completions_per_prompt']} completions, seeds {s['seeds']} "
                    f"({band})", target)
        plot_time_breakdown(main, out / "time_breakdown.png")
        parts += [f"### The algorithms on `{task}`, the same budget\n", comparison_table(main, target),
                  f"Budget, the same for every script: `{' '.join(budget_flags(s))}`, seeds {s['seeds']}; every other "
                  f"hyperparameter is the script's default. Mean ± std over seeds. Training time is the sum of the "
                  f"steps' times (no start-up, no held-out evaluation); 'steps to {target:g}' is the first evaluated "
                  f"step (every {s['eval_every']}) with held-out greedy accuracy >= {target:g}.\n",
                  *ranking_md(main, s),
                  "![held-out accuracy and mean reward against step and training time](curves.png)\n",
                  "### Where a training step's time goes\n", time_table(main),
                  "Share of the summed step time (`time/<part>` / `time/step` in metrics.jsonl), mean over seeds; "
                  "'other' is the untimed rest of a step (reward, advantages, metrics). One weight sync is the median "
                  "`time/sync`, mean over seeds.\n",
                  "![share of each part of a training step](time_breakdown.png)\n"]
    engines = [e for e in (data.get("rollout_engines"), data.get("rollout_engines_smollm2")) if e]
    if engines:
        parts += ["### Rollout engine: vLLM against transformers `generate`\n",
                  *(f"Not run: {e['not_run']}.\n" if "not_run" in e else engines_md(e) for e in engines)]
    if data.get("gradient_variance") or "lecture_estimators" in s:
        parts += ["### The policy-gradient lecture's claim: baselines and gradient variance\n", lecture_md(data)]
        plot_lecture({t: lecture_rows(data, t) for t in (TASK, LECTURE_TASK)}, out / "lecture.png")
        parts.append("![learning curves and gradient variance of the four estimators, one row per task](lecture.png)\n")
    report = "\n".join(parts)
    (out / "report.md").write_text(report)
    return report


def update_readme(readme: Path, report: str, out: Path, mode: str = "full") -> None:
    """Replace the README's block between the mode's markers with the report (images relinked)."""
    text = readme.read_text()
    begin, end = markers(mode)
    if begin not in text or end not in text:
        raise SystemExit(f"error: {readme} has no '{begin}' ... '{end}' block to fill")
    rel = Path(os.path.relpath(out, readme.resolve().parent)).as_posix()
    for name in ("curves.png", "time_breakdown.png", "lecture.png"):
        report = report.replace(f"]({name})", f"]({rel}/{name})")
    head, rest = text.split(begin, 1)
    readme.write_text(f"{head}{begin}\n{report}\n{end}{rest.split(end, 1)[1]}")
    print(f"updated {readme}", flush=True)


NO_VLLM = "vLLM is not installed here"


def measure(mode: str, out: Path, force: bool, env: dict, only: list[str] | None = None) -> dict:
    """Run (or reuse) every part and every run; returns what results.json holds. With `only`
    (algorithm names), just those algorithms' runs."""
    s, t0, runs_dir, parts = MODES[mode], time.perf_counter(), out / "runs", {}
    if only:
        s = {k: v for k, v in s.items() if k not in ("engines", "engines_smollm2", "variance", "lecture_estimators")}
    for name, key in (("rollout_engines", "engines"), ("rollout_engines_smollm2", "engines_smollm2")):
        if key in s and not vllm_installed():  # the part compares vLLM with the transformers engine
            print(f"{name}: not run ({NO_VLLM})", flush=True)
            parts[name] = {"not_run": NO_VLLM}
        elif key in s:
            parts[name] = run_part(name, "rollout_engines.py", s[key], runs_dir, force)
    if "variance" in s:
        parts["gradient_variance"] = run_part("gradient_variance", "gradient_variance.py",
                                              [*s["variance"], "--task", TASK, LECTURE_TASK], runs_dir, force)
    lecture = [NO_BASELINE] + lecture_configs(s["lecture_estimators"]) if "lecture_estimators" in s else []
    configs = [c for c in ALGORITHMS if not only or c.name in only] + lecture
    budget = budget_flags(s)
    folders = {(c.name, seed): runs_dir / c.name / f"seed{seed}" for c in configs for seed in s["seeds"]}
    runs = [Run(f"{c.name} seed {seed}", folders[c.name, seed],
                [c.script, "--seed", str(seed), *budget, *c.flags, "--output-dir", str(folders[c.name, seed])])
            for c in configs for seed in s["seeds"]]
    print(f"{len(runs)} runs, {s['jobs']} at a time, budget: {' '.join(budget)}", flush=True)
    records = run_scripts(runs, s["jobs"], force)
    done = [*records.values(), *(p for p in parts.values() if p)]
    return {"environment": env, "mode": mode, "elapsed_s": time.perf_counter() - t0,
            "settings": {k: v for k, v in MODES[mode].items() if k not in ("engines", "engines_smollm2", "variance")},
            "reused": sum(bool(d.get("reused")) for d in done),
            "process_s": sum(d.get("process_wall_s", d.get("wall_s", 0.0)) for d in done),
            "runs": collect(configs, s["seeds"], runs_dir, s.get("target", TARGET)), **parts}


def merge_rows(data: dict, new: dict, names: list[str]) -> dict:
    """results.json with the rows of `names` taken from a later --only measurement, which it records."""
    if new["settings"] != data["settings"]:
        raise SystemExit(f"error: --only: the {new['mode']} mode's settings changed since results.json was written; "
                         f"measure the whole mode again")
    data["runs"].update({name: new["runs"][name] for name in names})
    data.setdefault("remeasured", []).append({"names": names, "environment": new["environment"],
                                             "elapsed_s": new["elapsed_s"]})
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="quick")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<mode>)")
    p.add_argument("--force", action="store_true", help="rerun the runs and parts that already finished")
    p.add_argument("--report-only", action="store_true", help="measure nothing: the report and plots from results.json")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(BY_NAME),
                   help="measure only these algorithms' runs and merge them into the mode's results.json, which "
                        "records when and where they were measured (e.g. a new script: --only sapo)")
    p.add_argument("--update-readme", type=Path, nargs="?", const=ROOT / "benchmarks" / "README.md", metavar="README",
                   help="put the report between the markers of this README (default benchmarks/README.md)")
    args = p.parse_args(argv)
    out = (args.out or ROOT / "benchmarks" / "results" / args.mode).resolve()
    if args.report_only:
        data = json.loads((out / "results.json").read_text())
    else:
        env = environment(None if argv is None else [__file__, *argv])
        print(f"benchmarks ({args.mode}) -> {out}", flush=True)
        if (env["load_average_1min"] or 0) > 0.5:
            print(f"note: load average {env['load_average_1min']}: other work on this machine slows the timings down "
                  f"(recorded in the report)", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        data = measure(args.mode, out, args.force, env, args.only)
        if args.only:
            data = merge_rows(json.loads((out / "results.json").read_text()), data, args.only)
        write_json(out / "results.json", data)
    report = write_report(data, out)
    if args.update_readme:
        update_readme(args.update_readme, report, out, args.mode)
    failed = [name for name in ("rollout_engines", "rollout_engines_smollm2", "gradient_variance")
              if name in data and not data[name]]
    failed += [name for name, r in data["runs"].items() if r["status"] != "ok"]
    print(f"\nbenchmarks: {out / 'report.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
