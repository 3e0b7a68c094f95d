"""Rollout engines: vLLM against plain transformers `generate`, on the same model, prompts,
sampling settings and number of completions.

    python benchmarks/rollout_engines.py                      # the bundled tiny model
    python benchmarks/rollout_engines.py --model PATH --sizes 32x8 128x8

vLLM is created by common.models.create_engine, exactly as the training scripts create it
(on CPU that includes the plain-weights patch that makes weight sync possible). The
transformers side is the trainer's own policy (common.models.load_policy) with a KV cache,
left-padded prompts, do_sample, temperature T, no top-k / top-p, num_return_sequences = n,
stopping at EOS. After one warm-up call each, every size is timed `--repeats` times;
completions/s and completion tokens/s (EOS included) are the median over the repeats.
Writes rollout_engines.md and rollout_engines.json to --out.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as in the scripts

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

import torch  # noqa: E402

from benchmarks.util import ROOT, environment, fmt, markdown_table, write_part  # noqa: E402


def parse_size(text: str) -> tuple[int, int]:
    prompts, _, n = text.partition("x")
    return int(prompts), int(n)


def sample_prompts(tokenizer, task, num_prompts: int, seed: int) -> list[list[int]]:
    from common.tasks import encode_prompts

    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(task.train), (num_prompts,), generator=g).tolist()
    return encode_prompts(tokenizer, [task.train[i]["prompt"] for i in idx])


def vllm_rollout(llm, prompt_ids, n: int, max_new_tokens: int, temperature: float) -> tuple[int, int]:
    """The scripts' rollout call; returns (completions, completion tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    return len(completions), sum(len(c.token_ids) for c in completions)


@torch.no_grad()
def hf_rollout(model, tokenizer, prompt_ids, n: int, max_new_tokens: int, temperature: float) -> tuple[int, int]:
    """transformers generate with the same sampling; returns (completions, completion tokens)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=n,
                         max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    new = out[:, width:]
    # completion length: up to and including the first EOS, else all max_new_tokens
    is_eos = new == tokenizer.eos_token_id
    lengths = torch.full((new.shape[0],), new.shape[1])
    finished = is_eos.any(1).cpu()
    lengths[finished] = is_eos.float().argmax(1).cpu()[finished] + 1
    return new.shape[0], int(lengths.sum())


def time_calls(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-call compilation and allocation
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0, *result))
    return times


def summarize(times) -> dict:
    seconds = [t for t, _, _ in times]
    return {"seconds": seconds, "completions": times[0][1],
            "completions_per_s": statistics.median(c / t for t, c, _ in times),
            "tokens_per_s": statistics.median(k / t for t, _, k in times),
            "mean_completion_tokens": statistics.fmean(k / c for _, c, k in times)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-sort")
    p.add_argument("--task", default="sort")
    p.add_argument("--sizes", nargs="+", default=["32x8", "128x8"], help="PROMPTSxCOMPLETIONS, e.g. 32x8")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "full")
    args = p.parse_args(argv)
    env = environment(None if argv is None else [__file__, *argv])
    t_main = time.perf_counter()
    from common.models import check_model, create_engine, load_policy, load_tokenizer
    from common.tasks import encode_prompts, load_task

    model_path = args.model if os.path.isabs(args.model) or not (ROOT / args.model).exists() else str(ROOT / args.model)
    check_model(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"  # what the scripts' engines use
    task = load_task(args.task, seed=args.seed)
    tokenizer = load_tokenizer(model_path)
    sizes = [parse_size(s) for s in args.sizes]
    max_prompt_len = max(len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in task.train + task.eval]))

    t0 = time.perf_counter()
    llm = create_engine(model_path, seed=args.seed, max_model_len=max_prompt_len + args.max_new_tokens, dtype=dtype)
    vllm_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = load_policy(model_path, tokenizer, dtype, device).eval()
    hf_start = time.perf_counter() - t0
    torch.manual_seed(args.seed)

    rows = []
    for num_prompts, n in sizes:
        prompt_ids = sample_prompts(tokenizer, task, num_prompts, args.seed)
        print(f"rollout engines: {num_prompts} prompts x {n} completions, {args.repeats} repeats", flush=True)
        v = summarize(time_calls(lambda: vllm_rollout(llm, prompt_ids, n, args.max_new_tokens, args.temperature),
                                 args.repeats))
        h = summarize(time_calls(lambda: hf_rollout(model, tokenizer, prompt_ids, n, args.max_new_tokens,
                                                    args.temperature), args.repeats))
        rows.append({"prompts": num_prompts, "completions_per_prompt": n, "vllm": v, "transformers": h,
                     "ratio_completions_per_s": v["completions_per_s"] / h["completions_per_s"]})
        print(f"  vLLM {v['completions_per_s']:.0f} completions/s, transformers {h['completions_per_s']:.0f}: "
              f"ratio {rows[-1]['ratio_completions_per_s']:.2f}", flush=True)

    data = {"environment": env, "model": args.model, "task": args.task, "device": device, "dtype": dtype,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "repeats": args.repeats,
            "startup_s": {"vllm": vllm_start, "transformers": hf_start}, "sizes": rows}
    header = ["prompts x completions", "vLLM completions/s", "transformers completions/s", "vLLM / transformers",
              "vLLM tokens/s", "transformers tokens/s", "mean completion tokens (vLLM / transformers)"]
    table = markdown_table(header, [[
        f"{r['prompts']} x {r['completions_per_prompt']}", fmt(r["vllm"]["completions_per_s"], 0),
        fmt(r["transformers"]["completions_per_s"], 0), f"{r['ratio_completions_per_s']:.2f}x",
        fmt(r["vllm"]["tokens_per_s"], 0), fmt(r["transformers"]["tokens_per_s"], 0),
        f"{r['vllm']['mean_completion_tokens']:.1f} / {r['transformers']['mean_completion_tokens']:.1f}"]
        for r in rows])
    note = (f"`{args.model}` on {device} ({dtype}), temperature {args.temperature}, up to {args.max_new_tokens} new "
            f"tokens, the same prompts for both engines; median of {args.repeats} timed calls after one warm-up call. "
            f"vLLM is created as the training scripts create it"
            f"{' (CPU: plain linear weights, so that weight sync works)' if device == 'cpu' else ''}. "
            f"Start-up: vLLM engine {vllm_start:.1f} s, transformers model {hf_start:.1f} s.\n")
    data["argv"] = list(sys.argv[1:] if argv is None else argv)
    data["wall_s"] = time.perf_counter() - t_main
    data["markdown"] = f"{table}\n{note}"
    write_part(args.out, "rollout_engines", data["markdown"], data, env)
    return data


if __name__ == "__main__":
    main()
