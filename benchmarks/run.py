"""All benchmarks in one command: the six algorithms side by side (compare.py), vLLM against
transformers generate (rollout_engines.py), and the policy-gradient lecture's baseline claim
(gradient_variance.py plus the learning curves of its four estimators), on the 0/1 `sort`
reward and on the partial-credit `sort-partial` reward.

    python benchmarks/run.py --mode quick      # a few minutes: every part, smallest settings
    python benchmarks/run.py --mode full       # the committed results (see benchmarks/README.md)

Writes to benchmarks/results/<mode>/ (or --out): every part's own files, plus
    report.md     all tables and plots, with the machine, date, commit and command
    lecture.png   per task (sort, sort-partial): learning curves of the four estimators and
                  each baseline's gradient variance relative to no baseline
    lecture.md    the lecture comparison per task: tables, and what they show in sentences
                  generated from the numbers
    results.json  every number
Finished parts and runs are reused when the same command is run again (--force reruns).
--update-readme README.md replaces the text between the README's
`<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->` lines with report.md, so the README
shows exactly what the command produced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from benchmarks import compare  # noqa: E402
from benchmarks.util import ROOT, environment, fmt_mean_std, markdown_table, provenance_md, write_json  # noqa: E402

PART_ARGS = {
    "quick": {"engines": ["--sizes", "8x4", "--repeats", "2"],
              "variance": ["--prompts", "4", "--completions", "4", "--batches", "4", "--score-norm-batches", "1"]},
    "full": {"engines": ["--sizes", "32x8", "128x8", "--repeats", "5"],
             "variance": ["--prompts", "8", "--completions", "8", "--batches", "64", "--score-norm-batches", "2"],
             # the same comparison on a real 135M instruct model with longer completions (full mode only)
             "engines-smollm2": ["--model", "smollm2-135m-instruct", "--task", "basic_arithmetic",
                                 "--sizes", "8x4", "32x4", "--max-new-tokens", "64", "--repeats", "3"]},
}
PART_SCRIPTS = {"engines": ("rollout_engines.py", "rollout_engines.json"),
                "engines-smollm2": ("rollout_engines.py", "smollm2/rollout_engines.json"),
                "variance": ("gradient_variance.py", "gradient_variance.json")}
# compare.py run name -> gradient_variance.py estimator
LECTURE_ESTIMATOR = {"reinforce-no-baseline": "none", "reinforce": "batch-mean", "rloo": "rloo", "grpo": "grpo"}
SHORT = {"none": "no baseline", "batch-mean": "batch mean", "rloo": "RLOO", "grpo": "GRPO", "dr-grpo": "Dr. GRPO"}
NAMED = {"none": "REINFORCE without a baseline", "batch-mean": "REINFORCE with the batch-mean baseline",
         "rloo": "RLOO", "grpo": "GRPO", "dr-grpo": "Dr. GRPO"}
# what each task's reward is (definitions; every claim about them is generated from the numbers)
TASK_NOTES = {"sort": "`sort`: reward 1 for the exact sorted digits, else 0",
              "sort-partial": "`sort-partial`: the same prompts and splits, reward = the fraction of positions "
                              "holding the right digit over the longer of completion and answer, 1 only for "
                              "the exact answer, never negative"}
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def run_part(part: str, mode: str, out: Path, force: bool, extra: list[str]) -> dict | None:
    """Run rollout_engines.py or gradient_variance.py in its own process (each loads vLLM or
    the scripts, which change process-wide settings); reuse its JSON if the command matches."""
    script, result = PART_SCRIPTS[part]
    path = out / result
    argv = [*PART_ARGS[mode][part], *extra, "--out", str(path.parent)]
    if path.exists() and not force:
        data = json.loads(path.read_text())
        if data.get("argv") == argv:
            print(f"{part}: reused {path}", flush=True)
            return {**data, "_reused": True}
    print(f"{part}: python benchmarks/{script} {' '.join(argv)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, shown = [], False
    for line in proc.stdout:  # show the part's own progress and table; keep vLLM's log for errors
        log.append(line)
        if line.startswith(("gradient variance", "rollout engines", "  vLLM", "|", "- ", "On `", "wrote", "error")):
            print("    " + line.rstrip(), flush=True)
            shown = True
    proc.wait()
    if proc.returncode != 0 or not path.exists():
        print(f"{part}: FAILED (exit code {proc.returncode}); last lines:\n    " + "    ".join(log[-25:]), flush=True)
        return None
    if not shown:
        print(f"{part}: done", flush=True)
    return json.loads(path.read_text())


def task_results(cmp: dict, task: str) -> tuple[dict, dict[str, str]]:
    """compare.py's results on `task` and {lecture name (reinforce, rloo, ...): run name there}."""
    if task == cmp.get("task", compare.DEFAULT_TASK):
        return cmp["algorithms"], {name: name for name, _ in cmp["lecture"]}
    other = cmp.get("lecture_tasks", {}).get(task, {"algorithms": {}, "lecture": []})
    return other["algorithms"], {name.rsplit("/", 1)[-1]: name for name, _ in other["lecture"]}


