"""GRPO, asynchronous: sampling runs ahead of training by at most K policy versions, and the loss
corrects for it with the decoupled PPO objective (AReaL: Fu et al. 2025, arXiv:2505.24298).

grpo.py alternates: the engine samples batch s from the policy of step s (version s), then the
trainer trains on it while the engine waits. Here the batch trained at step s may come from an
older policy, version v >= s - K (K = --max-staleness): the engine samples the batches of the
next K steps while the trainer trains, each once it holds weights of version >= its step - K
(else it waits: no sample is ever older than K, none is dropped). K = 0 is grpo.py exactly. The
sampler's policy pi_behav is then not pi_old, so the clip is taken against a proximal policy,
pi_prox = the trainer's own policy before this step's update (its log-probs recomputed, as grpo.py's
pi_old), and each token is weighted by w(pi_prox / pi_behav), --rollout-correction's menu:

    L = agg_{i,t} [ -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i) * w_t + beta * KL_t ]
    r_t = pi / pi_prox,   w_t = w(rho_t),   rho_t = pi_prox(y_t) / pi_behav(y_t)

which is grpo.py's loss read with pi_old = pi_prox and the engine's log-probs those of version
v: the code is the same, the correction is on by default (auto: token-truncate, min(rho_t, 2),
where K > 0; --rollout-correction off trains on stale samples without it).

Under torchrun the last --rollout-ranks R processes sample (vLLM, or --engine transformers) and the
others train (FSDP2 among themselves); weights go to the rollout ranks by broadcast after each sync
(common/rollouts.py, common/dist.py split). Separate processes, not threads in one: the engine and the
trainer each keep a device and Python's interpreter to themselves, and the weights cross the same
NCCL/gloo broadcast as any collective. torchrun ranks, not a separate server: one launch, one process
group, and each side's ranks are any script's ranks (reductions, checkpoints, signals) with no second
framework or HTTP API to run. One process (python grpo_async.py) runs both sides in turn, in the order
they overlap under torchrun: the same batches, versions and losses, without the speed (tests, laptops).
The notation GRPO's family shares, the same block in each of its scripts:

    A_i  = (R_i - mean_j R_j) / (std_j R_j + eps)         (--no-scale-rewards: no std)
    r_t  = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)      (num_epochs x num_minibatches steps a batch: r_t leaves 1)
    w_t  = w(rho_t), rho_t = pi_old(y_t) / pi_vllm(y_t)   (--rollout-correction, for vLLM's own numerics; auto:
                                                           min(rho_t, 2) in bf16, 1 in fp32; weight 0: token masked)
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (k3; beta = --kl-coef, 0: no reference model)
      or sg(r_t) (logp_t - ref_t)^2 / 2                   (--kl-estimator k2-is: its gradient is unbiased for
                                                           grad KL(pi || pi_ref), see common/ops.py kl_loss)
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weight sync is a copy
if __name__ == "__main__":
    from common.allocator import use_tcmalloc

    use_tcmalloc()  # on CPU: this process again, with tcmalloc preloaded, before torch is imported

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro

from common import dist
from common.args import cli
from common.batch import draw_minibatches, micro_batches, rollout_batch
from common.engine import awake, create_engine, sampled_logprobs, sampling_params
from common.errors import need
from common.guard import step_if_finite
from common.metrics import minibatch_stats, step_metrics, timed
from common.models import encode_prompts, load_policy, load_reference
from common.ops import (RolloutCorrection, aggregate, batched_logprobs, forward_logprobs, kl_loss, masked_mean,
                        rollout_correction)
from common.rollouts import Ahead, Remote, serve
from common.run import Run, seed_everything
from common.setup import Precision, engine_options, prepare


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment: run folders are runs/EXP_NAME__TASK__SEED__TIME"""
    model: str = "models/tiny-sort"
    """hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or local folder of the initial policy"""
    task: str = "sort"
    """task name from common/tasks.py, or your own: FILE.py:FUNCTION returning a Task (see examples/)"""
    reward: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """reward terms whose weighted sum replaces the task's reward, one flag each: NAME[:WEIGHT], NAME a
    built-in (correct: the task's verifier; format: <answer> tags or \\boxed{} present) or FILE.py:FUNCTION
    taking (completion, example) (see common/rewards.py); none: the task's own"""
    seed: int = 0
    steps: int = 100
    """rollout-and-update iterations"""
    output_dir: str | None = None
    """the run folder: metrics, checkpoints, final model (default: runs/EXP_NAME__TASK__SEED__TIME); new or empty"""
    overwrite: bool = False
    """empty --output-dir first if an earlier run is in it (without it, such a folder is refused)"""
    resume: str | None = None
    """checkpoint (runs/.../checkpoints/step_N) or run folder (its latest checkpoint) to continue;
    the run's own arguments are restored (see RESUMABLE_CHANGES in common/args.py)"""

    # rollout
    prompts_per_step: int = 32
    """distinct prompts sampled per step"""
    completions_per_prompt: int = 8
    """G: completions per prompt, the group that defines the baseline"""
    max_new_tokens: int = 12
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    top_p: float = 1.0
    """nucleus sampling: the most likely tokens up to this total probability (1: off); the trainer's log-probs are
    those of the same truncated distribution, renormalized (common/ops.py top_k_top_p_mask)"""
    top_k: int = 0
    """sampling among the k most likely tokens only (0: off); before --top-p, as vLLM truncates (and the trainer)"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template: raw text)"""
    system_prompt: str | None = None
    """system message of chat-template prompts"""

    # asynchrony
    max_staleness: int = 1
    """K: the batch trained at step s was sampled by the policy of step s - K or later; 0: grpo.py's order"""
    sync_every: int = 1
    """send the trainer's weights to the engine after every N steps (and before each evaluation); at most K + 1,
    so that the engine reaches the version the next batch needs"""
    rollout_ranks: int = 1
    """under torchrun: the last R ranks run engines and sample while the others train (FSDP2 among themselves);
    0: every rank samples and trains in turn, as grpo.py's ranks do (one process: both in turn, whatever R)"""

    # optimization
    lr: float = 2e-4
    """AdamW's learning rate (ours, for the 1M-parameter default model; the papers' ~1e-6 is for billions)"""
    num_epochs: int = 1
    """passes over each rollout batch"""
    num_minibatches: int = 4
    """optimizer steps per pass over the rollout batch (ours: several, so the ratio leaves 1)"""
    micro_batch_size: int = 64
    """sequences per forward/backward (gradient accumulation within a minibatch)"""
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    """linear learning-rate warmup, in optimizer steps"""
    weight_decay: float = 0.0
    lora_rank: int = 0
    """train low-rank adapters of this rank (peft) instead of every weight of the policy; 0: full fine-tuning"""
    lora_alpha: float = 32.0
    """LoRA scale: the adapters add (alpha / rank) * B A to each target weight"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """the policy's modules that get adapters: all-linear (peft's: every linear layer but the output
    layer, whatever the architecture names them), or module names (q_proj v_proj)"""

    # algorithm
    eps_low: float = 0.2
    """lower clip range: ratio is clipped at 1 - eps_low (the paper's)"""
    eps_high: float = 0.2
    """upper clip range: ratio is clipped at 1 + eps_high (the paper's; DAPO clip-higher: 0.28)"""
    kl_coef: float = 0.04
    """beta, weight of the KL term to the reference in the loss (the paper's); 0 loads no reference model"""
    kl_estimator: Literal["k3", "k2-is"] = "k3"
    """the KL term: k3 (the GRPO paper's; an unbiased KL, but its gradient is not grad KL) or k2-is,
    sg(pi / pi_old) (logp - ref)^2 / 2, whose gradient is unbiased for grad KL(pi || pi_ref)"""
    scale_rewards: bool = True
    """divide group-centered rewards by the group std (Dr. GRPO: --no-scale-rewards with
    --loss-agg seq-mean-token-sum-norm)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean")
    """how per-token losses are averaged (seq-mean-token-sum-norm divides by max_new_tokens)"""
    mask_truncated_completions: bool = False
    """leave completions that hit max_new_tokens (no EOS) out of the loss"""
    rollout_correction: Literal["auto", "off", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask",
                                "geometric-mask"] = "auto"
    """the weight w on each token's policy gradient for vLLM sampling with its own numerics, from rho_t =
    pi_old / pi_vllm (common/ops.py rollout_correction): token-truncate min(rho_t, C) (TIS); token-mask rho_t,
    0 outside [C_low, C_high] (IcePop); sequence-truncate / sequence-mask the same of the sequence's prod_t rho_t
    (MIS); geometric-mask 1, 0 where exp(mean_t log rho_t) leaves [C_low, C_high]; off 1; auto: token-truncate
    C 2 in bf16 (~1e-2 apart), off in fp32 (~1e-5 apart). A weight 0 leaves the loss, not its normalizer"""
    rollout_correction_cap: float | None = None
    """C of token-truncate and sequence-truncate; None: 2 (TIS's, verl's)"""
    rollout_correction_low: float | None = None
    """C_low of the mask modes; None: token-mask 0.5 (OpenRLHF IcePop), sequence-mask 0.5 (verl Seq-MIS),
    geometric-mask 0.99 (SkyRL's recommendation)"""
    rollout_correction_high: float | None = None
    """C_high of the mask modes; None: token-mask 5, sequence-mask 2, geometric-mask 1.01"""
    ref_update_every: int = 0
    """copy the policy into the reference every N steps (a reference reset, as DeepSeekMath's iterative GRPO
    does); 0 never"""

    # infra
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """numerics of rollouts and forward/backward: bf16 (vLLM in bfloat16, the trainer under bfloat16
    autocast over its --dtype weights, the reference model alike) or fp32; auto: bf16 on CUDA, fp32 on CPU"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """trainer weight dtype: float32 keeps fp32 master weights and AdamW state; bfloat16 halves
    them but rounds away updates smaller than ~1/256 of a weight (small learning rates are lost)"""
    gradient_checkpointing: bool = False
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    """rollout engine: vllm, or transformers (the policy samples itself: no vLLM needed, slower); auto:
    vllm where it is installed, else transformers (always on mps)"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """where the trainer (and the transformers engine) runs; auto: cuda, else mps (an Apple GPU), else cpu"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache)"""
    vllm_sleep: bool = True
    """on CUDA, vLLM sleeps between rollouts (sleep mode level 1: KV cache freed, weights in CPU
    memory), leaving the GPU's memory to the trainer; --no-vllm-sleep keeps it resident"""
    vllm_cpu_kv_cache_gib: int = 1
    """KV cache size on CPU"""
    reward_timeout: float = 10.0
    """seconds a reward may take on one completion, else it scores 0 (counted: reward/timeouts); 0: no limit"""
    eval_every: int = 10
    """greedy held-out evaluation every N steps (and at start and end); 0 only at start and end"""
    save_every: int = 50
    """checkpoint every N steps; 0 only on Ctrl-C"""
    discard_later: bool = False
    """--resume in the run's own folder from before its later checkpoints or final/: delete those"""
    max_nonfinite_steps: int = 3
    """stop after this many optimizer steps in a row skipped for a NaN or inf loss or gradient"""
    max_unsynced_steps: int = 2
    """stop (saving a checkpoint) after this many steps in a row whose vLLM log-probs are far from the
    policy's (rollout/logprob_mismatch above what the precision explains: weights not synchronized?); 0: never"""
    log_completions: int = 4
    """completions a step written to completions.jsonl with prompt, rewards, advantage (W&B table with --track)"""
    tensorboard: bool = False
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "rl-lm"


def compute_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool, eps: float = 1e-4):
    """A_i = (R_i - mean of its group) [/ (std of its group + eps)], one scalar per completion.

    rewards holds the G completions of each prompt consecutively. A group whose rewards
    are all equal gets advantage 0 (no signal), never NaN."""
    grouped = rewards.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)


