"""The rollout engine: an in-process vLLM engine (its creation, the CPU patches, sleep mode),
moving the trainer's weights into it, and greedy evaluation through it.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by each script before
vLLM is imported), so moving the trained weights into it is a plain in-memory copy.

--engine transformers replaces vLLM where it does not install (macOS, Windows, a GPU
without a vLLM build): TransformersEngine samples from the trainer's policy itself with the
same calls (create_engine, llm.generate, awake, sync_weights) and outputs, so the scripts
read the same either way. vLLM is imported only by the vLLM engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from common import dist
from common.batch import position_ids_of
from common.errors import need
from common.models import encode_prompts, load_tokenizer, merged_weights, resolve_model, stop_token_ids
from common.ops import top_k_top_p_mask
from common.rewards import TIMEOUTS, Reward, RewardTerm


def _keep_cpu_weights() -> None:
    """CPU only: let vLLM pack its linear weights into fast kernels, but keep the weights too.

    vLLM's CPU backend replaces each linear layer's weight with a packed copy (oneDNN) and an
    empty Parameter, after which load_weights() has nothing to write into. Packing with
    remove_weight=False keeps the Parameter that load_weights() updates; each layer gets a
    repack() that sync_weights() calls to pack the new weights. Against a plain F.linear the
    rollout of benchmarks/README.md's step-time table went 22.8 -> 15.7 s (SmolLM2-135M,
    float32, 2 cores), for a second copy of the linear weights and +0.5 s a sync."""
    import vllm.model_executor.layers.utils as layer_utils

    pack = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(pack, "keeps_weights", False):  # patched by an earlier engine
        return

    def pack_keeping_weights(layer, remove_weight):
        pack(layer, remove_weight=False)
        layer.repack = lambda: pack(layer, remove_weight=False)

    pack_keeping_weights.keeps_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = pack_keeping_weights


def _eager_token_ranks() -> None:
    """CPU only: count a sampled token's rank eagerly instead of through torch.compile.

    With log-probs asked for, vLLM's sampler also ranks each sampled token with a
    torch.compile'd helper (batched_count_greater_than, compiled to save GPU memory); the first
    sampled rollout of every run compiled it. On CPU the same count is done eagerly: the tiny
    job's first rollout went 2.76 -> 0.59 s, the later ones did not change (benchmarks/README.md,
    step time; benchmarks/first_rollout.py)."""
    import vllm.v1.sample.sampler as sampler

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    sampler.batched_count_greater_than = batched_count_greater_than


def _undecoded_logprobs() -> None:
    """Leave the sampled tokens' log-prob entries undecoded (their decoded_token is None).

    The rollout asks for the sampled token's log-prob (logprobs=0) and reads only its value
    (sampled_logprobs); vLLM would also turn each such token into text and check that text, in
    Python, token by token: 0.9 s of the default tiny job's 5.7 s of rollouts over 20 steps,
    under a profiler (benchmarks/README.md, "The tiny job's fixed costs").
    The completions' own text is decoded as before, by vLLM's detokenizer."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    make = LogprobsProcessor.from_new_request.__func__
    if getattr(make, "undecoded", False):  # patched by an earlier engine
        return

    def from_new_request(cls, tokenizer, request):
        return make(cls, tokenizer=None, request=request)

    from_new_request.undecoded = True
    LogprobsProcessor.from_new_request = classmethod(from_new_request)