def lecture_rows(cmp: dict | None, task: str, variance: dict | None) -> list[dict]:
    """One row per lecture estimator on `task` (learning runs and / or gradient variance),
    plus Dr. GRPO's gradient variance."""
    algorithms, run_of = task_results(cmp, task) if cmp else ({}, {})
    est = ((variance or {}).get("tasks") or {}).get(task, {}).get("estimators", {})
    rows = []
    for cfg, label in compare.LECTURE:
        r = algorithms.get(run_of.get(cfg.name, ""), {})
        rows.append({"name": cfg.name, "label": label, "aggregate": r.get("aggregate"),
                     "per_seed": list(r.get("per_seed", {}).values()), "estimator": LECTURE_ESTIMATOR[cfg.name],
                     "variance": est.get(LECTURE_ESTIMATOR[cfg.name])})
    if "dr-grpo" in est:
        rows.append({"name": "dr-grpo", "label": est["dr-grpo"]["label"], "aggregate": None, "per_seed": [],
                     "estimator": "dr-grpo", "variance": est["dr-grpo"]})
    return rows


def lecture_table(rows: list[dict], target: float) -> str:
    header = ["estimator", "held-out acc. end", "peak", f"steps to {target:g}", "held-out mean reward end",
              "gradient: relative variance", "vs. no baseline (95% interval)", "cos(one batch, mean)"]
    out = []
    for row in rows:
        a, v = row["aggregate"], row["variance"]
        lo, hi = v["ratio_interval"] if v else (None, None)
        out.append([
            row["label"],
            fmt_ms(a, "accuracy_end"), fmt_ms(a, "accuracy_peak"),
            compare._to_target(a["steps_to_target"], 1) if a else "not run" if row["name"] != "dr-grpo" else "-",
            fmt_ms(a, "eval_reward_end"),
            f"{v['relative_variance']:.3g}" if v else "-",
            f"{v['relative_variance_vs_reference']:.2f}x ({lo:.2f}-{hi:.2f})" if v else "-",
            f"{v['cosine_to_mean']:.2f}" if v else "-"])
    return markdown_table(header, out)


def fmt_ms(a: dict | None, key: str) -> str:
    return fmt_mean_std(a[key]["mean"], a[key]["std"]) if a and key in a else "-"