def compute_loss(logprobs, old_logprobs, ref_logprobs, advantages, vllm_is_weights, mask, args: Args,
                 num_tokens, num_seqs):
    """The GRPO loss of one micro-batch; [B, C] per-token inputs, advantages [B].

    num_tokens / num_seqs are the minibatch's totals, so accumulated micro-batch losses add
    up to the minibatch loss. Returns the loss and per-micro-batch statistics."""
    A = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1 - args.eps_low, 1 + args.eps_high)
    per_token = -torch.min(ratio * A, clipped_ratio * A) * vllm_is_weights
    stats = {}
    if ref_logprobs is not None:
        kl = kl_loss(logprobs, old_logprobs, ref_logprobs, args.kl_estimator)  # k3, or k2-is: grad KL's gradient
        per_token = per_token + args.kl_coef * kl
        stats["loss/kl"] = aggregate(kl.detach(), mask, "token-mean", num_tokens)  # its share of the minibatch's
    loss = aggregate(per_token, mask, args.loss_agg, num_tokens, num_seqs, args.max_new_tokens)
    with torch.no_grad():
        # the clipped term is the smaller one: these tokens get no gradient from the surrogate
        clipped = ((ratio < 1 - args.eps_low) & (A < 0)) | ((ratio > 1 + args.eps_high) & (A > 0))
        stats["policy/clip_frac"] = masked_mean(clipped.float(), mask)
        stats["policy/approx_kl"] = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)
    return loss, stats


