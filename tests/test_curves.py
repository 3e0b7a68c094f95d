"""common/curves.py on synthetic metrics.jsonl: the picture's panels follow the metrics a run
logged, the time panel stacks the parts of a step, accuracy is drawn on the eval steps only, a
NaN or inf is marked, a run of one step has a readable axis, a run with nothing to draw writes
nothing and raises nothing, and the command line (two runs, bad input)."""

import json
import math
import subprocess
import sys

from matplotlib.figure import Figure
from matplotlib.image import imread

from common import curves
from tests.conftest import ROOT

ALL_PANELS = ["reward (rollout mean)", "held-out accuracy", "KL to the reference", "response length (tokens)",
              "step time (s)"]


def make_run(folder, steps=4, kl=True, lines=None):
    """A run folder: step 0 is the first eval, steps 2 and 4 eval again, as the scripts log."""
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": 0.2 * s, "response/length_mean": 40.0 - s, "time/rollout": 1.0,
                     "time/logprobs": 0.3, "time/train": 0.5, "time/sync": 0.1, "time/step": 2.0,
                     **({"kl/ref": 0.01 * s} if kl else {}), **({"eval/accuracy": 0.1 * s} if s % 2 == 0 else {})})
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) if lines is None else lines
    (folder / "metrics.jsonl").write_text(text)
    return rows


def test_write_curves_draws_every_panel(tmp_path):
    make_run(tmp_path)
    assert curves.write_curves(str(tmp_path)) == str(tmp_path / "curves.png")
    image = imread(tmp_path / "curves.png")
    assert image.shape == (2 * 320, 3 * 420, 4)  # 5 panels: 2 rows of 3 at 4.2 x 3.2 inches, 100 dpi
    assert (image[..., :3] < 0.5).mean() > 0.005  # lines and text, not a blank page
    assert curves.plot_runs([str(tmp_path)], str(tmp_path / "again.png")) == ALL_PANELS


def test_panels_follow_the_keys_present(tmp_path):
    make_run(tmp_path / "no-kl", kl=False)
    assert curves.plot_runs([str(tmp_path / "no-kl")], str(tmp_path / "a.png")) == \
        [p for p in ALL_PANELS if p != "KL to the reference"]
    # a run stopped after its first eval: the accuracy panel alone, one panel wide
    make_run(tmp_path / "step0", steps=0)
    assert curves.write_curves(str(tmp_path / "step0")) is not None
    assert imread(tmp_path / "step0" / "curves.png").shape == (320, 420, 4)


def test_accuracy_on_eval_steps_and_time_stacked():
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "time/rollout": 1.0, "time/train": 0.5, "time/step": 2.0},
            {"step": 2, "eval/accuracy": 0.4, "time/rollout": 1.0, "time/train": 0.7, "time/step": 2.0}]
    ax = Figure().subplots()
    curves.draw_metric(ax, [("run", rows)], "eval/accuracy", ["C0"])
    assert list(ax.lines[0].get_xdata()) == [0, 2] and list(ax.lines[0].get_ydata()) == [0.1, 0.4]
    ax = Figure().subplots()
    curves.draw_time(ax, [("run", rows)], ["C0"])
    assert ax.get_legend_handles_labels()[1] == ["rollout", "train", "step (total)"]
    assert len(ax.collections) == 2  # one band per part, stacked
    ax = Figure().subplots()  # several runs: each run's total step time, no parts
    curves.draw_time(ax, [("a", rows), ("b", rows)], ["C0", "C1"])
    assert [line.get_label() for line in ax.lines] == ["a", "b"] and not ax.collections


def panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_nan_and_inf_are_marked_and_the_axis_stays_on_the_finite_values(tmp_path):
    """A diverged metric (metrics.jsonl holds NaN and Infinity as json writes them): an x at each
    such step on the panel's top edge, explained in its legend; the y axis spans the finite values."""
    rows = make_run(tmp_path, steps=6)
    rows[3]["reward/mean"], rows[5]["reward/mean"], rows[4]["kl/ref"] = math.nan, math.inf, -math.inf
    make_run(tmp_path, lines="".join(json.dumps(r) + "\n" for r in rows))
    fig = curves.make_figure([str(tmp_path)])
    reward, kl = panel(fig, "reward (rollout mean)"), panel(fig, "KL to the reference")
    for ax, steps in ((reward, [3, 5]), (kl, [4])):
        marks = [line for line in ax.lines if line.get_marker() == "x"]
        assert [list(m.get_xdata()) for m in marks] == [steps]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["NaN or inf"]
    low, high = reward.get_ylim()
    assert 0 < low < 0.2 and 1.2 < high < 1.5  # the finite rewards: 0.2 .. 1.2
    assert panel(fig, "held-out accuracy").get_legend() is None  # nothing to mark


def test_a_run_of_one_step_has_a_readable_step_axis(tmp_path):
    """Step 0's evaluation and one step: every panel spans steps 0 and 1 with a margin, ticked at
    0 and 1 (a single point alone would get limits 0.95 .. 1.05 and ticks in between)."""
    make_run(tmp_path, steps=1)
    fig = curves.make_figure([str(tmp_path)])
    for ax in [ax for ax in fig.axes if ax.get_visible()]:
        low, high = ax.get_xlim()
        assert low == -0.5 and high == 1.5, ax.get_title()
        assert [t for t in ax.get_xticks() if low <= t <= high] == [0, 1], ax.get_title()


def test_nothing_to_draw_writes_nothing(tmp_path, capsys):
    assert curves.write_curves(str(tmp_path / "never-started")) is None  # no metrics.jsonl at all
    make_run(tmp_path / "empty", lines="")
    make_run(tmp_path / "cut", lines='{"step": 1, "reward/me')  # killed while writing its first line
    for name in ("empty", "cut"):
        assert curves.write_curves(str(tmp_path / name)) is None
        assert not (tmp_path / name / "curves.png").exists()
    make_run(tmp_path / "run")
    assert curves.write_curves(str(tmp_path / "run"), str(tmp_path / "missing" / "c.png")) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("warning: could not draw") and "c.png" in out[0]


def test_cli_two_runs_side_by_side(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "grpo__sort__1")
    make_run(tmp_path / "ppo__sort__1", kl=False)
    monkeypatch.chdir(tmp_path)
    assert curves.main(["grpo__sort__1", "ppo__sort__1/"]) == 0  # several runs: ./curves.png
    assert capsys.readouterr().out.strip() == "curves.png"
    assert imread(tmp_path / "curves.png").shape == (2 * 320 + 40, 3 * 420, 4)  # + the runs' legend
    assert curves.main(["ppo__sort__1", "-o", "one.png"]) == 0
    assert imread(tmp_path / "one.png").shape == (2 * 320, 3 * 420, 4)
    assert curves.main(["grpo__sort__1"]) == 0  # one run: into its folder
    assert (tmp_path / "grpo__sort__1" / "curves.png").exists()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    make_run(tmp_path / "run")
    (tmp_path / "not-a-run").mkdir()
    for bad, why in ((tmp_path / "nope", "no such folder"), (tmp_path / "not-a-run", "no metrics.jsonl")):
        p = subprocess.run([sys.executable, "-m", "common.curves", str(tmp_path / "run"), str(bad)],
                           cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and p.stdout == ""
        assert p.stderr.count("\n") == 1 and why in p.stderr and str(bad) in p.stderr
    assert not (tmp_path / "run" / "curves.png").exists()
