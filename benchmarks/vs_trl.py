"""grpo.py against TRL's GRPOTrainer on the same work, side by side on this machine.

    bash benchmarks/trl_deps.sh                                     # TRL (pinned) into .trl/, git-ignored
    .venv/bin/python benchmarks/vs_trl.py --job tiny --repeats 2     # the README's default tiny job
    .venv/bin/python benchmarks/vs_trl.py --job smollm2 --repeats 2  # SmolLM2-135M on basic_arithmetic

Both sides do the same work, taken from one set of grpo.py arguments (JOBS; grpo.py's defaults
for the rest): the model in float32, the task's prompts (through the chat template when the
tokenizer has one) and its reward, prompts x completions a round, the completion budget,
temperature, learning rate (constant), clip range, beta (k3 KL to the initial model), the loss
(mean over a completion's tokens, then over completions: TRL's loss_type "grpo"), gradient
clipping, optimizer steps a round and micro-batch size. A round is one rollout and the
optimizer steps on it. Each side runs as its user gets it by default: grpo.py samples with
vLLM, with tcmalloc preloaded (common/allocator.py); TRL samples with transformers' generate
(its vLLM modes need a GPU), with the system allocator.

Runs alternate (grpo.py, TRL, grpo.py, TRL, ...). Of each run the median of its steady rounds
(the first, which warms caches, is reported apart): grpo.py's time/step; TRL's time between
the ends of a round's last optimizer steps (its logging included); and the mean completion
length of those rounds (both sample the same model at the same temperature: the lengths
should agree, or the sides did not do the same work). --trl-tcmalloc adds TRL with
tcmalloc preloaded, as a third side: how much of the gap is the allocator. Prints a markdown
table and writes every run's numbers to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.step_time import run_once  # noqa: E402
from benchmarks.util import environment  # noqa: E402
from common.allocator import tcmalloc_path  # noqa: E402

TRL_VERSION = "1.16.0"
TRL_DIR = ROOT / ".trl"  # where benchmarks/trl_deps.sh installs it

# grpo.py's arguments of each job: what README's two commands run
JOBS = {
    "tiny": {"steps": 20},
    "smollm2": {"model": "smollm2", "task": "basic_arithmetic", "steps": 5, "prompts_per_step": 8,
                "completions_per_prompt": 4, "max_new_tokens": 64, "num_minibatches": 1, "micro_batch_size": 8,
                "lr": 1e-6},
}


def grpo_command(job: dict) -> list[str]:
    """grpo.py with the job's flags, no held-out evaluation but at start and end, no checkpoints."""
    flags = [f for k, v in job.items() for f in (f"--{k.replace('_', '-')}", str(v))]
    return ["grpo.py", *flags, "--eval-every", "0", "--save-every", "0"]


def trl_batching(args) -> dict:
    """TRL's batch sizes for grpo.py's (args: grpo.Args): a round of B = prompts x completions
    rows makes num_minibatches optimizer steps, each over B / num_minibatches rows in
    micro-batches of at most micro_batch_size; TRL generates once every steps_per_generation
    micro-batches and steps the optimizer every gradient_accumulation_steps."""
    rows = args.prompts_per_step * args.completions_per_prompt
    minibatch = rows // args.num_minibatches
    micro = min(args.micro_batch_size, minibatch)
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": minibatch // micro,
            "steps_per_generation": rows // micro, "num_generations": args.completions_per_prompt,
            "max_steps": args.steps * args.num_minibatches}


def trl_run(job: dict, out: Path) -> tuple[list[float], list[float]]:
    """TRL's GRPOTrainer on the job (in this process): the seconds of each round, and its
    completions' mean length (tokens) at each round."""
    sys.path.insert(0, str(TRL_DIR))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo
    from common.models import has_chat_template, load_tokenizer, resolve_model
    from common.tasks import load_task

    args = grpo.Args(**job)
    task = load_task(args.task, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    chat = args.chat_template and has_chat_template(tokenizer)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": e["prompt"]}] if chat else e["prompt"],
                                  "index": i} for i, e in enumerate(task.train)])

    def reward(completions, index, **_):
        texts = [c[-1]["content"] if chat else c for c in completions]
        return [task.reward(t, task.train[i]) for t, i in zip(texts, index)]

    batching = trl_batching(args)
    ends, lengths = [], []

    class RoundEnds(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, _, state, *__, **___):
            if state.global_step % args.num_minibatches == 0:
                ends.append(time.perf_counter())

        def on_log(self, *_, logs=None, **__):  # a round's completions are logged once, after its rollout
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    config = GRPOConfig(
        output_dir=str(out), **batching, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, beta=args.kl_coef, epsilon=args.eps_low,
        epsilon_high=args.eps_high, loss_type="grpo", scale_rewards="group" if args.scale_rewards else "none",
        model_init_kwargs={"dtype": "float32"}, use_cpu=True, bf16=False, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=resolve_model(args.model), reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[RoundEnds()])
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])], lengths