def check(args: Args) -> None:
    """This algorithm's own checks, one line each (the shared ones: common/args.py check_args)."""
    need(0 <= args.eps_low < 1, f"--eps-low must be in [0, 1), got {args.eps_low}")
    need(args.eps_high >= 0, f"--eps-high must be >= 0, got {args.eps_high}")
    need(args.max_staleness >= 0, f"--max-staleness must be >= 0, got {args.max_staleness}")
    need(1 <= args.sync_every <= args.max_staleness + 1,
         f"--sync-every must be in [1, --max-staleness + 1 = {args.max_staleness + 1}] (the engine would wait for "
         f"weights the trainer sends only after training on what the engine has not sampled), got {args.sync_every}")
    need(args.rollout_ranks >= 0, f"--rollout-ranks must be >= 0, got {args.rollout_ranks}")
    need(args.sync_every == 1 or args.engine != "transformers" or dist.ROLLOUT_RANKS,
         "--sync-every > 1 with --engine transformers: that engine samples the trainer's own weights, synced always")


def update(policy, optimizer, scheduler, args: Args, precision, minibatches, input_ids, attention_mask,
           completion_mask, loss_mask, old_logprobs, ref_logprobs, vllm_logprobs, advantages):
    """Step 5 on one rollout batch ([B, C] tensors, advantages [B]): num_epochs x num_minibatches optimizer
    steps, each loss accumulated over micro-batches. old_logprobs None (one optimizer step): pi_old is the
    policy differentiated, and its forward gives them. Returns the statistics and the old log-probs."""
    (B, C), device = loss_mask.shape, input_ids.device.type
    reuse_forward = old_logprobs is None
    if reuse_forward:  # filled as the update reaches each micro-batch
        old_logprobs = torch.zeros(B, C, device=device)
    policy.train()
    step_stats = defaultdict(list)
    for epoch_minibatches in minibatches:  # each epoch's rows, cut into minibatches (draw_minibatches)
        for mb in epoch_minibatches:
            num_tokens, num_seqs = dist.minibatch_totals(loss_mask[mb])  # over all ranks
            micro_stats = []
            # micro-batches of similar length, each cut to its longest row: [micro, :c] lines up
            for micro, cols, c in micro_batches(mb, input_ids, attention_mask, C, args.micro_batch_size):
                with precision.autocast(device):
                    logprobs, entropy = forward_logprobs(policy, input_ids[micro, cols], attention_mask[micro, cols],
                                                         c, args.temperature, args.top_p, args.top_k, with_entropy=True)
                if reuse_forward:
                    old_logprobs[micro, :c] = logprobs.detach()
                # vLLM sampled from its own numerics, not exactly pi_old: --rollout-correction's weights
                vllm_is_weights = rollout_correction(old_logprobs[micro, :c], vllm_logprobs[micro, :c],
                                                     completion_mask[micro, :c], precision.rollout_correction)
                loss, stats = compute_loss(logprobs, old_logprobs[micro, :c],
                                           None if ref_logprobs is None else ref_logprobs[micro, :c],
                                           advantages[micro], vllm_is_weights, loss_mask[micro, :c], args,
                                           num_tokens, num_seqs)
                loss.backward()  # micro-batch losses add up to the minibatch loss
                stats["loss/total"] = loss.detach()
                stats["policy/entropy"] = masked_mean(entropy, completion_mask[micro, :c])
                micro_stats.append(stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            mb_loss = minibatch_stats(step_stats, micro_stats)  # the losses summed over micro-batches and ranks
            # a NaN or inf loss or gradient never reaches the weights: that step is skipped (common/guard.py)
            step_if_finite(optimizer, scheduler, step_stats, args.max_nonfinite_steps, mb_loss, grad_norm)
            step_stats["optim/grad_norm"].append(float(grad_norm))
    return step_stats, old_logprobs


def sample(llm, tokenizer, task, args: Args, prompt_sampler, rollout_params):
    """Step 1, on the engine's side: one batch, this rank's share of the step's prompts with G completions
    each, and the prompt sampler's state after drawing them (a checkpoint resumes from it)."""
    idx = torch.randint(len(task.train), (args.prompts_per_step,), generator=prompt_sampler).tolist()
    examples = dist.share([task.train[i] for i in idx])  # this rank's prompts: B = len(examples) * G
    prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], args.chat_template, args.system_prompt)
    with awake(llm):  # with sleep mode (CUDA), vLLM's memory is freed again after the rollout
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], rollout_params, use_tqdm=False)
    completions = [c for out in outputs for c in out.outputs]  # G per prompt, consecutive
    return examples, prompt_ids, completions, prompt_sampler.get_state()