def _quiet_vllm() -> None:
    """Before vLLM is imported: its warnings off (its errors stay). None asks the user to act: at a
    start on CPU, ~18 about what this code chose (eager mode, the seed, torch's threads) or the
    build lacks (Triton; tcmalloc and Intel OpenMP preloaded, for speed); in bf16, 18 more at every
    weight sync, for fp32 weights loaded into the bf16 engine, as intended. VLLM_LOGGING_LEVEL=WARNING
    (or INFO) shows them again."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's logger, configured when an engine starts
    # what vLLM says while it is imported, before that, goes through its logger's parent too
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    # vLLM's scan of every loaded module touches torch's deprecated alias
    warnings.filterwarnings("ignore", "`torch.distributed.reduce_op` is deprecated", FutureWarning)


def vllm_cannot_run(config, device: str) -> str | None:
    """Why vLLM (0.32) cannot run this model here, or None. An architecture without a vLLM
    implementation of its own goes to vLLM's Transformers backend, which fails on some (CTRL: "Current
    vLLM config is not set") and, where it works (OLMo2, GPT-NeoX), patches the transformers class
    the trainer then loads in the same process, which fails the same way. On CPU, vLLM's attention
    takes only some head sizes ("Unsupported CPU attention configuration" after start-up)."""
    _quiet_vllm()  # before its import: what vLLM says then (Triton without a CPU backend) is not the run's output
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS  # vLLM's own implementations

    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if _TEXT_GENERATION_MODELS.get(arch, ("transformers",))[0] == "transformers":
        return f"vLLM has no implementation of its own for {arch} (its Transformers backend breaks the trainer's model)"
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            return f"vLLM's CPU attention has no head size {head} (it has {', '.join(map(str, sizes))})"
    return None


def create_engine(name_or_path: str, seed: int, max_model_len: int, dtype: str = "float32",
                  gpu_memory_utilization: float = 0.3, cpu_kv_cache_gib: int = 1,
                  enforce_eager: bool | None = None, sleep_mode: bool = True, engine: str = "vllm"):
    """An in-process vLLM engine for rollouts, seeded once (never per request); with
    engine="transformers", a TransformersEngine (its own seeding, see there).

    On CPU the KV cache is sized by cpu_kv_cache_gib (vLLM would take most of the RAM),
    linear weights are kept beside their packed copies so that sync_weights() can update
    them, and sampled tokens are ranked without torch.compile (_eager_token_ranks). Everywhere
    the sampled tokens' log-prob entries stay undecoded (_undecoded_logprobs).
    enforce_eager skips vLLM's torch.compile warm-up; the default is eager on CPU, where the
    compiled graphs are never reused across runs (vLLM recompiles every start): that saves
    ~8 s of start-up for the tiny model and ~40-55 s for SmolLM2-135M on 2 cores, for ~10-20%
    slower generation. On GPU vLLM compiles.
    sleep_mode (CUDA only; vLLM has none on CPU): see awake()."""
    if engine == "transformers":
        return TransformersEngine(name_or_path, seed, dtype)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vllm: "
                           "weight sync needs the engine in this process")
    _quiet_vllm()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set,
        # which would leave training in this process on one core.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        _keep_cpu_weights()
        _eager_token_ranks()
    _undecoded_logprobs()
    from vllm import LLM

    kwargs = {} if on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}
    if dist.processes() > 1:
        # under torchrun: an engine per rank, on the rank's own device (LOCAL_RANK), vLLM's groups made
        # within the ranks' process group (the default in-process executor would put every engine on cuda:0)
        kwargs["distributed_executor_backend"] = "external_launcher"
    enforce_eager = on_cpu if enforce_eager is None else enforce_eager
    before = memory_in_use()
    llm = LLM(model=resolve_model(name_or_path), seed=seed, dtype=dtype,
              max_model_len=max_model_len, enable_prefix_caching=True, enable_sleep_mode=sleep_mode and not on_cpu,
              logprobs_mode="processed_logprobs", enforce_eager=enforce_eager, use_tqdm_on_load=False, **kwargs)
    llm.memory = {k: after - before[k] for k, after in memory_in_use().items()}  # the engine's share
    llm.sleeps, llm.asleep = sleep_mode and not on_cpu, set()
    return llm


@contextlib.contextmanager
def awake(llm):
    """with awake(llm): llm.generate(...). With sleep mode the engine wakes for the block and
    sleeps again after it (level 1: its KV cache is freed and its weights wait in CPU memory),
    so the trainer has the GPU to itself between rollouts. Without, it does nothing."""
    wake(llm, "weights", "kv_cache")
    try:
        yield llm
    finally:
        if llm.sleeps:
            llm.sleep(level=1)
            llm.asleep = {"weights", "kv_cache"}


def wake(llm, *tags: str) -> None:
    """Wake the parts of a sleeping engine named by tags ("weights", "kv_cache")."""
    tags = sorted(set(tags) & llm.asleep)
    if tags:
        llm.wake_up(tags=tags)
        llm.asleep -= set(tags)


def memory_in_use() -> dict:
    """Bytes in use now: on CUDA, the device's (all allocators) and torch's allocated tensors;
    on CPU, the process's resident memory."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"device": total - free, "allocated": torch.cuda.memory_allocated()}
    import psutil  # a dependency of vLLM

    return {"device": psutil.Process().memory_info().rss, "allocated": 0}


