"""The rollout engines in one process or under torchrun: `python tests/engine_worker.py JOB OUT.pt` or
`torchrun --nproc-per-node 2 tests/engine_worker.py JOB OUT.pt`. The process group times out in a
minute: ranks that fall out of step fail fast instead of waiting for each other for 30 minutes.

JOB transformers: the transformers engine on a policy sharded with FSDP2. Each case is a whole batch
of requests (prompt, max_tokens) and how many of them rank 0 holds (rank 1 the rest; one process: all):
budgets that differ between the ranks, as grpo_multiturn.py's episodes' do, and a rank with no request
at all, and one prompt on both ranks (each rank must draw its own noise). No stop token, so every
sample runs to its own budget. Then the greedy evaluation of a small
split, a few prompts a batch. Rank 0 saves the samples of every case, the evaluation's metrics and the
sizes of the batches each rank decoded.

JOB vllm: a vLLM engine a rank, seeded as the scripts seed it (engine_options, then seed_everything),
samples the same prompt on every rank; rank 0 saves every rank's completions.
"""

import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

from common import dist, engine  # noqa: E402
from common.engine import SamplingParams, create_engine, evaluate, sampling_params, sync_weights  # noqa: E402
from common.models import encode_prompts, load_policy, load_tokenizer  # noqa: E402
from common.run import seed_everything  # noqa: E402
from common.tasks import make_sort_task, sort_partial_reward  # noqa: E402
from tests.conftest import TINY_MODEL  # noqa: E402
from tests.dist_worker import FP32  # noqa: E402

CASES = {"unequal budgets": ([("sort 4410236:", 12), ("sort 907:", 3), ("sort 61:", 3)], 1),
         "a rank without requests": ([("sort 52813:", 12), ("sort 4410236:", 5)], 2),
         "the same prompt on both ranks": ([("sort 52813:", 12), ("sort 52813:", 12)], 1)}
EVAL = make_sort_task(num_train=1, num_eval=11, reward_fn=sort_partial_reward)  # 11 prompts: uneven shares


def main(job: str, out: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # before dist.init, which then keeps this group
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    device = dist.init()
    tokenizer = load_tokenizer(TINY_MODEL)
    results = {"world_size": dist.world_size()}
    results.update(same_prompt(tokenizer) if job == "vllm" else transformers_engine(tokenizer, device))
    if dist.is_main():
        torch.save(results, out)


def same_prompt(tokenizer) -> dict:
    """Each rank's 8 completions of one prompt, in rank order."""
    seed = 0
    llm = create_engine(TINY_MODEL, seed=seed + dist.rank(), max_model_len=64, sleep_mode=False)  # engine_options'
    seed_everything(seed, dist.rank())  # the scripts' line, after the engine
    args = type("Args", (), {"engine": "vllm", "completions_per_prompt": 8, "temperature": 1.0, "top_p": 1.0,
                                   "top_k": 0, "max_new_tokens": 12})
    ids = encode_prompts(tokenizer, ["sort 52813:"], True, None)
    outputs = llm.generate([{"prompt_token_ids": ids[0]}], sampling_params(args, tokenizer), use_tqdm=False)
    return {"completions": dist.all_gather_objects([[c.token_ids for c in outputs[0].outputs]])}


def transformers_engine(tokenizer, device) -> dict:
    policy = dist.shard(load_policy(TINY_MODEL, tokenizer, "float32", device), FP32)
    llm = create_engine(TINY_MODEL, seed=0, max_model_len=64, engine="transformers")
    sync_weights(llm, policy)
    results = {}
    for case, (requests, rank_0_holds) in CASES.items():
        if dist.world_size() > 1:
            requests = requests[:rank_0_holds] if dist.is_main() else requests[rank_0_holds:]
        ids = encode_prompts(tokenizer, [p for p, _ in requests], True, None)
        params = [SamplingParams(n=2, max_tokens=m, logprobs=0) for _, m in requests]
        for call in range(2):  # the second call: the ranks are still in step after the first
            outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
            samples = [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                       for out in outputs for c in out.outputs]
            results[case, call] = dist.all_gather_objects(samples)
    engine.EVAL_BATCH = 2  # 11 prompts: several batches, of 2 or fewer prompts
    batches, generate = [], llm.generate
    llm.generate = lambda requests, *a, **k: batches.append(len(requests)) or generate(requests, *a, **k)
    results["eval"] = evaluate(llm, tokenizer, EVAL, 12)
    results["eval batches"], results["eval calls"] = dist.all_gather_objects([batches]), llm.calls
    llm.generate = generate
    if dist.world_size() == 1:  # as before batches: the whole split at once
        engine.EVAL_BATCH = 64
        results["eval, one batch"] = evaluate(llm, tokenizer, EVAL, 12)
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
