"""The step time of one training command at two or more commits, or with 1 and N processes
(torchrun), measured side by side.

    .venv/bin/python benchmarks/step_time.py --revs 4662adb HEAD --repeats 2 -- \\
        grpo.py --model smollm2 --task basic_arithmetic --steps 5 ...
    .venv/bin/python benchmarks/step_time.py --revs HEAD --processes 1 2 --repeats 2 -- grpo.py --steps 20
    .venv/bin/python benchmarks/step_time.py --revs HEAD --threads all 1 --repeats 3 -- grpo.py --steps 20

Each revision is checked out (git worktree) next to the others; the runs alternate between
the variants (revision x processes x threads: A B A B ...), so a machine that speeds up or slows down during the measurement touches
both alike. Of each run, the steady steps count (the first step, which warms caches, is left
out): the median of time/step and of each part of it (time/rollout, time/logprobs, ...).
Prints a markdown table and writes every run's numbers to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, parent: Path) -> Path:
    path = parent / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev], check=True,
                   capture_output=True, text=True)
    return path


def run_once(tree: Path, command: list[str], out: Path, processes: int = 1, threads: str = "all") -> list[dict]:
    """The command in that tree (its own --output-dir), under torchrun if processes > 1 (one
    thread each), with OMP_NUM_THREADS=threads unless "all"; the trained steps' metrics."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if threads == "all":
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = threads
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
                                   if processes > 1 else [])
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run([*launcher, *command, "--output-dir", str(out)], cwd=tree, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed in {tree} (exit {done.returncode}); see {log}")
    with open(out / "metrics.jsonl") as f:
        return [m for m in map(json.loads, f) if m["step"] > 0]


def steady(steps: list[dict]) -> dict:
    """Medians over the steps after the first, of time/step and each of its parts."""
    rest = steps[1:] or steps
    keys = sorted({k for m in rest for k in m if k.startswith("time/")})
    return {k: statistics.median(m[k] for m in rest if k in m) for k in keys} | {
        "response/length_mean": statistics.mean(m["response/length_mean"] for m in rest)}


def table(variants: list[str], runs: dict[str, list[dict]]) -> str:
    parts = [k for k in runs[variants[0]][0] if k.startswith("time/") and k != "time/step"]
    head = ["variant", "runs", "step (s)", *[f"{p[5:]} (s)" for p in parts], "mean completion (tokens)", "speed-up"]
    base = statistics.median(r["time/step"] for r in runs[variants[0]])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in variants:
        rs = runs[variant]
        step = statistics.median(r["time/step"] for r in rs)
        cells = [variant, str(len(rs)), f"{step:.2f}",
                 *[f"{statistics.median(r.get(p, 0.0) for r in rs):.1f}" for p in parts],
                 f"{statistics.mean(r['response/length_mean'] for r in rs):.1f}", f"{base / step:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", nargs="+", required=True, help="commits to compare; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--processes", type=int, nargs="+", default=[1],
                        help="run the command with each of these process counts (torchrun when > 1)")
    parser.add_argument("--threads", nargs="+", default=["all"],
                        help="run the command with each of these OMP_NUM_THREADS (all: the variable unset)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "step_time.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT FLAGS... (without --output-dir)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- grpo.py --steps 5")
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in args.revs}
        commits = {rev: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip() for rev, t in trees.items()}
        variants = {f"`{rev}`" + (f", {n} process{'es' * (n > 1)}" if len(args.processes) > 1 else "")
                    + (f", OMP_NUM_THREADS={t}" if len(args.threads) > 1 else ""): (rev, n, t)
                    for rev in args.revs for n in args.processes for t in args.threads}
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        try:
            for i in range(args.repeats):
                for variant, (rev, n, t) in variants.items():
                    t0 = time.time()
                    result = steady(run_once(trees[rev], command, Path(tmp) / f"{commits[rev]}_{n}_{t}_{i}", n, t))
                    runs[variant].append(result)
                    print(f"{variant} run {i + 1}: {result['time/step']:.2f} s a step ({time.time() - t0:.0f} s)",
                          flush=True)
        finally:
            for t in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], capture_output=True)
    report = table(list(variants), runs)
    print(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "command": "python benchmarks/step_time.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?",
        "cores": os.cpu_count(), "commits": commits, "runs": runs, "table": report}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