def _join(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def learning_findings(rows: list[dict], steps: int) -> list[str]:
    """What the learning runs on one task show, generated from their numbers: the end
    accuracies, and whether REINFORCE without a baseline differs from each baseline by more
    than the spread over seeds (every seed below / above every seed of the other)."""
    done = [r for r in rows if r["aggregate"]]
    if not done:
        return []
    n = min(len(r["per_seed"]) for r in done)
    out = [f"Held-out exact accuracy after {steps} steps ({f'mean ± std over {n} seeds' if n > 1 else 'one seed'}): "
           + "; ".join(f"{SHORT[r['estimator']]} {fmt_ms(r['aggregate'], 'accuracy_end')}" for r in done) + "."]
    if any(r["aggregate"].get("eval_reward_end", {}).get("mean") is not None
           and abs(r["aggregate"]["eval_reward_end"]["mean"] - r["aggregate"]["accuracy_end"]["mean"]) > 1e-9
           for r in done):
        out.append("Held-out mean reward (partial credit) at the end: "
                   + "; ".join(f"{SHORT[r['estimator']]} {fmt_ms(r['aggregate'], 'eval_reward_end')}" for r in done)
                   + ".")
    ref = next((r for r in done if r["name"] == "reinforce-no-baseline"), None)
    others = [r for r in done if r is not ref]
    if ref is None or not others:
        return out
    if n < 2:
        out.append("One seed per estimator: no spread over seeds to tell a difference from seed noise.")
        return out
    mine = [s["accuracy_end"] for s in ref["per_seed"]]
    below, above, overlap = [], [], []
    for r in others:
        theirs = [s["accuracy_end"] for s in r["per_seed"]]
        name = NAMED[r["estimator"]]
        (below if max(mine) < min(theirs) else above if min(mine) > max(theirs) else overlap).append(name)
    parts = []
    if below:
        parts.append(f"every seed of REINFORCE without a baseline ends below every seed of {_join(below)}")
    if above:
        parts.append(f"every seed of REINFORCE without a baseline ends above every seed of {_join(above)}")
    if overlap:
        parts.append(f"its seeds overlap those of {_join(overlap)} (no difference beyond the spread over {n} seeds)")
    out.append(parts[0][0].upper() + parts[0][1:] + "".join(f"; {p}" for p in parts[1:]) + ".")
    return out


def lecture_markdown(cmp: dict | None, tasks: list[str], task_rows: dict[str, list[dict]], variance: dict | None,
                     target: float) -> str:
    steps = cmp["settings"]["steps"] if cmp else None
    intro = ("The lecture's claim: subtracting a baseline leaves the expected policy gradient unchanged and lowers "
             "its variance, so the same budget learns faster. Measured on "
             + " and ".join(f"`{t}`" for t in tasks) + " (" + "; ".join(TASK_NOTES.get(t, t) for t in tasks) + "). "
             + ("Learning: the four estimators with the budget of the comparison above "
                f"(`{compare.DEFAULT_TASK}`: the same runs; REINFORCE without a baseline is reinforce.py "
                "`--baseline none`); held-out accuracy is exact (reward >= 1) on every task, the held-out mean "
                "reward is the task's own reward of the greedy completions. " if cmp else
                "Learning: not run (`--parts` without compare). ")
             + "Gradient: relative variance tr Cov[g] / ‖E g‖² of one batch's policy gradient on fixed "
             "prompts, from the initial policy (gradient_variance.py); below 1x, the baseline lowers it.\n")
    parts = [intro]
    vt = (variance or {}).get("tasks") or {}
    for t in tasks:
        parts.append(f"\n#### `{t}`" + (f": {vt[t]['reward_kind']} reward" if t in vt else "") + "\n\n")
        parts.append(lecture_table(task_rows[t], target))
        lines = learning_findings(task_rows[t], steps) if cmp else []
        lines += vt.get(t, {}).get("findings", [])
        parts.append("".join(f"\n- {line}" for line in lines) + ("\n" if lines else ""))
    if variance:
        mp = variance.get("markdown_parts", {})
        parts.append("\n#### Gradient variance on " + " and ".join(f"`{t}`" for t in vt) + " side by side\n\n")
        parts.append(f"{mp.get('side_by_side', '')}\n{mp.get('note', '')}\n{mp.get('diagnostic', '')}\n"
                     f"{mp.get('diagnostic_note', '')}")
    return "".join(parts)


def plot_lecture(task_rows: dict[str, list[dict]], variance: dict | None, path: Path, target: float) -> dict:
    """One row per task: held-out accuracy and rollout reward against step for the four
    estimators, and (where measured) each baseline's relative gradient variance over that
    of no baseline, with its bootstrap interval, on a log scale."""
    plt = compare._pyplot()
    from matplotlib.ticker import NullFormatter

    tasks = list(task_rows)
    colors = plt.get_cmap("tab10").colors
    color_of = {label: colors[i] for i, (_, label) in enumerate(compare.LECTURE)}
    # one x range for every task's variance panel, so the rows compare at a glance
    ends = [x for rows in task_rows.values() for row in rows if row["variance"] and row["estimator"] != "none"
            for x in (row["variance"]["relative_variance_vs_reference"], *row["variance"]["ratio_interval"])
            if 0 < x < float("inf")] + [1.0]
    left, right = min(ends) / 3, max(ends) * 3
    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 3.5 * len(tasks) + 0.7), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1, 0.9]})
    drawn = {"tasks": tasks, "lines": {}, "bars": {}}
    for i, t in enumerate(tasks):
        rows = task_rows[t]
        curves = {row["label"]: row["aggregate"]["curves"] for row in rows if row["aggregate"]}
        drawn["lines"][t] = []
        for j, panel in enumerate([compare.PANELS[0], compare.PANELS[2]]):
            ax = axes[i, j]
            drawn["lines"][t].append(compare.draw_panel(ax, curves, *panel, target=target, color_of=color_of))
            ax.set_title(f"{t}: {panel[1]}" + (" (exact)" if "accuracy" in panel[0] else ""), fontsize=10)
            if not curves:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax = axes[i, 2]
        bars = [row for row in rows if row["variance"] and row["estimator"] != "none"]
        drawn["bars"][t] = [SHORT[row["estimator"]] for row in bars]
        if not bars:
            ax.axis("off")
            continue
        values = [row["variance"]["relative_variance_vs_reference"] for row in bars]
        lo = [row["variance"]["ratio_interval"][0] for row in bars]
        hi = [row["variance"]["ratio_interval"][1] for row in bars]
        hi_drawn = [min(h, right) for h in hi]
        # bars from 1 (no baseline): to the left, the baseline lowers the variance
        ax.barh(range(len(bars)), [v - 1 for v in values], left=1,
                color=[color_of.get(row["label"], "grey") for row in bars], alpha=0.85)
        ax.errorbar(values, range(len(bars)), fmt="none", ecolor="black", lw=1, capsize=3,
                    xerr=[[v - l for v, l in zip(values, lo)], [h - v for v, h in zip(values, hi_drawn)]])
        for k, (v, l, h) in enumerate(zip(values, lo, hi_drawn)):  # the value beyond the interval's outer end
            ax.text(l / 1.08 if v < 1 else h * 1.08, k, f"{v:.2f}x", ha="right" if v < 1 else "left", va="center",
                    fontsize=8)
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_xlim(left, right)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if left <= t <= right]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels(drawn["bars"][t])
        ax.invert_yaxis()
        ax.set_xlabel("relative gradient variance / no baseline's (log)")
        ax.set_title(f"{t}: gradient variance (< 1: baseline helps)", fontsize=10)
        ax.grid(axis="x", alpha=0.3, which="both")
    handles = [plt.Line2D([], [], color=color_of[label], lw=2) for _, label in compare.LECTURE]
    fig.legend(handles, [label for _, label in compare.LECTURE], loc="upper center", ncol=4, frameon=False,
               fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.5 * len(tasks) + 0.7)))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def build_report(env: dict, mode: str, cmp: dict | None, engines: dict | None, variance: dict | None,
                 lecture_md: str | None, elapsed: float, engines_real: dict | None = None) -> str:
    measured = sum((d or {}).get("wall_s", 0.0) for d in (engines, variance)) + (cmp or {}).get("runs_process_s", 0.0)
    reused = (cmp or {}).get("runs_reused", 0) + sum(bool(d and d.get("_reused")) for d in (engines, variance))
    duration = (f"Duration: {elapsed / 60:.1f} min" + (f"; {reused} results were reused from an earlier run of the "
                                                       f"same command ({measured / 60:.1f} min of process time in all)"
                                                       if reused else "") + ".\n")
    parts = [f"## Benchmarks ({mode} mode)\n", provenance_md(env) + duration]
    if cmp:
        parts += ["### Six algorithms, one task, the same budget\n", cmp["markdown"]["table"],
                  "![held-out accuracy and mean reward against step and training time](curves.png)\n",
                  "### Where a training step's time goes\n", cmp["markdown"]["time_breakdown"],
                  "![share of each part of a training step](time_breakdown.png)\n"]
    if engines:
        parts += ["### Rollout engine: vLLM against transformers `generate`\n", engines["markdown"]]
    if engines_real:
        parts += ["The same comparison on SmolLM2-135M-Instruct (`basic_arithmetic` prompts in its chat "
                  "template, up to 64 new tokens):\n", engines_real["markdown"]]
    if lecture_md:
        parts += ["### The policy-gradient lecture's claim: baselines and gradient variance\n", lecture_md]
        if (Path(env["_out"]) / "lecture.png").exists():
            parts.append("![learning curves and gradient variance of the four estimators, one row per task]"
                         "(lecture.png)\n")
    return "\n".join(parts)