def side(name: str, rounds: list[float], lengths: list[float]) -> dict:
    """One run's numbers: its rounds' seconds, the first apart, the median of the rest; the mean
    completion length (tokens) of those rounds, so that the two sides' work can be compared."""
    return {"side": name, "first_round": rounds[0], "round": statistics.median(rounds[1:] or rounds),
            "completion_mean": statistics.mean(lengths[1:] or lengths), "rounds": rounds, "lengths": lengths}


def run_trl(job_name: str, out: Path, preload: str | None = None) -> tuple[list[float], list[float]]:
    """One TRL run in a fresh process, as its user runs it (the system allocator; preload: a
    library to preload instead, tcmalloc): its rounds' seconds and completion lengths."""
    result = out / "rounds.json"
    log = out.with_suffix(".log")
    env = {**os.environ, **({"LD_PRELOAD": preload} if preload else {})}
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, __file__, "--trl-child", job_name, "--out", str(out)], cwd=ROOT,
                              env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])  # the folder goes when the benchmark ends
        raise SystemExit(f"error: the TRL run failed (exit {done.returncode}); its log ends:\n{tail}")
    return tuple(json.loads(result.read_text()))


def table(runs: list[dict]) -> str:
    lines = ["| side | runs | round (s), median | each run | first round (s) | mean completion (tokens) | vs. TRL |",
             "|---|---|---|---|---|---|---|"]
    trl = statistics.median(r["round"] for r in runs if r["side"] == "TRL")
    for name in dict.fromkeys(r["side"] for r in runs):
        rs = [r for r in runs if r["side"] == name]
        median = statistics.median(r["round"] for r in rs)
        each = ", ".join(f"{r['round']:.2f}" for r in rs)
        first = ", ".join(f"{r['first_round']:.2f}" for r in rs)
        length = statistics.mean(r["completion_mean"] for r in rs)
        lines.append(f"| {name} | {len(rs)} | {median:.2f} | {each} | {first} | {length:.1f} | {median / trl:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="tiny")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/vs_trl_JOB.json")
    parser.add_argument("--trl-tcmalloc", action="store_true",
                        help="also run TRL with tcmalloc preloaded, as grpo.py runs (a third side)")
    parser.add_argument("--trl-child", choices=sorted(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        (args.out / "rounds.json").write_text(json.dumps(trl_run(JOBS[args.trl_child], args.out)))
        return 0
    found = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TRL_DIR)!r}); import trl; "
                            "print(trl.__version__)"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit("error: TRL is not installed for this benchmark: run bash benchmarks/trl_deps.sh")
    tcmalloc = tcmalloc_path()
    if args.trl_tcmalloc and tcmalloc is None:
        raise SystemExit("error: --trl-tcmalloc: tcmalloc is not installed (setup.sh installs it)")
    job = JOBS[args.job]
    runs = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        for i in range(args.repeats):
            t0 = time.time()
            steps = run_once(ROOT, grpo_command(job), Path(tmp) / f"grpo_{i}")
            runs.append(side("grpo.py", [m["time/step"] for m in steps], [m["response/length_mean"] for m in steps]))
            runs[-1]["first_round_parts"] = {k: v for k, v in steps[0].items() if k.startswith("time/")}
            print(f"grpo.py run {i + 1}: {runs[-1]['round']:.2f} s a round ({time.time() - t0:.0f} s)", flush=True)
            for name, preload in [("TRL", None)] + [("TRL + tcmalloc", tcmalloc)] * args.trl_tcmalloc:
                t0 = time.time()
                runs.append(side(name, *run_trl(args.job, Path(tmp) / f"trl_{i}_{bool(preload)}", preload)))
                print(f"{name} run {i + 1}: {runs[-1]['round']:.2f} s a round ({time.time() - t0:.0f} s)", flush=True)
    report = table(runs)
    print(report)
    path = args.json or ROOT / "benchmarks" / "results" / f"vs_trl_{args.job}.json"
    path.write_text(json.dumps({**environment(None if argv is None else [__file__, *argv]), "trl": found.stdout.strip(), "job": job,
                                "grpo_command": grpo_command(job), "runs": runs, "table": report}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