def engine_model(llm) -> torch.nn.Module:
    """The engine's own torch model, through vLLM's public accessor (the engine is in-process, so
    this is the object itself): its get_model() unwraps the CUDA-graph wrapper a GPU engine puts
    around the model, which the runner's `.model` attribute would return."""
    return llm.apply_model(lambda model: model)[0]


@torch.no_grad()
def sync_weights(llm, model: PreTrainedModel) -> None:
    """Copy the trainer's current weights into vLLM in place (merged, under LoRA), then drop
    cached prefixes (their KV entries were computed with the old weights). A sleeping
    engine's weights are woken first: loading into released memory would be lost silently.
    A TransformersEngine samples from the model itself: nothing to copy."""
    if isinstance(llm, TransformersEngine):
        llm.model = model
        return
    wake(llm, "weights")
    engine = engine_model(llm)
    engine.load_weights(merged_weights(model))
    for layer in engine.modules():
        if hasattr(layer, "repack"):  # CPU: vLLM's packed copies made again from the new weights
            layer.repack()
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------------------
# evaluation: greedy decoding on the held-out split
# ---------------------------------------------------------------------------------------

EVAL_BATCH = 64
"""prompts a rank decodes at once in the transformers engine's evaluation (its memory grows with the batch)"""


def evaluate(llm, tokenizer, task, max_new_tokens: int, chat_template: bool = True,
             system_prompt: str | None = None, reward_timeout: float = 0.0, episodes=None) -> dict:
    """Greedy accuracy (reward >= 1) and mean reward on the task's eval split, through vLLM.

    Prompts are encoded and completions stopped as in training: pass the same
    chat_template / system_prompt as to encode_prompts (stop tokens: stop_token_ids). The
    task's reward is called as in training (common/rewards.py Reward): a verifier that fails is
    one line, a call past reward_timeout seconds scores 0 and is counted (eval/timeouts).
    Under torchrun rank 0 evaluates (the numbers of one process) and every rank gets them; with
    a TransformersEngine (the sharded policy's forward needs every rank) each rank decodes its share
    of the split, EVAL_BATCH prompts at a time and in step with the others (eval_batches), and every
    rank gets the whole split's numbers, those of one process. episodes: multi-turn rollouts
    (grpo_multiturn.py), episodes(prompt_ids, examples) -> (the final answers, more eval metrics, the
    examples as the reward sees them: common/env.py episode_examples), greedy."""
    need(episodes is None or len(task.eval) >= dist.world_size(),
         f"the eval split has {len(task.eval)} examples, fewer than the {dist.world_size()} ranks that share its episodes")
    how = (tokenizer, task.reward, max_new_tokens, chat_template, system_prompt, reward_timeout, episodes)
    if not isinstance(llm, TransformersEngine):
        return dist.on_main(lambda: _metrics([_evaluate(llm, task.eval, *how)]))
    calls = llm.calls
    mine = [_evaluate(llm, examples, *how) for examples in eval_batches(task.eval, EVAL_BATCH)]
    llm.calls = calls + 1  # an evaluation is one call however it is cut: the samples after it do not depend on that
    ranks = dist.all_gather_objects([mine])
    return _metrics([part[b] for b in range(len(mine)) for part in ranks])  # the split's order


