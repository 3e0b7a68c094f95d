"""Rollout engines, a part of benchmarks/run.py: vLLM against plain transformers `generate`,
on the same model, prompts, sampling settings and number of completions.

vLLM is created by common.engine.create_engine exactly as the training scripts create it (on
CPU with its packed weights plus the plain ones that weight sync writes into). transformers is
the trainer's own policy (common.models.load_policy) with a KV cache, left-padded prompts,
temperature T, no top-k / top-p, stopping at EOS. After one warm-up call each, every size is timed --repeats times;
completions/s and completion tokens/s (EOS included) are the median over the repeats.
run.py starts it in its own process (vLLM changes process-wide settings) and reads --json.
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

from benchmarks.util import environment, write_json  # noqa: E402


@torch.no_grad()
def hf_generate(model, tokenizer, prompt_ids, n: int, max_new_tokens: int, temperature: float) -> list[list[int]]:
    """n sampled completions per prompt (consecutive) with transformers, from the full softmax;
    each up to and including its EOS."""
    device, width = model.device, max(len(p) for p in prompt_ids)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=eos)
    return [row[:row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]


def vllm_generate(llm, prompt_ids, n: int, max_new_tokens: int, temperature: float) -> list[list[int]]:
    """The scripts' rollout call."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def timed(generate, repeats: int) -> dict:
    """Median completions/s and tokens/s of `repeats` calls after one warm-up call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    generate()  # warm-up: first-call compilation and allocation
    sync()
    calls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        completions = generate()
        sync()
        calls.append((time.perf_counter() - t0, len(completions), sum(len(c) for c in completions)))
    return {"seconds": [t for t, _, _ in calls], "completions": calls[0][1],
            "completions_per_s": statistics.median(c / t for t, c, _ in calls),
            "tokens_per_s": statistics.median(k / t for t, _, k in calls),
            "mean_completion_tokens": statistics.fmean(k / c for _, c, k in calls)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-sort")
    p.add_argument("--task", default="sort")
    p.add_argument("--sizes", nargs="+", default=["32x8", "128x8"], help="PROMPTSxCOMPLETIONS, e.g. 32x8")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = p.parse_args(argv)
    env = environment(None if argv is None else [__file__, *argv])
    t_main = time.perf_counter()
    from common.engine import create_engine
    from common.models import check_model, encode_prompts, load_policy, load_tokenizer
    from common.tasks import load_task

    check_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"  # what the scripts' engines use
    task = load_task(args.task, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    max_prompt_len = max(len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in task.train + task.eval]))
    t0 = time.perf_counter()
    llm = create_engine(args.model, seed=args.seed, max_model_len=max_prompt_len + args.max_new_tokens, dtype=dtype)
    vllm_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = load_policy(args.model, tokenizer, dtype, device).eval()
    hf_start = time.perf_counter() - t0
    torch.manual_seed(args.seed)

    rows = []
    for size in args.sizes:
        num_prompts, n = map(int, size.split("x"))
        idx = torch.randint(len(task.train), (num_prompts,), generator=torch.Generator().manual_seed(args.seed))
        prompt_ids = encode_prompts(tokenizer, [task.train[i]["prompt"] for i in idx.tolist()])
        sampling = (n, args.max_new_tokens, args.temperature)
        v = timed(lambda: vllm_generate(llm, prompt_ids, *sampling), args.repeats)
        h = timed(lambda: hf_generate(model, tokenizer, prompt_ids, *sampling), args.repeats)
        rows.append({"prompts": num_prompts, "completions_per_prompt": n, "vllm": v, "transformers": h,
                     "ratio_completions_per_s": v["completions_per_s"] / h["completions_per_s"]})
        print(f"rollout engines: {size}: vLLM {v['completions_per_s']:.0f} completions/s, transformers "
              f"{h['completions_per_s']:.0f}", flush=True)
    data = {"environment": env, "argv": list(sys.argv[1:] if argv is None else argv), "model": args.model,
            "task": args.task, "device": device, "dtype": dtype, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "repeats": args.repeats,
            "startup_s": {"vllm": vllm_start, "transformers": hf_start}, "sizes": rows,
            "wall_s": time.perf_counter() - t_main}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
