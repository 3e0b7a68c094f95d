"""benchmarks/: the aggregation against hand computations on synthetic metrics, the gradient
variance statistics (and their bootstrap) on hand-computed cases, the lecture's tables, sentences
and plot for both tasks from synthetic runs, the README update, and the quick mode end to end (a
table with one row per algorithm, plots with one line per algorithm, the lecture on sort and
sort-partial, reuse, the report again from results.json). No timing thresholds."""

import json
import math
import os
import struct
import subprocess
import sys

import pytest
import torch

from benchmarks import gradient_variance
from benchmarks import run as bench
from tests.conftest import ROOT, pythonpath, vllm_installed


# ----------------------------------------------------------------- synthetic metrics.jsonl
def step(s, t, reward, eval_acc=None, tps=100.0, mem=1.0):
    """One step line: rollout 50%, log-probs 20%, update 20%, sync 5% of t."""
    m = {"step": s, "time/step": t, "time/rollout": 0.5 * t, "time/logprobs": 0.2 * t, "time/train": 0.2 * t,
         "time/sync": 0.05 * t, "throughput/tokens_per_s": tps, "memory/peak_gib": mem, "reward/mean": reward}
    if eval_acc is not None:
        m["eval/accuracy"] = eval_acc
    return m


SEEDS = {
    0: [{"step": 0, "eval/accuracy": 0.2}, step(1, 1.0, 0.3, 0.5, tps=100.0, mem=1.0),
        step(2, 2.0, 0.5, 0.9, tps=50.0, mem=1.5)],
    1: [{"step": 0, "eval/accuracy": 0.2}, step(1, 1.0, 0.4, 0.85), step(2, 1.0, 0.6, 0.7)],
    2: [{"step": 0, "eval/accuracy": 0.2}, step(1, 3.0, 0.1, 0.3), step(2, 3.0, 0.2, 0.4)],
}


