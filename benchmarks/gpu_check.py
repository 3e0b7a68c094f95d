"""The trainer's side on a GPU: one full policy update of a Qwen2.5-0.5B-sized model, measured.

The GPU machine this project can borrow has torch, transformers and peft but no vLLM, so the
rollout cannot run there; everything after it can. This script builds a randomly initialized
model with Qwen2.5-0.5B-Instruct's architecture (its config is written out below: nothing is
downloaded), fills a batch shaped like a rollout (left-padded prompts | right-padded
completions of varied lengths, random tokens and advantages) and runs the update the scripts
run, with their functions from common/ops.py:

    old log-probs     one no-grad pass, micro-batch by micro-batch (batched_logprobs)
    per micro-batch   forward_logprobs (with entropy) under bf16 autocast on CUDA, GRPO's clipped
                      loss aggregated over the whole minibatch (aggregate), backward
    then              clip_grad_norm_, AdamW step (fp32 weights, as the scripts' default)

in four variants: full fine-tuning or LoRA (rank 16 on every attention and MLP projection),
each with and without gradient checkpointing. --updates such updates run per variant (the
first pays one-time costs: CUDA kernels, AdamW state; LoRA's A matrices get their first
gradient in the second, since B starts at zero). One line per variant gives, for the last
update: completion tokens per second (forward + backward + optimizer step), peak memory (on
CUDA torch's max allocated since the variant started; on CPU the process's peak RSS so far),
the loss, the gradient norm and the mean entropy (ln(vocab) ~ 11.9 for a random model). Each
variant also checks that the updates changed the trainable weights and nothing else. The exit
status is non-zero if a loss or gradient norm is NaN/inf, a variant runs out of memory, or a
check fails; a LoRA variant without peft installed is reported as skipped, not as a failure.

Not in the peak: vLLM (its weights and KV cache, --vllm-gpu-memory-utilization of the GPU in a
real run) and the frozen reference model (loaded when --kl-coef > 0; with LoRA it is the same
model with adapters off). Add those to the numbers here.

Then four more checks (--checks picks them):

    process_group   a one-GPU process group created as common/dist.py creates it (dist.backend:
                    NCCL for CUDA tensors, gloo for CPU ones), every kind of collective the
                    scripts hand it (CPU metrics and signal flags, device sums and gathers,
                    pickled objects, barriers), and dist.shard (FSDP2, bf16 mixed precision on
                    CUDA) of the model: one update, gradient checkpointing (the same gradient),
                    the LoRA merge of sharded weights (the unsharded model's merge)
    scripts         grpo.py and ppo.py end to end with --engine transformers (no vLLM): on the
                    bundled tiny model (--script-steps steps: does it learn?) and on a random
                    model of --config (3 steps: step time, memory, log-prob mismatch), under the
                    scripts' own defaults for the device (bf16 on CUDA); grpo_multiturn.py's
                    episodes on the tiny model (more than one turn)
    sampling        per-rank sampling noise: two ranks (simulated) given the same prompt sample
                    different completions, and one rank the same ones again
    packing         the bytes of a packed micro-batch's attention mask at these sizes, against
                    common/batch.py's bound

On a GPU machine, from the repository root (needs torch, transformers, optionally peft; about
5 minutes on one H200 by an estimate, not yet measured):

    python benchmarks/gpu_check.py --json gpu_check.json

The defaults are the GPU recipe's (docs/gpu.md): micro-batch 16, 512 tokens (128 prompt + 384
completion). On CPU, at toy size: python benchmarks/gpu_check.py --config tiny --device cpu
--script-steps 2 ... (tests/test_gpu_check.py)
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
# the repository root, and the pure-Python packages the scripts need beyond torch, transformers
# and peft (tyro and its two dependencies), where benchmarks/gpu_deps.sh put them for a bare GPU machine
SITE = [str(ROOT), *[str(p) for p in [ROOT / ".gpu_deps"] if p.is_dir()]]
sys.path[:0] = SITE

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

# the scripts import vLLM only for --engine vllm: their own loss runs here
import grpo  # noqa: E402
from common import dist  # noqa: E402
from common.batch import MAX_PACKED_MASK_BYTES, make_batch, packed_mask_bytes  # noqa: E402
from common.engine import SamplingParams, create_engine, sync_weights  # noqa: E402
from common.models import load_policy, load_tokenizer, merged_weights  # noqa: E402
from common.ops import batched_logprobs, forward_logprobs, masked_mean  # noqa: E402
from common.setup import Precision  # noqa: E402

try:
    import peft
except ImportError:  # the LoRA variants are then skipped
    peft = None

# Qwen/Qwen2.5-0.5B-Instruct's config.json, the fields that shape the model. Checked against
# the published config and its parameter count (494,032,768 with tied embeddings, which this
# gives): hidden 896, 24 layers, 14 query and 2 key-value heads (head_dim 64), MLP 4864, vocab
# 151936, tied embeddings, rope theta 1e6, 32768 positions, RMSNorm eps 1e-6, SiLU, no sliding
# window; the q/k/v biases are part of the Qwen2 architecture itself.
CONFIGS = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                         use_sliding_window=False),
    # the same architecture at toy size, for the CPU test
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True),
}

VARIANTS = {  # name: (LoRA, gradient checkpointing)
    "full": (False, False),
    "full+gc": (False, True),
    "lora": (True, False),
    "lora+gc": (True, True),
}
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# the README recipe's learning rate and grpo.py's defaults
LR, MAX_GRAD_NORM, TEMPERATURE = 1e-6, 1.0, 1.0
EPS_LOW, EPS_HIGH, LOSS_AGG = 0.2, 0.2, "seq-mean-token-mean"
PAD_TOKEN_ID = 0  # make_batch finds padding by position, so the id does not matter
SEED = 0


GRPO_ARGS = grpo.Args(eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_agg=LOSS_AGG, kl_coef=0.0)


def grpo_loss(logprobs, old_logprobs, advantages, mask, num_tokens, num_seqs):
    """grpo.compute_loss (the clipped surrogate, aggregated over the minibatch) without its KL
    term (no reference model is held here) and without importance weights (no vLLM)."""
    return grpo.compute_loss(logprobs, old_logprobs, None, advantages, 1.0, mask, GRPO_ARGS, num_tokens, num_seqs)[0]


def rollout_batch(vocab_size: int, batch_size: int, prompt_len: int, completion_len: int, device):
    """Random prompts and completions in the scripts' layout, lengths between half and all of
    the maximum; the first row is full length, so the padded shape (which sets the memory) is
    batch_size x (prompt_len + completion_len). Advantages ~ N(0, 1), as GRPO's normalized ones."""
    g = torch.Generator().manual_seed(SEED)

    def lengths(longest: int) -> list[int]:
        n = torch.randint(max(1, longest // 2), longest + 1, (batch_size,), generator=g)
        n[0] = longest
        return n.tolist()

    prompts = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths(prompt_len)]
    completions = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths(completion_len)]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, PAD_TOKEN_ID, device)
    advantages = torch.randn(batch_size, generator=g).to(device)
    return input_ids, attention_mask, completion_mask, advantages


