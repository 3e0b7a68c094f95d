"""Why a run's first sampled rollout was slow: times the engine's greedy call, then three
sampled rollouts (32 prompts x 8 completions, 12 tokens, log-probs on, as the scripts ask).

    .venv/bin/python benchmarks/first_rollout.py

With log-probs asked for, vLLM ranks each sampled token with a torch.compile'd helper, and the
first sampled call compiled it (inductor): 2.7 s against 0.6 s for the later calls. On CPU
create_engine now ranks eagerly (common/engine.py `_eager_token_ranks`), and the first
sampled call costs what the later ones do (benchmarks/README.md, step time).
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm import SamplingParams  # noqa: E402

from common.engine import create_engine  # noqa: E402
from common.models import encode_prompts, load_tokenizer  # noqa: E402


def main() -> None:
    model = str(ROOT / "models" / "tiny-sort")
    tokenizer = load_tokenizer(model)
    llm = create_engine(model, seed=0, max_model_len=64)
    prompts = [{"prompt_token_ids": p} for p in encode_prompts(tokenizer, [f"sort {i}52813:" for i in range(32)])]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    print(f"greedy: {time.perf_counter() - t0:.2f} s")
    for i in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=12, logprobs=0), use_tqdm=False)
        print(f"sampled rollout {i + 1}: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