def write_run(run_dir, metrics):
    os.makedirs(run_dir, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
    (run_dir / "summary.json").write_text(json.dumps({"eval/accuracy_end": metrics[-1]["eval/accuracy"]}))


def test_run_stats_by_hand(tmp_path):
    write_run(tmp_path, SEEDS[0])
    s = bench.run_stats(bench.read_metrics(tmp_path), target=0.8)
    assert (s["accuracy_start"], s["accuracy_end"], s["accuracy_peak"]) == (0.2, 0.9, 0.9)
    assert s["steps_to_target"] == 2 and s["time_to_target_s"] == pytest.approx(3.0)
    assert s["train_time_s"] == pytest.approx(3.0) and s["steps_per_s"] == pytest.approx(2 / 3)
    assert s["tokens_per_s"] == pytest.approx((100 * 1.0 + 50 * 2.0) / 3.0)  # tokens / time, not a mean of rates
    assert s["peak_memory_gib"] == 1.5
    assert s["step_ms"] == pytest.approx(1500.0)
    assert s["time_share"] == pytest.approx({"rollout": 0.5, "logprobs": 0.2, "train": 0.2, "sync": 0.05,
                                             "other": 0.05})
    assert s["sync_ms_median"] == pytest.approx(1000 * (0.05 + 0.1) / 2)
    assert s["curves"]["eval_step"] == [0, 1, 2] and s["curves"]["eval_time_s"] == pytest.approx([0.0, 1.0, 3.0])
    assert s["curves"]["time_s"] == pytest.approx([1.0, 3.0]) and s["curves"]["reward_mean"] == [0.3, 0.5]


def test_aggregate_over_seeds_by_hand():
    per_seed = [bench.run_stats(SEEDS[k], target=0.8) for k in (0, 1, 2)]
    a = bench.aggregate(per_seed)
    assert a["accuracy_end"]["mean"] == pytest.approx((0.9 + 0.7 + 0.4) / 3)
    assert a["accuracy_end"]["std"] == pytest.approx(math.sqrt(((0.9 - 2 / 3) ** 2 + (0.7 - 2 / 3) ** 2
                                                                 + (0.4 - 2 / 3) ** 2) / 2))  # ddof 1
    # seed 2 never reaches 0.8: steps / time to target over the two seeds that did
    assert a["steps_to_target"] == {"mean": 1.5, "std": pytest.approx(math.sqrt(0.5)), "n": 2, "reached": 2,
                                    "seeds": 3}
    assert a["time_to_target_s"]["mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert a["steps_per_s"]["mean"] == pytest.approx((2 / 3 + 1.0 + 1 / 3) / 3)
    assert a["time_share"]["rollout"] == pytest.approx(0.5) and a["time_share"]["other"] == pytest.approx(0.05)
    band = a["curves"]["accuracy_vs_step"]
    assert band["step"] == [0, 1, 2] and band["x"] == [0, 1, 2]
    assert band["mean"] == pytest.approx([0.2, (0.5 + 0.85 + 0.3) / 3, (0.9 + 0.7 + 0.4) / 3])
    assert band["min"] == [0.2, 0.3, 0.4] and band["max"] == [0.2, 0.85, 0.9]
    by_time = a["curves"]["accuracy_vs_time"]  # x: mean over seeds of the training time at that step
    assert by_time["x"] == pytest.approx([0.0, (1 + 1 + 3) / 3, (3 + 2 + 6) / 3])
    reward = a["curves"]["reward_vs_step"]
    assert reward["step"] == [1, 2] and reward["mean"] == pytest.approx([0.8 / 3, 1.3 / 3])


def test_tables_and_plots_from_run_folders(tmp_path):
    configs = [bench.BY_NAME["reinforce"], bench.BY_NAME["grpo"]]
    for cfg in configs:
        for seed, metrics in SEEDS.items():
            write_run(tmp_path / "runs" / cfg.name / f"seed{seed}", metrics)
    results = bench.collect(configs + [bench.BY_NAME["ppo"]], [0, 1, 2], tmp_path / "runs", target=0.8)
    assert results["reinforce"]["status"] == "ok" and results["ppo"]["status"] == "failed"  # no run folders
    assert "curves" not in results["reinforce"]["per_seed"][0]  # per seed only the numbers: the plots show curves
    table = bench.comparison_table(results, 0.8).splitlines()
    assert len(table) == 2 + 3 and all(line.count("|") == table[0].count("|") for line in table)
    assert "steps to 0.8" in table[0] and "tokens/s" in table[0] and "peak mem. (GiB)" in table[0]
    row = table[2].split("|")
    assert row[1].strip() == "REINFORCE" and row[4].strip() == "0.20 ± 0.00" and row[5].strip() == "0.67 ± 0.25"
    assert row[7].strip() == "1.5 ± 0.7 (2/3 seeds)"
    assert "failed" in table[4]
    times = bench.time_table(results).splitlines()
    assert len(times) == 2 + 2 and "50.0%" in times[2] and "91.7" in times[2]  # median sync (75, 50, 150 ms), mean
    curves = {r["label"]: r["aggregate"]["curves"] for r in results.values() if r.get("aggregate")}
    drawn = bench.plot_curves(curves, tmp_path / "curves.png", "test", target=0.8)
    assert drawn == [["REINFORCE", "GRPO"]] * 4
    assert png_size(tmp_path / "curves.png") == (1000, 740)


# ----------------------------------------------------------------- gradient variance
def test_every_algorithm_script_is_found_and_only_rows_merge(tmp_path):
    """The comparison lists every top-level script with a compute_loss (none registered by hand);
    --only NAME re-measures those rows alone and merges them into results.json, which records when,
    and refuses a mode whose settings changed since."""
    scripts = sorted(p.name for p in ROOT.glob("*.py") if "\ndef compute_loss(" in p.read_text())
    assert [c.script for c in bench.ALGORITHMS] == scripts and "sapo.py" in scripts
    assert bench.BY_NAME["ppo"].label == "PPO" and bench.BY_NAME["reinforce"].label == "REINFORCE"
    old = {"settings": {"steps": 30}, "runs": {"grpo": {"v": 1}, "sapo": {"v": 1}}, "environment": {"date": "then"}}
    new = {"settings": {"steps": 30}, "runs": {"sapo": {"v": 2}}, "environment": {"date": "now"}, "elapsed_s": 60.0,
           "mode": "full"}
    merged = bench.merge_rows(json.loads(json.dumps(old)), new, ["sapo"])
    assert merged["runs"] == {"grpo": {"v": 1}, "sapo": {"v": 2}} and merged["environment"] == {"date": "then"}
    assert merged["remeasured"] == [{"names": ["sapo"], "environment": {"date": "now"}, "elapsed_s": 60.0}]
    with pytest.raises(SystemExit, match="settings changed"):
        bench.merge_rows(old, {**new, "settings": {"steps": 100}}, ["sapo"])


def test_variance_statistics_by_hand():
    g = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 3.0]])
    s = gradient_variance.variance_stats(g)
    # mean (2, 1); squared deviations 2 + 2 + 4 over N - 1 = 2
    assert s["trace_cov"] == pytest.approx(4.0)
    assert s["mean_grad_norm"] == pytest.approx(math.sqrt(5.0))
    assert s["signal_sq"] == pytest.approx(5.0 - 4.0 / 3)  # |mean|^2 - tr Cov / N
    assert s["relative_variance"] == pytest.approx(4.0 / (11 / 3))
    cos = [2.5 / math.sqrt(8.5), 1 / math.sqrt(2), 2 / math.sqrt(13)]  # each against the other two's mean
    assert s["cosine_to_mean"] == pytest.approx(sum(cos) / 3)
    both = gradient_variance.compare_estimators({"none": g, "scaled": 2 * g})
    assert both["scaled"]["relative_variance_vs_reference"] == pytest.approx(1.0)  # scale-free
    assert both["scaled"]["trace_cov_vs_reference"] == pytest.approx(4.0)
    assert both["scaled"]["cosine_mean_vs_reference"] == pytest.approx(1.0)

    # the bootstrap's relative variance from the Gram matrix: drawing every batch once is the above
    G = gradient_variance.gram(g)
    rel = gradient_variance.relative_variance_resampled(G, torch.tensor([[1.0, 1, 1], [2, 1, 0]]))
    # {g0, g0, g1} = {(1,0), (1,0), (3,0)}: mean (5/3, 0), squared deviations 4/9 + 4/9 + 16/9 over 2 = 4/3,
    # signal 25/9 - (4/3) / 3 = 7/3
    assert rel.tolist() == pytest.approx([4.0 / (11 / 3), (4 / 3) / (7 / 3)])
    # the ratio to the reference, resampled: 1 for a rescaled reference; covers the plain ratio otherwise
    g = torch.randn(20, 5, generator=torch.Generator().manual_seed(0)) + 1.0
    noisier = g + 2 * torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    grams = {"none": gradient_variance.gram(g), "scaled": gradient_variance.gram(3 * g),
             "noisier": gradient_variance.gram(noisier)}
    intervals = gradient_variance.bootstrap_ratio_intervals(grams, resamples=500)
    assert intervals["none"] == pytest.approx((1.0, 1.0)) and intervals["scaled"] == pytest.approx((1.0, 1.0))
    ratio = gradient_variance.variance_stats(noisier)["relative_variance"] / gradient_variance.variance_stats(g)[
        "relative_variance"]
    assert intervals["noisier"][0] < ratio < intervals["noisier"][1] and intervals["noisier"][0] > 1