def engine_side(args: Args, device, tokenizer, task, max_prompt_len, precision):
    """A rollout rank (torchrun with --rollout-ranks): an engine, and a copy of the policy that the trainer's
    weights are broadcast into and the engine is synced from; it samples until the trainer says stop."""
    llm = create_engine(args.model, **engine_options(args, max_prompt_len, precision))
    seed_everything(args.seed, dist.rank())
    model = load_policy(args.model, tokenizer, args.dtype, device)  # the weights as the engine holds them: merged
    prompt_sampler = torch.Generator().manual_seed(args.seed)  # the trainer's first sync sets its state
    ahead = Ahead(lambda: sample(llm, tokenizer, task, args, prompt_sampler, sampling_params(args, tokenizer)), llm,
                  prompt_sampler, args.max_staleness, args.steps)
    serve(ahead, model)


def main(args: Args) -> None:
    # ---------------------------------------------------------------- setup
    # --device; under torchrun: the process groups, before vLLM exists; the last R ranks sample, the others train
    device = dist.init(args.device, args.rollout_ranks)
    task, reward_fn, tokenizer, max_prompt_len = prepare(args, check)  # every check, before anything heavy
    precision = Precision.of(args, device)  # bf16 autocast or fp32: --precision
    if args.rollout_correction == "auto" and args.max_staleness > 0:  # pi_prox / pi_behav leaves 1 in any numerics
        precision = dataclasses.replace(precision, rollout_correction=RolloutCorrection.of(
            "token-truncate", args.rollout_correction_cap))
    if dist.is_rollout_rank():
        return engine_side(args, device, tokenizer, task, max_prompt_len, precision)
    run = Run(args)  # the run folder (new, or the resumed run's), checked before anything heavy
    # one process: the engine here, sampling in turn with the updates; torchrun: the rollout ranks' (common/rollouts.py)
    llm = Remote(args.engine) if dist.ROLLOUT_RANKS else create_engine(args.model, **engine_options(
        args, max_prompt_len, precision))
    seed_everything(args.seed, dist.rank())  # each rank its own; after the engine, which reseeds the global RNGs
    policy = dist.shard(load_policy(args.model, tokenizer, args.dtype, device, args.gradient_checkpointing,
                                    args.lora_rank, args.lora_alpha, args.lora_target_modules,
                                    args.resume and os.path.join(args.resume, "policy")), precision)
    # the reference is the initial model, also when resuming (unless refreshed, see ref_update_every;
    # under LoRA: the policy with its adapters off)
    ref_path = args.resume and args.ref_update_every and os.path.join(args.resume, "reference") or args.model
    ref_model = dist.shard(load_reference(ref_path, tokenizer, args.dtype, device, policy), precision) \
        if args.kl_coef > 0 else None
    models = {"policy": policy, **({"reference": ref_model} if ref_model is not None and args.ref_update_every else {})}
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    prompt_sampler = torch.Generator().manual_seed(args.seed)
    state = run.restore(models, optimizer, scheduler, prompt_sampler)  # a checkpoint's state on --resume
    rollout_params = sampling_params(args, tokenizer)  # G completions a prompt, ending at EOS or end of turn
    rollouts = llm if isinstance(llm, Remote) else Ahead(
        lambda: sample(llm, tokenizer, task, args, prompt_sampler, rollout_params), llm, prompt_sampler,
        args.max_staleness, args.steps)
    # the engine gets the policy (vLLM loaded args.model; after --resume the policy differs) and samples from the
    # run's start: a resumed run trains on nothing sampled before its checkpoint, and draws the prompts the
    # uninterrupted run drew after it (the sampler's state after the checkpoint's last batch)
    rollouts.sync(policy, run.start_step, state.get("prompt_sampler_after", prompt_sampler.get_state()))
    run.start(llm, tokenizer, task)  # says what runs where, evaluates the starting policy
    G, B = args.completions_per_prompt, args.prompts_per_step // dist.world_size() * args.completions_per_prompt
    for step in run.steps():  # a progress bar; Ctrl-C / SIGTERM: this step ends, is saved, exit
        times = {}
        t_step = time.perf_counter()
        # ---------------------------------------------------------------- 1. rollout (<= K versions old)
        with timed(times, "rollout"):  # under torchrun: the wait for a batch sampled meanwhile
            # the engine samples the batch of step n once it holds version >= n - K, and none beyond step + K
            examples, prompt_ids, completions, prompt_sampler_after, behaviour_version, sampling_s = \
                rollouts.batch(step)
            staleness = step - behaviour_version  # in [0, K]: the policy has taken this many steps since

        # ---------------------------------------------------------------- 2. reward
        rewards, reward_parts = reward_fn([c.text for c in completions], [examples[i // G] for i in range(B)])

        # ---------------------------------------------------------------- 3. old / ref log-probs
        with timed(times, "logprobs"):
            input_ids, attention_mask, completion_mask, loss_mask, truncated = rollout_batch(
                prompt_ids, completions, tokenizer.pad_token_id, device, args.mask_truncated_completions)
            C = completion_mask.shape[1]
            # the update's minibatches, drawn first: old and reference log-probs come from the micro-batches
            # of its first epoch, computed as its forward computes them (in bf16 another batching moves a
            # log-prob by 1e-3..1e-2, GSPO's whole clip range)
            minibatches = draw_minibatches(input_ids.shape[0], args.num_epochs, args.num_minibatches, device)
            # one optimizer step on this batch (one epoch, one minibatch): pi_old is the very policy the
            # update differentiates, so the update's own forward gives old_logprobs (detached), exactly
            reuse_forward = args.num_epochs == 1 and args.num_minibatches == 1
            old_logprobs = None if reuse_forward else batched_logprobs(
                policy, input_ids, attention_mask, C, args.temperature, args.micro_batch_size,
                precision.autocast_dtype, minibatches[0], top_p=args.top_p, top_k=args.top_k)
            ref_logprobs = None
            if ref_model is not None:
                ref_logprobs = batched_logprobs(ref_model, input_ids, attention_mask, C, args.temperature,
                                                args.micro_batch_size, precision.autocast_dtype, minibatches[0],
                                                top_p=args.top_p, top_k=args.top_k)
            vllm_logprobs = sampled_logprobs(completions, C, device)  # vLLM's own, for the mismatch

        # ---------------------------------------------------------------- 4. advantage
        advantages = compute_advantages(rewards, G, args.scale_rewards).to(device)

        # ---------------------------------------------------------------- 5. update
        with timed(times, "train"):
            step_stats, old_logprobs = update(policy, optimizer, scheduler, args, precision, minibatches,
                                              input_ids, attention_mask, completion_mask, loss_mask, old_logprobs,
                                              ref_logprobs, vllm_logprobs, advantages)
            if args.ref_update_every and ref_model is not None and (step + 1) % args.ref_update_every == 0:
                ref_model.load_state_dict(policy.state_dict())

        # ---------------------------------------------------------------- 6. sync
        with timed(times, "sync"):
            evaluates = (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps
            if (step + 1) % args.sync_every == 0 or evaluates:  # evaluations sample the policy as it is
                rollouts.sync(policy, step + 1)

        # ---------------------------------------------------------------- 7. log / eval / checkpoint
        times["step"] = time.perf_counter() - t_step
        metrics = step_metrics(step_stats, rewards, reward_parts, completion_mask, truncated, old_logprobs,
                               vllm_logprobs, ref_logprobs, precision.rollout_correction, scheduler, times, llm)
        gap = metrics["rollout/logprob_mismatch"]  # pi_prox against pi_behav: the policy's moves since, and numerics
        # the sync guard (common/guard.py) judges fresh batches only: a stale one's gap is not a lost sync
        metrics.update({"async/staleness_mean": staleness, "async/logprob_gap": gap,
                        "rollout/logprob_mismatch": gap if staleness == 0 else float("nan"),
                        # each side's share of the step's time: the trainer waits in 1., the engine samples
                        "async/trainer_idle_frac": times["rollout"] / times["step"],
                        "async/engine_busy_frac": min(1.0, sampling_s / times["step"])})
        run.log_completions(step + 1, [e["prompt"] for e in examples], [c.text for c in completions], rewards,
                            reward_parts, advantages)
        run.end_step(step + 1, metrics, prompt_sampler_after=prompt_sampler_after)  # eval, log, save when due

    run.finish(policy, tokenizer, run.eval_metrics)


if __name__ == "__main__":
    cli(main, Args)