def build_model(config_name: str, device: torch.device, lora: bool, gradient_checkpointing: bool):
    """A randomly initialized fp32 model, set up as common.models.load_policy does (gradient
    checkpointing on the transformers model), then wrapped in LoRA adapters if asked."""
    with device:  # initialize on the device: far faster for 494M parameters on a GPU
        model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[config_name]))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM"))
    return model.train()


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: wait for the work queued so far
    return time.perf_counter()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure(lora: bool, gradient_checkpointing: bool, args, device: torch.device) -> dict:
    """Build one variant's model and optimizer, run args.updates updates, return the numbers."""
    torch.manual_seed(SEED)  # every variant starts from the same base weights
    model = build_model(args.config, device, lora, gradient_checkpointing)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=LR, weight_decay=0.0)
    B, mbs = args.micro_batch_size * args.micro_batches, args.micro_batch_size
    input_ids, attention_mask, completion_mask, advantages = rollout_batch(
        model.config.vocab_size, B, args.prompt_len, args.completion_len, device)
    C = completion_mask.shape[1]
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None  # the scripts' --bf16-autocast
    # on the host, so that the comparison after the updates costs no device memory
    before = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}

    losses, grad_norms = [], []
    for _ in range(args.updates):
        t0 = clock(device)
        old_logprobs = batched_logprobs(model, input_ids, attention_mask, C, TEMPERATURE, mbs, autocast_dtype)
        t1 = clock(device)
        # one minibatch: the micro-batches' gradients accumulate into one optimizer step
        num_tokens, loss_sum, entropies = completion_mask.sum(), 0.0, []
        for i in range(0, B, mbs):
            micro = slice(i, i + mbs)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logprobs, entropy = forward_logprobs(model, input_ids[micro], attention_mask[micro], C,
                                                     TEMPERATURE, with_entropy=True)
            loss = grpo_loss(logprobs, old_logprobs[micro], advantages[micro], completion_mask[micro], num_tokens, B)
            loss.backward()  # micro-batch losses add up to the minibatch loss
            loss_sum += loss.item()
            entropies.append(masked_mean(entropy, completion_mask[micro]).item())
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable.values(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = clock(device)
        losses.append(loss_sum)
        grad_norms.append(float(grad_norm))

    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach().cpu())}
    completion_tokens = int(completion_mask.sum())
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in trainable.values()),
        "completion_tokens": completion_tokens,
        "padded_tokens": input_ids.numel(),
        "logprobs_s": t1 - t0,
        "update_s": t2 - t1,
        "tokens_per_s": completion_tokens / (t2 - t1),
        "peak_memory_gib": peak_memory_gib(device),
        "loss": losses[-1],
        "grad_norm": grad_norms[-1],
        "entropy": sum(entropies) / len(entropies),
        "losses": losses,
        "grad_norms": grad_norms,
        "trainable_tensors": len(trainable),
        "trainable_changed": len(changed & trainable.keys()),
        "unchanged_trainable": sorted(trainable.keys() - changed),
        "frozen_tensors": len(before) - len(trainable),
        "frozen_changed": len(changed - trainable.keys()),
    }