def test_findings_are_generated_from_the_numbers():
    assert bench.ratio_phrase(0.25, (0.1, 0.5)).startswith("4.0 times lower (ratio 0.25, 95% bootstrap "
                                                                       "interval 0.10-0.50")
    assert bench.ratio_phrase(2.0, (1.5, 3.0)).startswith("2.0 times higher")
    assert bench.ratio_phrase(0.5, (0.2, 1.3)).startswith("no clear difference")
    assert gradient_variance.reward_kind(torch.tensor([0.0, 1.0, 1.0])) == "0/1"
    assert gradient_variance.reward_kind(torch.tensor([0.0, 0.5, 1.0])) == "partial credit"
    d = {"estimators": {"none": {"relative_variance": 8.0, "relative_variance_vs_reference": 1.0,
                                 "ratio_interval": [1.0, 1.0]},
                        "batch-mean": {"relative_variance": 2.0, "relative_variance_vs_reference": 0.25,
                                       "ratio_interval": [0.1, 0.5]}},
         "score_norms": gradient_variance.score_norm_stats([(1.0, 2.0), (0.0, 6.0), (0.0, 2.0)])}
    lines = bench.variance_findings(d)
    assert lines[0] == ("REINFORCE, batch-mean baseline: relative gradient variance 2 against 8 without a baseline, "
                        "4.0 times lower (ratio 0.25, 95% bootstrap interval 0.10-0.50).")
    assert lines[1].startswith("The variance-optimal constant baseline b* = 0.20 against the mean reward 0.33 of the "
                               "same 3 completions (b*/mean 0.60; b* − mean R = Cov(R, ‖∇ log p‖²) / E‖∇ log p‖² = "
                               "-0.13): reward and ‖∇ log p(y)‖² are negatively correlated, so a baseline at the "
                               "mean reward is above the variance-optimal constant; mean ‖∇ log p‖²: 2 for R = 1, "
                               "4 for R = 0.")


