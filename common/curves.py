"""Curves of a run: what its metrics.jsonl says, as one picture.

    python -m common.curves RUN_DIR [RUN_DIR ...] [-o OUT.png]

Panels against step: the rollouts' mean reward, held-out accuracy (on the eval steps), KL to
the reference, response length, tool calls (multi-turn runs) and where a step's time goes (stacked parts for one run, the
total per run for several). A panel whose metric no run logged is left out; every panel spans
the runs' steps. A NaN or inf is an x on the panel's top edge. One run folder draws
RUN_DIR/curves.png; several draw side by side, one color each, into ./curves.png.
The scripts call write_curves when a run ends, and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (metric, panel title); the time panel comes last and is drawn by draw_time
PANELS = [("reward/mean", "reward (rollout mean)"), ("eval/accuracy", "held-out accuracy"),
          ("kl/ref", "KL to the reference"), ("response/length_mean", "response length (tokens)"),
          ("env/tool_calls_mean", "tool calls per episode"), ("time/step", "step time (s)")]
COLS = 3


def read_metrics(run_dir: str) -> list[dict]:
    """The lines of RUN_DIR/metrics.jsonl; none when the file is missing, and a line cut short
    (a run killed while writing it) is skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """Steps and values of the rows that logged `key` (eval metrics exist on eval steps only)."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def draw_metric(ax, runs: list[tuple[str, list[dict]]], key: str, colors) -> None:
    """One line per (label, rows) run, over the steps that logged `key`. A NaN or inf value (a
    diverged run) is a gap in the line and an x on the panel's top edge at its step: marked, and
    the y axis stays on the finite values."""
    for (label, rows), color in zip(runs, colors):
        x, y = series(rows, key)
        finite = [math.isfinite(v) for v in y]
        # markers where points are few or far apart: eval steps, a run of one step, or between gaps
        ax.plot(x, [v if ok else math.nan for v, ok in zip(y, finite)], color=color, label=label, lw=1.5, ms=3,
                marker="o" if key == "eval/accuracy" or len(x) == 1 or not all(finite) else None)
        if not all(finite):  # x in steps, y in the panel's height (1: its top edge)
            ax.plot([s for s, ok in zip(x, finite) if not ok], [1.0] * finite.count(False), "x", color=color,
                    ms=8, mew=2, clip_on=False, transform=ax.get_xaxis_transform(), label="NaN or inf")
    marks = [line for line in ax.lines if line.get_label() == "NaN or inf"]
    if marks:
        ax.legend(handles=marks[:1], fontsize=7, loc="lower right")


def draw_time(ax, runs: list[tuple[str, list[dict]]], colors) -> None:
    """One run: its time/* parts stacked, under the total. Several: each run's total."""
    if len(runs) > 1:
        draw_metric(ax, runs, "time/step", colors)
        return
    rows = runs[0][1]
    parts = list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/") and k != "time/step"))
    timed = [r for r in rows if parts and all(isinstance(r.get(k), (int, float)) for k in parts)]
    if timed:
        ax.stackplot([r["step"] for r in timed], *[[r[k] for r in timed] for k in parts],
                     labels=[k.removeprefix("time/") for k in parts], alpha=0.7)
    draw_metric(ax, [("step (total)", rows)], "time/step", ["black"])
    ax.set_ylim(0, 1.4 * ax.get_ylim()[1])  # room above the stack for the legend
    ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)


def plot_runs(run_dirs: list[str], path: str) -> list[str]:
    """Draw the runs' panels into `path` (a PNG); returns the titles of the panels drawn, and
    writes nothing (returns []) when no run logged any of the metrics."""
    fig = make_figure(run_dirs)
    if fig is None:
        return []
    fig.savefig(path)
    return [ax.get_title() for ax in fig.axes if ax.get_visible()]


def make_figure(run_dirs: list[str]):
    """The runs' panels, a matplotlib Figure (an Axes per panel, titled); None when no run logged
    any of the metrics."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    runs = [(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in run_dirs]
    panels = [(key, title) for key, title in PANELS if any(series(rows, key)[0] for _, rows in runs)]
    if not panels:
        return None
    steps = [r["step"] for _, rows in runs for r in rows]
    # every panel over the runs' steps, with a margin: a run of one step (a point) gets a readable axis
    margin = max(0.05 * (max(steps) - min(steps)), 0.5)
    colors = [matplotlib.colormaps["tab10"].colors[i % 10] for i in range(len(runs))]
    n_rows, n_cols = math.ceil(len(panels) / COLS), min(len(panels), COLS)
    legend_h = 0.4 if len(runs) > 1 else 0.0  # inches below the panels for the runs' legend
    # a Figure, not pyplot: it draws with Agg and leaves the backend of the calling process alone
    fig = Figure(figsize=(4.2 * n_cols, 3.2 * n_rows + legend_h), dpi=100)
    axes = list(fig.subplots(n_rows, n_cols, squeeze=False).flat)
    for ax, (key, title) in zip(axes, panels):
        if key == "time/step":
            draw_time(ax, runs, colors)
        else:
            draw_metric(ax, runs, key, colors)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(min(steps) - margin, max(steps) + margin)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:  # the empty places of the last row
        ax.set_visible(False)
    if len(runs) > 1:
        handles = [Line2D([], [], color=c) for c in colors]
        fig.legend(handles, [label for label, _ in runs], loc="lower center", ncol=min(len(runs), 4),
                   frameon=False)
    fig.suptitle(runs[0][0] if len(runs) == 1 else f"{len(runs)} runs", fontsize=11)
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    return fig


def write_curves(run_dir: str, path: str | None = None) -> str | None:
    """RUN_DIR/curves.png (or `path`) from the run's metrics; returns the path written, or None
    when there is nothing to draw or drawing failed. Never raises: a plot must not lose a run."""
    path = path or os.path.join(run_dir, "curves.png")
    try:
        return path if plot_runs([run_dir], path) else None
    except Exception as e:  # noqa: BLE001 - any plotting failure is one line, not a traceback
        print(f"warning: could not draw {path}: {type(e).__name__}: {e}")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.curves", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (each holds metrics.jsonl)")
    parser.add_argument("-o", "--output", metavar="OUT.png",
                        help="default: RUN_DIR/curves.png for one run, ./curves.png for several")
    args = parser.parse_args(argv)
    for d in args.run_dirs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            why = "no metrics.jsonl in it (not a run folder?)" if os.path.isdir(d) else "no such folder"
            print(f"error: {d}: {why}", file=sys.stderr)
            return 2
    out = args.output or (os.path.join(args.run_dirs[0], "curves.png") if len(args.run_dirs) == 1 else "curves.png")
    try:
        drawn = plot_runs(args.run_dirs, out)
    except OSError as e:  # an unreadable metrics file, an output folder that does not exist
        print(f"error: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not drawn:
        print(f"error: nothing to draw: no step in {', '.join(args.run_dirs)} logged a metric", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