def run_variant(name: str, args, device: torch.device) -> dict:
    lora, gradient_checkpointing = VARIANTS[name]
    if lora and peft is None:
        return {"variant": name, "status": "skipped: peft is not installed"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        result = {"variant": name, **measure(lora, gradient_checkpointing, args, device)}
    except torch.OutOfMemoryError:
        result = {"variant": name, "status": "FAILED: out of memory"}
    # the model and optimizer died with measure(): give their memory back before the next variant
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "status" in result:
        return result
    problems = []
    if not all(math.isfinite(x) for x in result["losses"] + result["grad_norms"]):
        problems.append("loss or grad norm not finite")
    if result["trainable_changed"] == 0:
        problems.append("the updates changed no trainable weight")
    if result["frozen_changed"]:
        problems.append(f"{result['frozen_changed']} frozen tensors changed")
    result["status"] = "FAILED: " + "; ".join(problems) if problems else "ok"
    return result


# ---------------------------------------------------------------------------------------
# process_group: the collectives the scripts make, on a group made as common/dist.py makes it
# ---------------------------------------------------------------------------------------

def check_process_group(args, device: torch.device) -> dict:
    """A one-process group with dist.backend(device) (a GPU takes one NCCL rank; --backend another),
    each kind of collective common/dist.py and common/interrupt.py hand it, then dist.shard (FSDP2)
    of the --config model and one update through it. {name: "ok" or the error}, and "status"."""
    results, backend = {}, args.backend or dist.backend(device.type)
    with tempfile.TemporaryDirectory() as folder:
        try:
            tdist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
        except Exception as e:  # noqa: BLE001 - a backend this torch or device lacks, or a group made before
            return {"backend": backend, "status": f"FAILED: {type(e).__name__}: {e}"}
        try:
            collectives = {  # what each carries in the scripts (tests/test_dist.py records them on CPU)
                "all_reduce of CPU float64 (metrics: mean_over_ranks)":
                    lambda: tdist.all_reduce(torch.ones(3, dtype=torch.float64)),
                "all_gather of CPU int64 (signal flags: GracefulInterrupt.stop)":
                    lambda: tdist.all_gather([torch.zeros(1, dtype=torch.long)], torch.ones(1, dtype=torch.long)),
                "all_reduce of device float64 (normalizers, baselines: all_sum)":
                    lambda: tdist.all_reduce(torch.ones(2, dtype=torch.float64, device=device)),
                "all_gather of device float32 (rewards: all_gather)":
                    lambda: tdist.all_gather([torch.zeros(4, device=device)], torch.ones(4, device=device)),
                "all_gather_object (DAPO's kept groups)": lambda: tdist.all_gather_object([None], [1, "a"]),
                "broadcast_object_list (evaluation: on_main)": lambda: tdist.broadcast_object_list([{"a": 1}], src=0),
                "barrier (checkpoints)": tdist.barrier,
                "FSDP2 shard and one update": lambda: sharded_update(args, device),
                "FSDP2 with gradient checkpointing (the same gradient)": lambda: sharded_checkpointing(args, device),
                "LoRA merge of sharded weights (the unsharded merge)": lambda: sharded_lora_merge(args, device),
            }
            for name, collective in collectives.items():
                try:
                    outcome = collective()
                    results[name] = outcome if isinstance(outcome, str) else "ok"  # a check may say "skipped"
                except Exception as e:  # noqa: BLE001 - each is reported, the others still run
                    results[name] = f"FAILED: {type(e).__name__}: {e}"
        finally:
            tdist.destroy_process_group()
    failed = [k for k, v in results.items() if v.startswith("FAILED")]
    return {"backend": backend, **results,
            "status": "FAILED: " + "; ".join(failed) if failed else "ok"}


def precision_of(device: torch.device) -> Precision:
    """The scripts' numerics on this device (--precision auto): bf16 on CUDA, fp32 on CPU."""
    return Precision.of(argparse.Namespace(precision="auto", rollout_correction="auto", rollout_correction_cap=None,
                                           rollout_correction_low=None, rollout_correction_high=None,
                                           dtype="float32"), device.type)


def shard(model, device: torch.device):
    """dist.shard of the model (a one-process run leaves its model unsharded: the world size is made
    2 for the call, the mesh is the group's one rank), in the scripts' precision for the device:
    on CUDA FSDP2's mixed precision, bf16 weights gathered, gradients reduced in fp32."""
    with mock.patch.object(dist, "world_size", lambda: 2):
        return dist.shard(model, precision_of(device))


def sharded_grad(args, device: torch.device, gradient_checkpointing: bool, step: bool = False) -> dict:
    """The gradient of one GRPO loss through the sharded --config model ({name: whole gradient});
    step: then clip and an AdamW step, checked to move every weight."""
    torch.manual_seed(SEED)
    model = shard(build_model(args.config, device, lora=False, gradient_checkpointing=gradient_checkpointing),
                  device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    input_ids, attention_mask, completion_mask, advantages = rollout_batch(
        model.config.vocab_size, args.micro_batch_size, args.prompt_len, args.completion_len, device)
    C = completion_mask.shape[1]
    with precision_of(device).autocast(device.type):
        logprobs = forward_logprobs(model, input_ids, attention_mask, C, TEMPERATURE)
    loss = grpo_loss(logprobs, logprobs.detach(), advantages, completion_mask, completion_mask.sum(),
                     len(input_ids))
    loss.backward()
    grads = {n: dist.full_tensor(p.grad).detach().float().cpu() for n, p in model.named_parameters()}
    if step:
        before = {n: dist.full_tensor(p).detach().clone() for n, p in model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        assert math.isfinite(float(dist.full_tensor(grad_norm))), "gradient norm not finite"
        moved = sum(not torch.equal(before[n], dist.full_tensor(p)) for n, p in model.named_parameters())
        assert moved == len(before), f"the update moved {moved} of {len(before)} sharded weights"
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return grads


def sharded_update(args, device: torch.device) -> None:
    """dist.shard of the --config model and one update through it."""
    sharded_grad(args, device, gradient_checkpointing=False, step=True)


def relative_difference(a: dict, b: dict) -> float:
    a, b = (torch.cat([t[n].flatten() for n in sorted(a)]) for t in (a, b))
    return float((a - b).norm() / a.norm())


def sharded_checkpointing(args, device: torch.device) -> None:
    """Gradient checkpointing under FSDP2 (the backward gathers each layer again to recompute it):
    the same gradient as without it, to the rounding of the precision (bf16 on CUDA)."""
    off, on = (sharded_grad(args, device, gradient_checkpointing) for gradient_checkpointing in (False, True))
    tolerance = 1e-2 if precision_of(device).autocast_dtype else 1e-5
    difference = relative_difference(off, on)
    assert difference < tolerance, f"checkpointing changed the gradient by {difference:.1e} of its norm"


def sharded_lora_merge(args, device: torch.device) -> None:
    """What vLLM and final/ get from a sharded LoRA policy (common.models.merged_weights: W + scale *
    B A of the sharded W, A and B, gathered weight by weight) is the merge of the same model unsharded."""
    if peft is None:
        return "skipped: peft is not installed"
    torch.manual_seed(SEED)
    model = build_model(args.config, device, lora=True, gradient_checkpointing=False)
    with torch.no_grad():  # adapters that change the model (B starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    whole = {n: t.clone() for n, t in merged_weights(model)}
    sharded = dict(merged_weights(shard(model, device)))
    assert sharded.keys() == whole.keys(), "the sharded merge names other weights"
    changed = [n for n in whole if not torch.allclose(whole[n], sharded[n], rtol=1e-5, atol=1e-7)]
    assert not changed, f"the sharded merge differs in {len(changed)} weights, e.g. {changed[0]}"
    del model, whole, sharded
    gc.collect()


# ---------------------------------------------------------------------------------------
# scripts: grpo.py and ppo.py end to end, --engine transformers
# ---------------------------------------------------------------------------------------

def random_model(config_name: str, folder: Path) -> str:
    """A randomly initialized model of --config saved with the bundled tokenizer (nothing is
    downloaded; token ids past the tokenizer's vocabulary decode to nothing): memory and time
    as the real model's, rewards 0."""
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[config_name], eos_token_id=1, pad_token_id=0))
    model.save_pretrained(folder)
    for name in os.listdir(ROOT / "models" / "tiny-sort"):
        if "token" in name or name.endswith((".jinja", ".txt")):  # the tokenizer's files, not its model
            shutil.copy(ROOT / "models" / "tiny-sort" / name, folder / name)
    return str(folder)


MULTITURN = ["--task", "sort", "--env", "examples/my_env.py:retry", "--max-new-tokens", "40", "--max-turn-tokens", "12"]


def run_script(script: str, model: str, flags: list[str], folder: Path, learn: bool) -> dict:
    """python SCRIPT --engine transformers ... as a user runs it; the numbers from its run folder."""
    out = folder / f"{script[:-3]}-{Path(model).name}"
    command = [sys.executable, script, "--engine", "transformers", "--model", model, "--output-dir", str(out),
               "--save-every", "0", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(SITE + [os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    result = {"script": script, "model": Path(model).name, "flags": flags, "wall_s": time.perf_counter() - t0,
              "exit_code": proc.returncode}
    if proc.returncode != 0:
        return {**result, "status": f"FAILED: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in rows if "time/step" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steady = [r for r in steps if r["step"] > 1] or steps  # the first step pays one-time costs
    median = {k: statistics.median(r[k] for r in steady) for k in ("time/step", "time/rollout", "time/logprobs",
                                                                    "time/train")}
    result.update(steps=len(steps), first_step_s=steps[0]["time/step"], **{f"median_{k[5:]}_s": v
                                                                           for k, v in median.items()},
                  peak_memory_gib=max(r["memory/peak_gib"] for r in steps),
                  logprob_mismatch=statistics.mean(r["rollout/logprob_mismatch"] for r in steps),
                  accuracy_start=evals[0], accuracy_end=evals[-1],
                  losses_finite=all(math.isfinite(v) for r in steps for k, v in r.items() if k.startswith("loss/")),
                  turns_mean=statistics.mean(r.get("env/turns_mean", 1) for r in steps))
    problems = [] if result["losses_finite"] else ["a loss is not finite"]
    if learn and result["accuracy_end"] < result["accuracy_start"] + 0.25:
        problems.append(f"did not learn: held-out accuracy {evals[0]:.2f} -> {evals[-1]:.2f}")
    return {**result, "status": "FAILED: " + "; ".join(problems) if problems else "ok"}


def check_scripts(args, device: torch.device) -> list[dict]:
    """grpo.py and ppo.py with --engine transformers: the tiny model learns in --script-steps
    steps (its defaults), a random --config model runs --script-steps-large steps at the
    recipe's sizes (--prompt-len is the task's: sort prompts are short)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        large = random_model(args.config, tmp / args.config)
        learn = args.script_steps >= 10  # fewer steps (the CPU test's toy size) run small batches, unchecked
        batch = ["--prompts-per-step", str(args.micro_batch_size), "--completions-per-prompt", "4",
                 "--micro-batch-size", str(args.micro_batch_size)]
        for script in ("grpo.py", "ppo.py"):
            flags = ["--steps", str(args.script_steps), "--eval-every", "0", *([] if learn else batch)]
            results.append(run_script(script, str(ROOT / "models" / "tiny-sort"), flags, tmp, learn))
            print(describe_script(results[-1]), flush=True)
            flags = ["--steps", str(args.script_steps_large), "--eval-every", "0", *batch,
                     "--max-new-tokens", str(args.completion_len), "--lr", str(LR)]
            results.append(run_script(script, large, flags, tmp, learn=False))
            print(describe_script(results[-1]), flush=True)
        # multi-turn episodes: the retry environment answers a wrong sort, the policy tries again
        flags = ["--steps", str(args.script_steps), "--eval-every", "0", *batch, *MULTITURN]
        results.append(run_script("grpo_multiturn.py", str(ROOT / "models" / "tiny-sort"), flags, tmp, learn=False))
        if results[-1]["status"] == "ok" and not results[-1]["turns_mean"] > 1:
            results[-1]["status"] = f"FAILED: no multi-turn episodes (mean turns {results[-1]['turns_mean']})"
        print(describe_script(results[-1]), flush=True)
    return results


def describe_script(r: dict) -> str:
    if "steps" not in r:
        return f"{r['script']:8s} {r['model']:14s} {r['status']}"
    return (f"{r['script']:8s} {r['model']:14s} {r['steps']} steps, median step {r['median_step_s']:.2f} s "
            f"(rollout {r['median_rollout_s']:.2f}, log-probs {r['median_logprobs_s']:.2f}, train "
            f"{r['median_train_s']:.2f}; first {r['first_step_s']:.2f})  peak {r['peak_memory_gib']:.2f} GiB  "
            f"mismatch {r['logprob_mismatch']:.1e}  accuracy {r['accuracy_start']:.2f} -> {r['accuracy_end']:.2f}  "
            f"{r['status']}")


def check_sampling(device: torch.device) -> dict:
    """Per-rank sampling noise, as the scripts' transformers engine draws it: rank 0 and rank 1 of a
    2-rank job (simulated: their place in the whole batch), given the same prompt, sample different
    completions; the same rank again samples the same ones (seeded, not the global RNG)."""
    tokenizer = load_tokenizer(str(ROOT / "models" / "tiny-sort"))
    policy = load_policy(str(ROOT / "models" / "tiny-sort"), tokenizer, "float32", str(device))
    prompt = tokenizer("sort 52813:")["input_ids"]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, logprobs=0, stop_token_ids=[tokenizer.eos_token_id])

    def completions(rank: int) -> list[list[int]]:
        llm = create_engine(str(ROOT / "models" / "tiny-sort"), seed=SEED, max_model_len=64,
                            dtype=precision_of(device).engine_dtype, engine="transformers")
        sync_weights(llm, policy)
        with mock.patch.object(dist, "rank", lambda: rank), \
                mock.patch.object(dist, "first_index", lambda count: rank * count):
            return [c.token_ids for c in llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs]

    rank_0, rank_1, rank_0_again = completions(0), completions(1), completions(0)
    problems = ["two ranks sampled the same completions of one prompt"] if rank_0 == rank_1 else []
    problems += ["one rank's samples are not reproducible"] if rank_0 != rank_0_again else []
    return {"rank_0": rank_0, "rank_1": rank_1, "status": "FAILED: " + "; ".join(problems) if problems else "ok"}


def check_packing(args) -> dict:
    """The packed attention mask's bytes for a micro-batch at these sizes (packed row <= micro-batch
    x (prompt + completion) tokens), against common/batch.py's bound (above it, no packing)."""
    L = args.micro_batch_size * (args.prompt_len + args.completion_len)
    return {"packed_len": L, "bound_bytes": MAX_PACKED_MASK_BYTES,
            **{f"{a}_mask_bytes": packed_mask_bytes(L, a) for a in ("sdpa", "eager")},
            "status": "ok"}


def describe(result: dict, device: torch.device) -> str:
    if "loss" not in result:
        return f"{result['variant']:8s} {result['status']}"
    memory = "peak GPU memory allocated" if device.type == "cuda" else "peak process RSS"
    return (f"{result['variant']:8s} {result['tokens_per_s']:>10,.0f} tokens/s  {memory} "
            f"{result['peak_memory_gib']:6.2f} GiB  loss {result['loss']:+.5f}  grad norm {result['grad_norm']:.4f}  "
            f"entropy {result['entropy']:.2f}  trainable {result['trainable_params'] / 1e6:.2f}M  "
            f"changed {result['trainable_changed']}/{result['trainable_tensors']}  {result['status']}")


CHECKS = ["update", "process_group", "scripts", "sampling", "packing"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", choices=list(CONFIGS), default="qwen2.5-0.5b",
                   help="model architecture (tiny: a toy Qwen2 for CPU tests)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="sequences per forward/backward")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches accumulated into the one optimizer step")
    p.add_argument("--prompt-len", type=int, default=128, help="longest prompt, tokens")
    p.add_argument("--completion-len", type=int, default=384, help="longest completion, tokens")
    p.add_argument("--updates", type=int, default=2, help="updates per variant; the numbers printed are the last one's")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=CHECKS, help="which checks run (default: all)")
    p.add_argument("--backend", help="the process group's backend (default: common/dist.py's for the device; "
                   "--backend nccl shows the CPU tensors a plain NCCL group refuses)")
    p.add_argument("--script-steps", type=int, default=10, help="steps of the scripts on the tiny model (>= 10: "
                   "learning is checked)")
    p.add_argument("--script-steps-large", type=int, default=3, help="steps of the scripts on the --config model")
    p.add_argument("--json", metavar="PATH", help="also write the numbers, device and versions here")
    args = p.parse_args(argv)
    for flag in ("micro_batch_size", "micro_batches", "prompt_len", "completion_len", "updates", "script_steps",
                 "script_steps_large"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    """Run the variants, print a line each; return the exit status (0: all ran and passed)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "peft": peft.__version__ if peft is not None else None}
    print(f"{device_name}  " + "  ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()))
    print(f"{args.config}, fp32 weights{', bf16 autocast' if device.type == 'cuda' else ''}: "
          f"{args.micro_batches} x {args.micro_batch_size} sequences of <= {args.prompt_len} prompt + "
          f"{args.completion_len} completion tokens, {args.updates} updates per variant")

    results, report = [], {}
    if "update" in args.checks:
        for name in args.variants:
            results.append(run_variant(name, args, device))
            print(describe(results[-1], device), flush=True)
    if "process_group" in args.checks:
        report["process_group"] = check_process_group(args, device)
        print(f"process group ({report['process_group']['backend']}), collectives and FSDP2: "
              f"{report['process_group']['status']}", flush=True)
    if "scripts" in args.checks:
        report["scripts"] = check_scripts(args, device)
    if "sampling" in args.checks:
        report["sampling"] = check_sampling(device)
        print(f"per-rank sampling noise (two ranks, one prompt): {report['sampling']['status']}", flush=True)
    if "packing" in args.checks:
        report["packing"] = check_packing(args)
        print(f"packed mask at {report['packing']['packed_len']} tokens: {report['packing']['sdpa_mask_bytes']:,} "
              f"bytes (sdpa), bound {MAX_PACKED_MASK_BYTES:,}", flush=True)

    if args.json:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "device": device_name, **versions, "args": vars(args), "variants": results, **report}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failed = [r["variant"] for r in results if r["status"].startswith("FAILED")]
    failed += [f"scripts: {r['script']} on {r['model']}" for r in report.get("scripts", [])
               if r["status"].startswith("FAILED")]
    failed += [name for name in ("process_group", "sampling", "packing")
               if report.get(name, {}).get("status", "ok") != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