def test_plateau_and_ranking_by_hand():
    curve = {"step": [0, 5, 10, 15, 20], "mean": [0.1, 0.3, 0.58, 0.6, 0.59]}
    assert bench.plateau_step(curve) == 10  # 0.58 >= 0.95 * 0.6
    assert bench.plateau_step({"step": [0, 5], "mean": [0.0, 0.0]}) is None

    def result(label, ends):
        return {"label": label, "aggregate": {}, "per_seed": {i: {"accuracy_end": e} for i, e in enumerate(ends)}}

    results = {"a": result("A", [0.5, 0.55, 0.6]), "b": result("B", [0.2, 0.3, 0.45]),
               "c": result("C", [0.4, 0.25, 0.35])}
    assert bench.ranking_findings(results) == [
        "Ranked by final held-out accuracy: A > C, C ≈ B ('>': every seed of the first ends above every seed of the "
        "second; '≈': their seeds overlap). 1 of 2 neighbouring gaps are larger than the spread over 3 seeds."]


def test_estimators_use_the_scripts_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    mask = torch.ones(8, 2)
    adv = gradient_variance.estimator_advantages(rewards, mask, group_size=4)
    col = {k: v[:, 0] for k, v in adv.items()}
    torch.testing.assert_close(col["none"], rewards)
    torch.testing.assert_close(col["batch-mean"], rewards - 0.375)
    torch.testing.assert_close(col["rloo"], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.5 + 1 / 6, 0.5 + 1 / 6,
                                                          -2 / 3, -2 / 3]))
    std1, std2 = torch.tensor([1.0, 0, 0, 0]).std(), torch.tensor([1.0, 1, 0, 0]).std()
    torch.testing.assert_close(col["grpo"], torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
                               / torch.tensor([std1] * 4 + [std2] * 4).add(1e-4))
    torch.testing.assert_close(col["dr-grpo"], col["rloo"] * 3 / 4)  # R - mean = (K-1)/K (R - mean of others)
    # with ratio 1 every loss is -agg(A * logp): GRPO's clipped surrogate gives REINFORCE's gradient
    logprobs = torch.randn(8, 2, requires_grad=True)
    grads = {}
    for name in ("rloo", "dr-grpo"):
        loss = gradient_variance.estimator_loss(name, logprobs, adv[name], mask, "seq-mean-token-sum")
        grads[name] = torch.autograd.grad(loss, logprobs)[0]
    torch.testing.assert_close(grads["dr-grpo"], grads["rloo"] * 3 / 4)
    torch.testing.assert_close(grads["rloo"], -adv["rloo"] / 8)


def test_optimal_baseline():
    s = gradient_variance.score_norm_stats([(1.0, 2.0), (0.0, 6.0), (0.0, 2.0)])
    assert s["optimal_baseline"] == pytest.approx(2.0 / 10.0)  # E[R |s|^2] / E[|s|^2]
    assert s["mean_sq_norm_reward_1"] == 2.0 and s["mean_sq_norm_reward_0"] == 4.0
    assert s["mean_sq_norm_partial"] is None and s["count_partial"] == 0
    s = gradient_variance.score_norm_stats([(1.0, 2.0), (0.0, 6.0), (0.0, 2.0), (0.5, 4.0)])  # partial credit
    assert s["optimal_baseline"] == pytest.approx((2.0 + 0.5 * 4.0) / 14.0) and s["mean_reward"] == 0.375
    assert s["mean_sq_norm_partial"] == 4.0 and s["count_partial"] == 1 and s["mean_sq_norm_reward_0"] == 4.0


# ----------------------------------------------------------------- the lecture on two tasks
def scaled(metrics, factor):
    """The same run with every accuracy and reward times factor."""
    out = []
    for m in metrics:
        m = dict(m)
        for k in ("eval/accuracy", "reward/mean"):
            if k in m:
                m[k] *= factor
        out.append(m)
    return out


def fake_variance(tasks):
    """gradient_variance.py's results.json entry: the relative variance of each estimator at the
    given ratio to no baseline's, the same b* diagnostics on every task."""
    est = {name: {"relative_variance": 3.0 * ratio, "relative_variance_vs_reference": ratio,
                  "ratio_interval": [ratio * 0.8, ratio * 1.2], "cosine_to_mean": 0.5}
           for name, ratio in (("none", 1.0), ("batch-mean", 0.5), ("rloo", 0.4), ("grpo", 2.0), ("dr-grpo", 0.4))}
    score_norms = gradient_variance.score_norm_stats([(1.0, 2.0), (0.0, 6.0), (0.0, 2.0)])
    settings = {"batches": 4, "prompts": 4, "completions": 4, "model": "models/tiny-sort", "temperature": 1.0,
                "loss_agg": "seq-mean-token-sum", "score_norm_batches": 1}
    return {"settings": settings, "parameters": 1000,
            "tasks": {t: {"reward_kind": kind, "estimators": est, "score_norms": score_norms, "mean_reward": 0.33,
                          "partial_frac": 0.0, "groups_all_equal_frac": 0.25,
                          "shared_samples_with": [u for u in tasks if u != t]} for t, kind in tasks.items()}}