def eval_batches(items: list, batch_size: int) -> list[list]:
    """This rank's share of items, in batches of at most batch_size, as many on every rank (the ranks decode
    in step): the fewest even cuts of at most N * batch_size items, each cut shared evenly among the N ranks,
    in rank order. A rank's batch is empty only where the split has fewer items than there are ranks."""
    cuts = even_parts(items, max(1, -(-len(items) // (dist.world_size() * batch_size))))
    return [even_parts(cut, dist.world_size())[dist.rank()] for cut in cuts]


def even_parts(items: list, k: int) -> list[list]:
    """items cut into k contiguous parts whose sizes differ by one at most (the longer ones first)."""
    q, r = divmod(len(items), k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _evaluate(llm, examples: list[dict], tokenizer, reward, max_new_tokens: int, chat_template: bool,
              system_prompt: str | None, reward_timeout: float, episodes) -> tuple:
    """(rewards, timeouts, more metrics, episodes' count) of greedy completions of examples."""
    SamplingParams = _sampling_params_class(llm)
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], chat_template, system_prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    with awake(llm):
        if episodes is None:  # an empty share (fewer prompts than ranks) still decodes along
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
            answers, more = [o.outputs[0].text for o in outputs], {}
        else:
            answers, more, examples = episodes(prompt_ids, examples)  # examples: with what the episodes add
    verifier = Reward([RewardTerm("correct", reward, 1.0, "correct")], reward_timeout)
    rewards, parts = verifier(answers, examples)
    return rewards, parts[TIMEOUTS], more, len(examples)


def _metrics(parts: list[tuple]) -> dict:
    """The metrics of a split from its parts' (_evaluate's), in the split's order: means over every
    example (a part's own means weighted by its size), counts (dist.is_count) summed."""
    rewards = torch.cat([p[0] for p in parts])
    more = parts[0][2] if len(parts) == 1 else {
        k: sum(p[2][k] * (1 if dist.is_count(k) else p[3]) for p in parts) /
        (1 if dist.is_count(k) else len(rewards)) for k in parts[0][2]}
    return {"eval/accuracy": (rewards >= 1.0).float().mean().item(), "eval/reward_mean": rewards.mean().item(),
            "eval/timeouts": torch.cat([p[1] for p in parts]).sum().item(), **more}


def still_running(llm, count: int) -> bool:
    """Whether requests remain: this rank's `count`, or with the transformers engine any rank's. Its
    ranks decode in step (a sharded forward needs every rank), so a rank whose episodes have ended
    still calls generate, with no request, until every rank's have."""
    return bool(dist.all_sum(count) if isinstance(llm, TransformersEngine) else count)


def sampled_logprobs(completions, num_completion_tokens: int, device) -> torch.Tensor:
    """vLLM's own log-probs of the tokens it sampled (processed: after temperature), [B, C], 0 on padding."""
    out = torch.zeros(len(completions), num_completion_tokens, device=device)
    for i, c in enumerate(completions):
        out[i, :len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return out


def sampling_params(args, tokenizer, **changes):
    """The rollout's vLLM sampling: n = --completions-per-prompt completions of each prompt at
    --temperature, truncated by --top-p / --top-k, at most --max-new-tokens, with the sampled token's
    log-prob (processed: of the truncated distribution, renormalized); a completion ends
    at EOS or at the chat template's end-of-turn token (which stays in its loss mask). Never a
    per-request seed: the engine is seeded once. changes: other values of SamplingParams' fields."""
    SamplingParams = _sampling_params_class(args.engine)
    return SamplingParams(**{"n": args.completions_per_prompt, "temperature": args.temperature,
                             "top_p": args.top_p, "top_k": args.top_k, "max_tokens": args.max_new_tokens,
                             "logprobs": 0, "stop_token_ids": stop_token_ids(tokenizer), **changes})


def _sampling_params_class(engine):
    """vLLM's SamplingParams, or the TransformersEngine's (engine: an engine or --engine's value).
    vLLM is imported here, not at the top: the transformers engine runs without it."""
    engine = getattr(engine, "engine_kind", engine)  # grpo_async.py's Remote: the rollout ranks' engine (its --engine)
    if engine == "transformers" or isinstance(engine, TransformersEngine):
        return SamplingParams
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams


# ---------------------------------------------------------------------------------------
# --engine transformers: sampling from the trainer's own policy, without vLLM
# ---------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """The fields of vLLM's SamplingParams the scripts set; temperature 0 is greedy."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0  # 1: off
    top_k: int = 0      # 0: off
    max_tokens: int = 16
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # strings that end a sample (the token that completes one is kept)
    include_stop_str_in_output: bool = False       # the text keeps the stop string (else it ends before it)


@dataclass
class Logprob:  # vLLM's, as sampled_logprobs reads it
    logprob: float


@dataclass
class CompletionOutput:  # vLLM's, as the scripts read it
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str  # "stop" (a stop token, kept as the last id) or "length"


@dataclass
class RequestOutput:  # vLLM's: a prompt's n completions
    outputs: list[CompletionOutput]


class TransformersEngine:
    """Rollouts by the trainer's own policy (sync_weights hands it over: no copy), decoded
    token by token with a KV cache, in the same calls and outputs as vLLM.

    Each sample draws its tokens by inverse CDF from uniforms of its own generator, seeded by
    (seed, the engine's call count, the sample's index in the whole batch): under torchrun,
    where rank r holds rows r*B..(r+1)*B-1 of the batch (dist.share), N ranks sample what one
    process samples. Log-probs are log_softmax(logits / temperature), vLLM's processed ones; with top_p or
    top_k, over the tokens vLLM's rule keeps (common/ops.py top_k_top_p_mask, the trainer's too), renormalized.
    Under FSDP every forward needs every rank, so the ranks decode in step until every rank's
    samples have ended. No sleep mode: nothing to free, the weights are the trainer's."""

    sleeps, asleep = False, frozenset()

    def __init__(self, name_or_path: str, seed: int, dtype: str):
        self.tokenizer = load_tokenizer(name_or_path)
        self.seed, self.calls, self.model = seed, 0, None
        self.autocast_dtype = torch.bfloat16 if dtype == "bfloat16" else None  # the trainer's own numerics
        self.memory = {"device": 0, "allocated": 0}  # no memory of its own

    def reset_prefix_cache(self) -> None:  # nothing cached across calls
        pass

    @torch.no_grad()
    def generate(self, requests: list[dict], params, use_tqdm: bool = False) -> list[RequestOutput]:
        """params: one SamplingParams, or one a request (as vLLM takes them) that differ in max_tokens only."""
        per_request = params if isinstance(params, (list, tuple)) else [params] * len(requests)
        params = per_request[0] if per_request else SamplingParams()
        need(all(replace(p, max_tokens=params.max_tokens) == params for p in per_request),
             "the transformers engine takes sampling parameters that differ in max_tokens only")
        rows = [r["prompt_token_ids"] for r in requests for _ in range(params.n)]
        max_tokens = [p.max_tokens for p in per_request for _ in range(params.n)]
        first = dist.first_index(len(rows))  # this rank's rows in the whole batch: where their seeds start
        if not rows:  # under torchrun the other ranks may still decode (see still_running): a stand-in row along
            if dist.world_size() == 1:
                return []
            rows, max_tokens, params = [[self.tokenizer.pad_token_id]], [1], replace(params, n=1)
        self.calls += 1
        # every rank takes every decode step (a sharded forward needs every rank): as many as the longest budget
        # of any rank's rows, also where that rank's own rows end sooner
        T = int(dist.all_gather(torch.tensor([max(max_tokens)])).max())
        training = self.model.training
        self.model.eval()  # no gradient checkpointing (it turns the KV cache off)
        try:
            device = next(self.model.parameters()).device
            with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                tokens, logprobs, lengths, stopped = self._decode(rows, max_tokens, T, params, first, device)
        finally:
            self.model.train(training)
        samples = [CompletionOutput(
            token_ids=tokens[i, :n].tolist(), text=self._text(tokens[i, :n], params),
            logprobs=[{t: Logprob(lp)} for t, lp in zip(tokens[i, :n].tolist(), logprobs[i, :n].tolist())],
            finish_reason="stop" if stopped[i] else "length") for i, n in enumerate(lengths.tolist())]
        return [RequestOutput(samples[i:i + params.n]) for i in range(0, len(samples), params.n)][:len(requests)]

    def _text(self, tokens: torch.Tensor, params: SamplingParams) -> str:
        """A sample's text as vLLM gives it: special tokens skipped, cut at the first stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        found = [(text.find(s), s) for s in params.stop if s in text]
        if found:
            at, s = min(found)
            text = text[:at + len(s) if params.include_stop_str_in_output else at]
        return text

    def _decode(self, rows: list[list[int]], max_tokens: list[int], T: int, params: SamplingParams, first: int,
                device):
        """(tokens [B, T], their log-probs [B, T], lengths [B], stopped [B]) of the rows' samples, in at most T
        steps (every rank's longest max_tokens: the ranks stop at the same step)."""
        B, pad = len(rows), self.tokenizer.pad_token_id
        P = max(len(r) for r in rows)
        input_ids = torch.full((B, P), pad, dtype=torch.long)
        attention_mask = torch.zeros(B, P, dtype=torch.long)
        for i, r in enumerate(rows):  # left-padded, as in the trainer's batches
            input_ids[i, P - len(r):], attention_mask[i, P - len(r):] = torch.tensor(r), 1
        uniforms = torch.stack([torch.rand(T, generator=torch.Generator().manual_seed(
            hash((self.seed, self.calls, first + i)) % 2**63)) for i in range(B)]).to(device)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = position_ids_of(attention_mask)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((B, T), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros(B, T, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        limits = torch.tensor(max_tokens, device=device)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)  # ended by a stop token or string
        done = lengths >= limits
        cache, ids = None, input_ids
        for t in range(T):
            out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            if params.temperature > 0:
                logits = logits / params.temperature
                if params.top_p < 1.0 or params.top_k > 0:  # truncated after the temperature, as vLLM does
                    logits = logits.masked_fill(~top_k_top_p_mask(logits, params.top_k, params.top_p), float("-inf"))
                logp = torch.log_softmax(logits, dim=-1)
                cdf = logp.exp().cumsum(-1)
                # the first token whose CDF reaches u * total, u in (0, 1]: never one of probability 0
                token = torch.searchsorted(cdf, ((1 - uniforms[:, t]) * cdf[:, -1])[:, None])[:, 0]
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = logits.argmax(-1)
            running = ~done  # the rows still sampling: each has t tokens so far
            tokens[running, t] = token[running]
            logprobs[running, t] = logp[running].gather(-1, token[running, None])[:, 0]
            lengths += running
            stopped |= running & torch.isin(token, stop_ids)
            if params.stop:  # stop strings: read the text of the rows still going
                for i in (running & ~stopped).nonzero().flatten().tolist():
                    text = self.tokenizer.decode(tokens[i, :t + 1])
                    stopped[i] = any(s in text for s in params.stop)
            done = stopped | (lengths >= limits)  # a row at its own max_tokens ends: "length"
            if dist.all_sum((~done).sum()) == 0:
                break  # every rank's samples have ended
            ids = tokens[:, t:t + 1]
            attention_mask = torch.cat([attention_mask, running[:, None].long()], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return tokens, logprobs, lengths, stopped
