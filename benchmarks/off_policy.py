"""Why --rollout-correction exists, and where the sync guard's bounds come from: rollouts made
deliberately off-policy, each correction mode against `off`.

    .venv/bin/python benchmarks/off_policy.py --json benchmarks/results/off_policy.json
    .venv/bin/python benchmarks/off_policy.py --gap --json benchmarks/results/sync_gap.json
    .venv/bin/python benchmarks/off_policy.py --gap --precisions bf16 --syncs working \
        --out runs/off_policy_smollm2 -- --model smollm2 --task arithmetic --max-new-tokens 64

The menu (default): grpo.py on the tiny task in bf16 (vLLM in bfloat16, the trainer under bf16
autocast: ~1e-2 apart) with the engine's weights synchronized only every --sync-every K steps, so
a step samples from weights 0 to K-1 updates old; seeds 0-2, every mode with its default bounds
(no tuning), and the same run synchronized every step as the reference. Held-out accuracy is the
final evaluation's: --steps is a multiple of K, so the engine is synchronized before it. The guard
is off in these runs (--max-unsynced-steps 0): staleness is the point.

--gap: the trainer-vs-engine log-prob gap (rollout/logprob_mismatch) with a working sync and with
the sync lost after the first (the engine keeps the initial weights), fp32 and bf16, full
fine-tuning and LoRA: what a working sync's numerics explain, and what a lost sync looks like
(common/guard.py SYNC_MISMATCH_BOUNDS sits between them). Flags after `--` go to every grpo.py run
(another model or task: give it its own --out).

Each run is grpo.py in its own process (`--worker`), its sync_weights replaced by one that
synchronizes on schedule; a finished run (summary.json) is reused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from benchmarks.util import (ROOT, environment, fmt, fmt_mean_std, markdown_table, provenance_md,  # noqa: E402
                             run_reused, write_json)

MODES = ["off", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "geometric-mask"]
GAP_STEPS = 6


def synced_on_schedule(sync_weights, every: int):
    """sync_weights that copies the policy into the engine at its first call (main's, into the fresh
    engine) and then after every `every`-th step (0: never again, a lost sync)."""
    calls = []

    def sync(llm, policy):
        calls.append(1)
        step = len(calls) - 1  # the steps trained before this call
        if step == 0 or (every and step % every == 0):
            sync_weights(llm, policy)

    return sync


def worker(every: int, command: list[str]) -> None:
    """One run: the script's main with its sync on schedule (as `python SCRIPT FLAGS` otherwise)."""
    from common.args import cli
    from common.scripts import load_script
    module = load_script(command[0])
    module.sync_weights = synced_on_schedule(module.sync_weights, every)
    cli(module.main, module.Args, command[1:])


def run(out: Path, every: int, flags: list[str]) -> list[dict]:
    """grpo.py with these flags into out (reused when finished); its metrics, one dict a step."""
    return run_reused(out, [sys.executable, __file__, "--worker", str(every), "--", "grpo.py", *flags],
                      str(out.relative_to(out.parents[1])))


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else None


def menu(args) -> tuple[dict, str]:
    common = ["--steps", str(args.steps), "--eval-every", "0", "--save-every", "0", "--precision", args.precision,
              "--max-unsynced-steps", "0", *args.flags]
    configs = [("synced every step, off", 1, "off")] + [(m, args.sync_every, m) for m in args.modes]
    results, rows = {}, []
    for label, every, mode in configs:
        per_seed = []
        for seed in args.seeds:
            name = f"sync{every}-{mode}-seed{seed}"
            steps = [m for m in run(args.out / name, every, [*common, "--rollout-correction", mode, "--seed", str(seed)])
                     if m["step"] > 0]
            per_seed.append({
                "eval_accuracy": steps[-1]["eval/accuracy"],
                **{k: statistics.mean(m[f"rollout/{k}"] for m in steps)
                   for k in ("logprob_mismatch", "is_truncated_frac", "is_masked_frac", "is_seq_masked_frac")}})
        results[label] = {"sync_every": every, "mode": mode, "seeds": per_seed}
        acc = mean_std([s["eval_accuracy"] for s in per_seed])
        rows.append([label, every, fmt_mean_std(*acc, 3),
                     *(fmt(statistics.mean(s[k] for s in per_seed), 3) for k in
                       ("is_truncated_frac", "is_masked_frac", "is_seq_masked_frac", "logprob_mismatch"))])
    table = markdown_table(["mode", "sync every", "held-out accuracy", "tokens truncated", "tokens masked",
                            "sequences masked", "log-prob gap"], rows)
    return results, table


def gap(args) -> tuple[dict, str]:
    results, rows = {}, []
    for precision in args.precisions:
        for tuning, extra in (("full", []), ("lora", ["--lora-rank", "8"])):
            per = {}
            for sync, every in [(s, e) for s, e in (("working", 1), ("lost", 0)) if s in args.syncs]:
                name = f"gap-{precision}-{tuning}-{sync}"
                steps = [m for m in run(args.out / name, every, ["--steps", str(GAP_STEPS), "--eval-every", "0",
                                                                 "--save-every", "0", "--precision", precision,
                                                                 "--max-unsynced-steps", "0", *extra, *args.flags])
                         if m["step"] > 0]
                per[sync] = [m["rollout/logprob_mismatch"] for m in steps]
            results[f"{precision}-{tuning}"] = per
            # a lost sync's first step still samples the initial (synchronized) weights
            working, lost = per.get("working"), per.get("lost")
            rows.append([precision, tuning, f"{max(working):.2g}" if working else "-",
                         f"{min(lost[1:]):.2g}" if lost else "-", f"{max(lost[1:]):.2g}" if lost else "-"])
    table = markdown_table(["precision", "tuning", "working sync: largest gap", "lost sync: smallest gap (steps 2+)",
                            "lost sync: largest gap"], rows, "llrrr")
    return results, table


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(int(argv[1]), argv[3:])  # --worker K -- SCRIPT FLAGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap", action="store_true", help="the sync guard's measurement instead of the menu's")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"], help="--gap's")
    p.add_argument("--syncs", nargs="+", choices=["working", "lost"], default=["working", "lost"], help="--gap's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30, help="steps a run (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=5, help="the engine's weights synchronized every K steps")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "off_policy", help="the runs' folder")
    p.add_argument("--json", type=Path, help="write the results here")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.flags = argv[cut + 1:]  # for every grpo.py run
    if args.sync_every < 1 or args.steps % args.sync_every:
        p.error(f"--steps ({args.steps}) must be a multiple of --sync-every ({args.sync_every}) >= 1")
    env = environment()
    results, table = gap(args) if args.gap else menu(args)
    print("\n" + provenance_md(env) + "\n" + table, flush=True)
    if args.json:
        write_json(args.json, {"environment": env, "results": results, "table": table})


if __name__ == "__main__":
    main()