def test_lecture_on_both_tasks_from_run_folders(tmp_path):
    runs = tmp_path / "runs"
    lecture = [c for c, _ in bench.LECTURE]
    for cfg in lecture:  # sort: the main comparison's runs
        for seed, metrics in SEEDS.items():
            write_run(runs / cfg.name / f"seed{seed}", metrics)
    partial = bench.lecture_configs(["none", "batch-mean", "rloo", "grpo"])
    assert [c.name for c in partial] == [f"sort-partial/{c.name}" for c in lecture]
    assert partial[0].flags == ("--baseline", "none", "--task", "sort-partial")
    for cfg in partial:  # no baseline: every seed at 0.4x, below every seed of the others
        factor = 0.4 if cfg.name.endswith("no-baseline") else 1.0
        for seed, metrics in SEEDS.items():
            write_run(runs / cfg.name / f"seed{seed}", scaled(metrics, factor))
    data = {"runs": bench.collect(lecture + partial, [0, 1, 2], runs),
            "gradient_variance": fake_variance({"sort": "0/1", "sort-partial": "partial credit"})}
    data = json.loads(json.dumps(data))  # as read back from results.json (seeds become string keys)
    task_rows = {t: bench.lecture_rows(data, t) for t in ("sort", "sort-partial")}
    assert [r["estimator"] for r in task_rows["sort-partial"]] == ["none", "batch-mean", "rloo", "grpo", "dr-grpo"]
    sections = bench.lecture_md(data).split("#### ")
    assert sections[1].startswith("`sort`: 0/1 reward") and sections[2].startswith("`sort-partial`: partial credit")
    for section in sections[1:3]:
        table = [line for line in section.splitlines() if line.startswith("|")]
        assert len(table) == 2 + 5 and all(line.count("|") == table[0].count("|") for line in table)
        assert "| REINFORCE, batch-mean baseline | 0.67 ± 0.25 |" in section and "0.50x (0.40-0.60)" in section
        assert "- REINFORCE, batch-mean baseline: relative gradient variance 1.5 against 3 without" in section
    # sort: identical runs overlap; sort-partial: no baseline below every seed of the other three
    assert ("- Its seeds overlap those of REINFORCE with the batch-mean baseline, RLOO and GRPO (no difference "
            "beyond the spread over 3 seeds).") in sections[1]
    assert ("- Every seed of REINFORCE without a baseline ends below every seed of REINFORCE with the batch-mean "
            "baseline, RLOO and GRPO.") in sections[2]
    assert sections[3].startswith("How the gradient variance was measured") and "| `sort-partial` | partial credit |" \
        in sections[3]
    drawn = bench.plot_lecture(task_rows, tmp_path / "lecture.png")
    labels = [bench.LABEL[name] for _, name in bench.LECTURE]
    assert drawn["lines"] == {"sort": [labels, labels], "sort-partial": [labels, labels]}
    assert drawn["bars"]["sort-partial"] == ["batch mean", "RLOO", "GRPO", "Dr. GRPO"]
    assert png_size(tmp_path / "lecture.png") == (1500, 770)


def test_update_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nintro\n{bench.BEGIN}\nold report\n{bench.END}\n\n## after\n")
    bench.update_readme(readme, "## Results\n\n![curves](curves.png)\n", tmp_path / "results" / "full")
    assert readme.read_text() == (f"# title\n\nintro\n{bench.BEGIN}\n## Results\n\n![curves](results/full/curves.png)\n"
                                  f"\n{bench.END}\n\n## after\n")
    # another mode's report goes into its own block and leaves full mode's alone
    begin, end = bench.markers("hard")
    readme.write_text(readme.read_text() + f"{begin}\nold\n{end}\n")
    bench.update_readme(readme, "## Hard\n", tmp_path / "results" / "hard", "hard")
    assert readme.read_text().endswith(f"## after\n{begin}\n## Hard\n\n{end}\n")
    assert "![curves](results/full/curves.png)" in readme.read_text()
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no '<!-- benchmarks:begin -->'"):
        bench.update_readme(readme, "report", tmp_path)