def update_readme(readme: Path, report: str, out: Path) -> None:
    """Replace the README's block between the markers with the report (images relinked)."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {readme} has no '{BEGIN}' ... '{END}' block to fill")
    rel = os.path.relpath(out, readme.resolve().parent)
    for name in ("curves.png", "time_breakdown.png", "lecture.png"):
        report = report.replace(f"]({name})", f"]({rel}/{name})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{report}\n{END}{tail}")
    print(f"updated {readme}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=compare.MODES, default="quick")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<mode>)")
    p.add_argument("--parts", nargs="+", choices=["compare", "engines", "variance"],
                   default=["engines", "variance", "compare"])
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy for 'steps / time to target'")
    p.add_argument("--jobs", type=int, help="algorithm scripts run at once (default: 2 quick, 1 full)")
    p.add_argument("--seeds", type=int, nargs="+", help="override the mode's seeds")
    p.add_argument("--steps", type=int, help="override the mode's steps")
    p.add_argument("--model", help="model for every part (default: the scripts' default, models/tiny-sort)")
    p.add_argument("--lecture-tasks", nargs="*", metavar="TASK",
                   help=f"tasks besides {compare.DEFAULT_TASK} for the lecture's estimators and their gradient "
                        f"variance (default {' '.join(compare.LECTURE_TASKS)}; the flag alone: none)")
    p.add_argument("--lecture-estimators", nargs="+", metavar="NAME", choices=[c.name for c, _ in compare.LECTURE],
                   help="which of the lecture's estimators run on those tasks (default: the mode's; quick mode: "
                        "reinforce-no-baseline only)")
    p.add_argument("--force", action="store_true", help="rerun what already ran")
    p.add_argument("--update-readme", type=Path, metavar="README", help="put report.md into this README's block")
    args = p.parse_args(argv)
    out = (args.out or ROOT / "benchmarks" / "results" / args.mode).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(None if argv is None else [__file__, *argv])
    t0 = time.perf_counter()
    model_flags = ["--model", args.model] if args.model else []
    print(f"benchmarks ({args.mode}): {', '.join(args.parts)} -> {out}", flush=True)
    if (env.get("load_average_1min") or 0) > 0.5:
        print(f"note: load average {env['load_average_1min']}: other work on this machine will slow the timings "
              f"down (recorded in the report)", flush=True)

    settings = {**compare.MODES[args.mode]}
    for k in ("jobs", "seeds", "steps", "lecture_tasks", "lecture_estimators"):
        if getattr(args, k) is not None:
            settings[k] = getattr(args, k)
    tasks = list(dict.fromkeys([compare.DEFAULT_TASK, *settings["lecture_tasks"]]))
    engines = run_part("engines", args.mode, out, args.force, model_flags) if "engines" in args.parts else None
    engines_real = (run_part("engines-smollm2", args.mode, out, args.force, [])
                    if "engines" in args.parts and "engines-smollm2" in PART_ARGS[args.mode] and not args.model
                    else None)
    variance = (run_part("variance", args.mode, out, args.force, [*model_flags, "--task", *tasks])
                if "variance" in args.parts else None)
    cmp = None
    if "compare" in args.parts:
        cmp = compare.compare(out, settings, args.target, script_flags=model_flags, force=args.force, env=env)
    elapsed = time.perf_counter() - t0

    lecture_md, plots = None, dict(cmp["plots"]) if cmp else {}
    if cmp or variance:
        task_rows = {t: lecture_rows(cmp, t, variance) for t in tasks}
        lecture_md = lecture_markdown(cmp, tasks, task_rows, variance, args.target)
        if any(row["aggregate"] or row["variance"] for rows in task_rows.values() for row in rows):
            plots["lecture.png"] = plot_lecture(task_rows, variance, out / "lecture.png", args.target)
        (out / "lecture.md").write_text(f"{lecture_md}\n{provenance_md(env)}")
    report = build_report({**env, "_out": str(out)}, args.mode, cmp, engines, variance, lecture_md, elapsed,
                          engines_real)
    (out / "report.md").write_text(report)
    write_json(out / "results.json", {"environment": env, "mode": args.mode, "elapsed_s": elapsed, "compare": cmp,
                                      "rollout_engines": engines, "rollout_engines_smollm2": engines_real,
                                      "gradient_variance": variance, "plots": plots})
    if args.update_readme:
        update_readme(args.update_readme, report, out)
    print(f"\nbenchmarks done in {elapsed / 60:.1f} min: {out / 'report.md'}", flush=True)
    failed = [part for part, data in (("engines", engines), ("variance", variance)) if part in args.parts and not data]
    if "engines" in args.parts and "engines-smollm2" in PART_ARGS[args.mode] and not args.model and not engines_real:
        failed.append("engines-smollm2")
    if cmp:
        every = [*cmp["algorithms"].items(), *(item for o in cmp["lecture_tasks"].values()
                                               for item in o["algorithms"].items())]
        failed += [n for n, r in every if r["status"] not in ("ok", "missing")]
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