# ----------------------------------------------------------------- quick mode end to end
def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def run_benchmark(out, *flags):
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--mode", "quick", "--out", str(out),
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


def first_table(section: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first markdown table in `section`."""
    lines = []
    for line in section.splitlines():
        if line.startswith("|"):
            lines.append([c.strip() for c in line.strip("|").split("|")])
        elif lines:
            break
    return lines[0], lines[2:]


@pytest.mark.slow
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "quick"
    r = run_benchmark(out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = (out / "report.md").read_text()
    assert "Command: `python benchmarks/run.py --mode quick" in report and "Measured" in report

    # the table: one row per algorithm, the expected columns, numbers everywhere
    header, rows = first_table(report.split("### The algorithms")[1])
    for column in ["algorithm", "held-out acc. start", "end", "steps to 0.8", "train time to 0.8 (s)", "steps/s",
                   "tokens/s", "peak mem. (GiB)"]:
        assert column in header, header
    assert [row[0] for row in rows] == [c.label for c in bench.ALGORITHMS]
    for cells in (dict(zip(header, row)) for row in rows):
        assert 0 <= float(cells["held-out acc. start"]) <= 1 and float(cells["steps/s"]) > 0, cells
    _, time_rows = first_table(report.split("### Where a training step's time goes")[1])
    assert len(time_rows) == len(bench.ALGORITHMS)
    for cfg in bench.ALGORITHMS:
        assert not (out / "runs" / cfg.name / "seed0" / "final").exists()  # no model folders kept

    # every number is in results.json, with where and how it was measured; the plots
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["cpu_cores"] >= 1 and results["environment"]["git_commit"]
    names = [c.name for c in bench.ALGORITHMS + [bench.NO_BASELINE]] + ["sort-partial/reinforce-no-baseline"]
    assert list(results["runs"]) == names
    for name in names:
        assert results["runs"][name]["status"] == "ok", name
        assert len(results["runs"][name]["aggregate"]["curves"]["accuracy_vs_step"]["x"]) == 3  # steps 0, 1, 2
    assert (out / "runs" / "sort-partial" / "reinforce-no-baseline" / "seed0" / "metrics.jsonl").exists()
    assert png_size(out / "curves.png") == (1000, 740) and png_size(out / "time_breakdown.png")[0] == 1000
    assert png_size(out / "lecture.png") == (1500, 770)
    if vllm_installed():
        engines = results["rollout_engines"]["sizes"][0]
        assert engines["vllm"]["completions_per_s"] > 0 and engines["transformers"]["completions_per_s"] > 0
    else:  # the engines part compares vLLM with the transformers engine: said, not failed
        assert results["rollout_engines"] == {"not_run": "vLLM is not installed here"}
        assert "Not run: vLLM is not installed here." in report
    variance = results["gradient_variance"]["tasks"]
    assert list(variance) == ["sort", "sort-partial"]
    for task, d in variance.items():
        assert set(d["estimators"]) == {"none", "batch-mean", "rloo", "grpo", "dr-grpo"}, task
        assert d["shared_samples_with"] == [t for t in variance if t != task]  # the same completions
        assert d["score_norms"]["optimal_baseline"] is not None
    assert variance["sort"]["reward_kind"] == "0/1"
    assert variance["sort-partial"]["mean_reward"] >= variance["sort"]["mean_reward"]  # partial credit >= 0/1
    for task in ("sort", "sort-partial"):
        section = report.split(f"#### `{task}`")[1].split("####")[0]
        table = [line for line in section.splitlines() if line.startswith("|")]
        assert len(table) == 2 + 5, section  # four estimators and Dr. GRPO's gradient variance
        assert "- REINFORCE, batch-mean baseline: relative gradient variance" in section
    assert "not run" in report.split("#### `sort-partial`")[1]  # the three estimators quick mode skips there

    # the same command again reuses every finished run and part: 8 runs and 2 parts (1 without vLLM)
    r = run_benchmark(out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.count(": reused") == len(names) + (2 if vllm_installed() else 1), r.stdout
    # and the report again from results.json alone is the same report
    report = (out / "report.md").read_text()
    r = run_benchmark(out, "--report-only")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (out / "report.md").read_text() == report


def test_step_time_medians_of_steady_steps_by_hand():
    from benchmarks import step_time

    steps = [{"step": 1, "time/step": 9.0, "time/train": 5.0, "response/length_mean": 10.0},
             {"step": 2, "time/step": 2.0, "time/train": 1.0, "response/length_mean": 20.0},
             {"step": 3, "time/step": 4.0, "time/train": 3.0, "response/length_mean": 30.0},
             {"step": 4, "time/step": 3.0, "time/train": 2.0, "response/length_mean": 40.0}]
    assert step_time.steady(steps) == {"time/step": 3.0, "time/train": 2.0, "response/length_mean": 30.0}
    runs = {"old": [{"time/step": 6.0, "time/train": 4.0, "response/length_mean": 30.0}],
            "new": [{"time/step": 4.0, "time/train": 2.0, "response/length_mean": 30.0},
                    {"time/step": 2.0, "time/train": 1.0, "response/length_mean": 30.0}]}
    lines = step_time.table(["old", "new"], runs).splitlines()
    assert lines[0] == "| variant | runs | step (s) | train (s) | mean completion (tokens) | speed-up |"
    assert lines[2] == "| old | 1 | 6.00 | 4.0 | 30.0 | 1.00x |"
    assert lines[3] == "| new | 2 | 3.00 | 1.5 | 30.0 | 2.00x |"



@pytest.mark.parametrize("threads, expected", [("all", None), ("1", "1")])
def test_step_time_runs_each_variant_with_its_thread_count(tmp_path, monkeypatch, threads, expected):
    """--threads: OMP_NUM_THREADS as the variant says, or unset (all: torch's default) even where the
    caller's environment sets it."""
    from benchmarks import step_time

    seen = {}

    def fake_run(cmd, cwd, env, stdout, stderr):
        seen["threads"] = env.get("OMP_NUM_THREADS")
        out = tmp_path / "run"
        assert cmd[-2:] == ["--output-dir", str(out)]
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "time/step": 1.0}\n')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setattr(step_time.subprocess, "run", fake_run)
    assert step_time.run_once(tmp_path, ["grpo.py"], tmp_path / "run", threads=threads) == [
        {"step": 1, "time/step": 1.0}]
    assert seen["threads"] == expected

@pytest.mark.parametrize("every, synced", [(1, [0, 1, 2, 3, 4, 5, 6]), (3, [0, 3, 6]), (0, [0])])
def test_off_policy_syncs_on_schedule(every, synced):
    """benchmarks/off_policy.py: main's first sync (into the fresh engine) always happens, then the
    one after every K-th step (K 0: never again, a lost sync)."""
    from benchmarks.off_policy import synced_on_schedule

    done = []
    sync = synced_on_schedule(lambda llm, policy: done.append(policy), every)
    for trained in range(7):  # main's call, then one after each of 6 steps
        sync(None, trained)
    assert done == synced


@pytest.mark.slow
def test_off_policy_end_to_end(tmp_path):
    """Two steps, the engine synchronized every second: the stale run's second step samples from
    the initial weights (a gap far above the synced run's), both end synchronized for the final
    evaluation, and the table and JSON say so."""
    out = tmp_path / "runs"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "off_policy.py"), "--seeds", "0", "--steps", "2",
                        "--sync-every", "2", "--precision", "fp32", "--modes", "off", "--out", str(out),
                        "--json", str(tmp_path / "r.json")], cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath()},
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    gaps = {}
    for label in ("synced every step, off", "off"):
        metrics = [json.loads(line) for line in (out / f"sync{results[label]['sync_every']}-off-seed0" /
                                                 "metrics.jsonl").read_text().splitlines()]
        gaps[label] = [m["rollout/logprob_mismatch"] for m in metrics if m["step"] > 0]
        assert results[label]["seeds"][0]["eval_accuracy"] == metrics[-1]["eval/accuracy"]
    assert max(gaps["synced every step, off"]) < 1e-4 and gaps["off"][0] < 1e-4 and gaps["off"][1] > 1e-2
    assert "| off | 2 |" in r.stdout and "| synced every step, off | 1 |" in r.stdout


def test_trl_does_the_work_of_grpo_py():
    """vs_trl.py gives TRL grpo.py's batching: a round of prompts x completions rows in
    num_minibatches optimizer steps of micro-batches; TRL generates every steps_per_generation
    micro-batches and steps every gradient_accumulation_steps. The default tiny job: 32 x 8 = 256
    rows, 4 steps of 64 (one micro-batch each); SmolLM2's: 8 x 4 = 32 rows, one step of 4 x 8."""
    import grpo
    from benchmarks import vs_trl

    tiny = vs_trl.trl_batching(grpo.Args(**vs_trl.JOBS["tiny"]))
    assert tiny == {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_generation": 4,
                    "num_generations": 8, "max_steps": 80}
    smollm2 = vs_trl.trl_batching(grpo.Args(**vs_trl.JOBS["smollm2"]))
    assert smollm2 == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "steps_per_generation": 4,
                       "num_generations": 4, "max_steps": 5}
    assert vs_trl.grpo_command(vs_trl.JOBS["smollm2"])[:5] == ["grpo.py", "--model", "smollm2", "--task",
                                                               "basic_arithmetic"]
    runs = [vs_trl.side("grpo.py", [3.0, 1.0, 2.0], [9.0, 6.0, 7.0]), vs_trl.side("TRL", [5.0, 4.0, 4.0], [5, 7, 8])]
    assert runs[0]["first_round"] == 3.0 and runs[0]["round"] == 1.5 and runs[0]["completion_mean"] == 6.5
    assert vs_trl.table(runs).splitlines()[2:] == ["| grpo.py | 1 | 1.50 | 1.50 | 3.00 | 6.5 | 0.38x |",
                                                  "| TRL | 1 | 4.00 | 4.00 | 5.00 | 7.5 | 1.00x |"]


def async_run(accuracy: list, staleness: float, gap: float, truncated: float) -> list[dict]:
    """A grpo_async.py run's metrics: the starting evaluation, then one step a second, evaluated where
    accuracy has a number."""
    return [{"step": 0, "eval/accuracy": 0.2}] + [
        {"step": s, "time/step": 1.0, "async/staleness_mean": staleness, "async/logprob_gap": gap,
         "rollout/is_truncated_frac": truncated, **({} if a is None else {"eval/accuracy": a})}
        for s, a in enumerate(accuracy, 1)]


def test_async_learning_table_from_run_folders(tmp_path):
    """benchmarks/async_overlap.py --part learning on synthetic runs: K = 0 has one row (nothing to
    correct), K = 1 two; the end accuracy, the first evaluated step at the target (of the seeds that
    reach it), the curves against step and seconds (mean, min-max over seeds), and the staleness
    columns, by hand; and the plot."""
    from argparse import Namespace

    from benchmarks import async_overlap

    runs = {("K0-auto", 0): async_run([None, 0.85], 0, 0.0, 0.0), ("K0-auto", 1): async_run([None, 0.9], 0, 0.0, 0.0),
            ("K1-auto", 0): async_run([None, 0.5, None, 0.8], 1, 0.02, 0.01),
            ("K1-auto", 1): async_run([None, 0.4, None, 0.6], 1, 0.04, 0.03),
            ("K1-off", 0): async_run([None, 0.3, None, 0.5], 1, 0.05, 0.0),
            ("K1-off", 1): async_run([None, 0.3, None, 0.7], 1, 0.07, 0.0)}
    for (config, seed), metrics in runs.items():
        write_run(tmp_path / f"learn-sort-{config}-seed{seed}", metrics)
    args = Namespace(tasks=["sort"], staleness=[0, 1], seeds=[0, 1], out=tmp_path, json=tmp_path / "learning.json")
    results, table = async_overlap.learning(args)
    assert list(results) == ["sort K=0 auto", "sort K=1 auto", "sort K=1 off", "sort plot"]
    first, second = results["sort K=1 auto"]["per_seed"]
    assert first["steps_to_target"] == 4 and second["steps_to_target"] is None
    assert first["train_time_s"] == 4.0 and first["logprob_gap"] == pytest.approx(0.02)
    curves = results["sort K=1 auto"]["aggregate"]["curves"]
    assert curves["accuracy_vs_step"]["x"] == [0, 2, 4] and curves["accuracy_vs_time"]["x"] == [0.0, 2.0, 4.0]
    assert curves["accuracy_vs_step"]["mean"] == pytest.approx([0.2, 0.45, 0.7])
    assert curves["accuracy_vs_step"]["min"] == pytest.approx([0.2, 0.4, 0.6])
    assert png_size(tmp_path / "learning.png") == (1000, 740)
    lines = table.strip().splitlines()
    assert "steps to target (sort 0.8; seeds)" in lines[0]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert rows[0][:5] == ["`sort`", "0", "off", "0.875 ± 0.035", "2.0 (2/2)"]
    assert rows[1][:5] == ["`sort`", "1", "token-truncate", "0.700 ± 0.141", "4.0 (1/2)"]
    assert rows[2][2:5] == ["off", "0.600 ± 0.141", "not reached"]
    assert rows[1][5:] == ["4.0", "1.00", "0.030", "0.020"] and rows[2][6:] == ["1.00", "0.060", "0.000"]
