"""PPO for RLHF: a learned critic, GAE and KL-shaped per-token rewards (Schulman et al. 2017, arXiv:1707.06347;
Ouyang et al. 2022; Huang et al. 2024, "The N+ implementation details of RLHF with PPO", arXiv:2403.17031).

Four models: the policy pi, a frozen reference pi_ref, a critic V (a value head on its own
transformer, initialized from the policy or a reward model) and the reward (the task's verifier
or --reward-model). A completion is an episode: a KL penalty a token, the score R at its end:

    r_t = -beta * KL_t + [t = T] * (R - missing_eos_penalty * [no EOS])
    KL_t = old_t - ref_t                                   (k1, at the sampled token)

The advantage is GAE with the critic's values, over completion tokens only (V_{T+1} = 0):

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * A_{t+1},     returns_t = A_t + V_t

whitened over the batch's tokens. Policy and critic minimize (num_epochs x num_minibatches steps a batch)

    L = agg_t [ -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) * w_t ]
        + vf_coef * agg_t [ 0.5 * max((V_t - returns_t)^2, (clip(V_t, V_old_t +- vf_clip) - returns_t)^2) ]
    r_t = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    w_t = w(rho_t), rho_t = pi_old(y_t) / pi_vllm(y_t)    (--rollout-correction, for vLLM's own numerics; auto:
                                                           min(rho_t, 2) in bf16, 1 in fp32; weight 0: token masked)

One AdamW holds two parameter groups (policy at --lr, critic at --critic-lr) and the two
gradients are clipped separately, so a large value loss never shrinks the policy's step.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weight sync is a copy
if __name__ == "__main__":
    from common.allocator import use_tcmalloc

    use_tcmalloc()  # on CPU: this process again, with tcmalloc preloaded, before torch is imported

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro

from transformers import AutoModelForSequenceClassification

from common import dist
from common.args import cli
from common.batch import draw_minibatches, micro_batches, rollout_batch
from common.engine import awake, create_engine, sampled_logprobs, sampling_params, sync_weights
from common.errors import need
from common.guard import step_if_finite
from common.metrics import minibatch_stats, step_metrics, timed
from common.models import check_model, encode_prompts, load_policy, load_pretrained, load_reference
from common.ops import aggregate, batched_logprobs, forward_logprobs, masked_mean, rollout_correction
from common.rewards import check_reward_model, load_reward_model, reward_model_scores
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
    """completions sampled per prompt (the critic, not the group, gives the baseline)"""
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

    # optimization
    lr: float = 2e-4
    """AdamW's learning rate (ours, for the 1M-parameter default model; the papers' ~1e-6 is for billions)"""
    """policy learning rate"""
    critic_lr: float = 1e-3
    """critic learning rate (ours)"""
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

    # models
    critic_model: str | None = None
    """initial critic: a reward model, or any model of the policy's tokenizer (default: the policy's
    initial model with a new, zero-initialized value head)"""
    reward_model: str | None = None
    """sequence-classification reward model scoring decoded prompt+completion with its own tokenizer
    (default: the task's verifiable reward)"""

    # algorithm
    eps_low: float = 0.2
    """lower clip range: ratio is clipped at 1 - eps_low (defaults here: Huang et al. 2024's, unless "ours")"""
    eps_high: float = 0.2
    """upper clip range: ratio is clipped at 1 + eps_high"""
    kl_coef: float = 0.05
    """beta of the per-token KL penalty in the reward (the initial one with --target-kl); 0: no reference model"""
    target_kl: float | None = None
    """adaptive KL controller (Ziegler et al. 2019): steer beta so the per-sequence KL approaches this"""
    kl_horizon: int = 10000
    """adaptive KL controller horizon, in sequences"""
    gamma: float = 1.0
    """discount over completion tokens"""
    lam: float = 0.95
    """GAE lambda: 1 uses Monte-Carlo returns, 0 one-step TD residuals"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    vf_clip: float = 0.2
    """value clip range: V is clipped to V_old +- vf_clip in the clipped value loss"""
    whiten_advantages: bool = True
    """normalize advantages to mean 0, std 1 over the batch's completion tokens"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of completions that hit max_new_tokens without EOS"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean")
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

    # infra
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """numerics of rollouts and forward/backward: bf16 (vLLM in bfloat16, the trainer under bfloat16
    autocast over its --dtype weights, the reference model alike, a reward model in bfloat16) or fp32;
    auto: bf16 on CUDA, fp32 on CPU"""
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


def load_critic(name_or_path: str, tokenizer, dtype: str, device: str, gradient_checkpointing: bool = False):
    """V: a transformer with a scalar head at every position (AutoModelForSequenceClassification,
    num_labels=1, used per token). From a causal LM the head is new: it starts at zero, so the
    first values are 0 and the first advantages are Monte-Carlo returns."""
    critic, info = load_pretrained(AutoModelForSequenceClassification, name_or_path, dtype, num_labels=1)
    need(critic.get_input_embeddings().num_embeddings >= len(tokenizer),
         f"critic {name_or_path!r}: its vocabulary is smaller than the policy's tokenizer (it reads the same ids)")
    need(isinstance(getattr(critic, "score", None), torch.nn.Linear),
         f"critic {name_or_path!r}: expected a model with a linear `score` head (Llama/Qwen/Mistral/GPT-2 style)")
    if any(k.startswith("score.") for k in info["missing_keys"]):
        torch.nn.init.zeros_(critic.score.weight)
    if gradient_checkpointing:
        critic.gradient_checkpointing_enable()
        critic.config.use_cache = False
    return critic.to(device)


def forward_values(critic, input_ids, attention_mask, num_completion_tokens: int):
    """V_t for each completion token t: the value of the state (x, y_<t) before it is emitted,
    read at the same columns whose logits score y_t (P-1 .. P+C-2). [B, C]. The body and the
    head are called one after the other (the model's own forward pools a single value per
    sequence), so under FSDP each is a unit of its own (dist.shard's called_alone)."""
    C = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state[:, -C - 1:-1]
    return critic.score(hidden).squeeze(-1).float()


def compute_token_rewards(scores, kl, mask, kl_coef: float):
    """r_t = -beta * KL_t on every completion token, plus the sequence score on the last one.
    [B] scores, [B, C] kl and mask (right-padded) -> [B, C], 0 on padding."""
    token_rewards = -kl_coef * kl * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)
    has_tokens = mask.sum(1) > 0
    token_rewards[torch.arange(len(scores)), last] += scores * has_tokens
    return token_rewards


def compute_advantages(token_rewards, values, mask, gamma: float, lam: float):
    """GAE over completion tokens, right to left; the state after the last token is terminal.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lambda * A_{t+1}.
    Returns (advantages, returns = advantages + values), both 0 on padding."""
    values = values * mask
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    C = values.shape[1]
    for t in reversed(range(C)):
        next_mask = mask[:, t + 1] if t + 1 < C else torch.zeros_like(mask[:, 0])
        next_value = values[:, t + 1] * next_mask if t + 1 < C else torch.zeros_like(values[:, 0])
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage * next_mask) * mask[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


def update_kl_coef(kl_coef: float, kl_per_seq: float, num_seqs: int, args: Args) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): raise beta when the KL is above target."""
    if args.target_kl is None:
        return kl_coef
    error = min(max(kl_per_seq / args.target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * num_seqs / args.kl_horizon)


def compute_loss(logprobs, old_logprobs, advantages, values, old_values, returns, vllm_is_weights, mask,
                 args: Args, num_tokens, num_seqs):
    """The PPO loss of one micro-batch: clipped surrogate + vf_coef * clipped value loss; [B, C] inputs.

    num_tokens / num_seqs are the minibatch's totals, so accumulated micro-batch losses add
    up to the minibatch loss. Returns the loss and per-micro-batch statistics."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1 - args.eps_low, 1 + args.eps_high)
    pg_per_token = -torch.min(ratio * advantages, clipped_ratio * advantages) * vllm_is_weights
    pg_loss = aggregate(pg_per_token, mask, args.loss_agg, num_tokens, num_seqs, args.max_new_tokens)
    clipped_values = old_values + torch.clamp(values - old_values, -args.vf_clip, args.vf_clip)
    vf_unclipped, vf_clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    vf_per_token = 0.5 * torch.max(vf_unclipped, vf_clipped)
    vf_loss = aggregate(vf_per_token, mask, args.loss_agg, num_tokens, num_seqs, args.max_new_tokens)
    loss = pg_loss + args.vf_coef * vf_loss
    with torch.no_grad():
        # the clipped term is the smaller one: these tokens get no gradient from the surrogate
        clipped = ((ratio < 1 - args.eps_low) & (advantages < 0)) | ((ratio > 1 + args.eps_high) & (advantages > 0))
        stats = {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
                 "policy/clip_frac": masked_mean(clipped.float(), mask),
                 "policy/approx_kl": masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask),
                 "value/clip_frac": masked_mean((vf_clipped > vf_unclipped).float(), mask)}
    return loss, stats


def check(args: Args) -> None:
    """This algorithm's own checks, one line each (the shared ones: common/args.py check_args)."""
    need(0 <= args.eps_low < 1, f"--eps-low must be in [0, 1), got {args.eps_low}")
    need(args.eps_high >= 0, f"--eps-high must be >= 0, got {args.eps_high}")
    need(args.target_kl is None or args.target_kl > 0, f"--target-kl must be positive, got {args.target_kl}")
    need(args.target_kl is None or args.kl_coef > 0, "--target-kl needs --kl-coef > 0 (its initial value)")
    need(args.kl_horizon > 0, f"--kl-horizon must be positive, got {args.kl_horizon}")
    need(0 <= args.gamma <= 1 and 0 <= args.lam <= 1,
         f"--gamma and --lam must be in [0, 1], got {args.gamma} and {args.lam}")
    need(args.vf_coef >= 0 and args.vf_clip > 0,
         f"--vf-coef must be >= 0 and --vf-clip > 0, got {args.vf_coef} and {args.vf_clip}")
    need(not (args.reward and args.reward_model), "--reward and --reward-model both define the reward: give one")
    need(args.critic_lr > 0, f"--critic-lr must be positive, got {args.critic_lr}")
    if args.critic_model:
        check_model(args.critic_model, "--critic-model")
    if args.reward_model:
        check_reward_model(args.reward_model)  # found, and with a trained score head


def update(policy, critic, optimizer, scheduler, args: Args, precision, minibatches, input_ids, attention_mask,
           completion_mask, loss_mask, old_logprobs, vllm_logprobs, advantages, old_values, returns):
    """Step 5 on one rollout batch ([B, C] tensors): num_epochs x num_minibatches optimizer steps of
    policy and critic, each loss accumulated over micro-batches. Returns the per-micro-batch
    statistics and the old log-probs."""
    (B, C), device = loss_mask.shape, input_ids.device.type
    policy.train()
    critic.train()
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
                    values = forward_values(critic, input_ids[micro, cols], attention_mask[micro, cols], c)
                # vLLM sampled from its own numerics, not exactly pi_old: --rollout-correction's weights
                vllm_is_weights = rollout_correction(old_logprobs[micro, :c], vllm_logprobs[micro, :c],
                                                     completion_mask[micro, :c], precision.rollout_correction)
                loss, stats = compute_loss(logprobs, old_logprobs[micro, :c], advantages[micro, :c], values,
                                           old_values[micro, :c], returns[micro, :c], vllm_is_weights,
                                           loss_mask[micro, :c], args, num_tokens, num_seqs)
                loss.backward()  # micro-batch losses add up to the minibatch loss
                stats["loss/total"] = loss.detach()
                stats["policy/entropy"] = masked_mean(entropy, completion_mask[micro, :c])
                micro_stats.append(stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            mb_loss = minibatch_stats(step_stats, micro_stats)  # the losses summed over micro-batches and ranks
            # a NaN or inf loss or gradient never reaches the weights: that step is skipped (common/guard.py)
            step_if_finite(optimizer, scheduler, step_stats, args.max_nonfinite_steps, mb_loss, grad_norm,
                           critic_grad_norm)
            step_stats["optim/grad_norm"].append(float(grad_norm))
            step_stats["optim/critic_grad_norm"].append(float(critic_grad_norm))
    return step_stats, old_logprobs


def main(args: Args) -> None:
    # ---------------------------------------------------------------- setup
    device = dist.init(args.device)  # --device; under torchrun: the ranks' process group, before vLLM exists
    # every check before anything heavy; one completion per prompt is enough (no group baseline)
    task, reward_fn, tokenizer, max_prompt_len = prepare(args, check, min_completions=1)
    run = Run(args)  # the run folder (new, or the resumed run's), checked before anything heavy
    precision = Precision.of(args, device)  # bf16 autocast or fp32: --precision
    llm = create_engine(args.model, **engine_options(args, max_prompt_len, precision))
    seed_everything(args.seed, dist.rank())  # each rank its own; after the engine, which reseeds the global RNGs
    policy = dist.shard(load_policy(args.model, tokenizer, args.dtype, device, args.gradient_checkpointing,
                                    args.lora_rank, args.lora_alpha, args.lora_target_modules,
                                    args.resume and os.path.join(args.resume, "policy")), precision)
    # the reference is the initial model, also when resuming (under LoRA: the policy, adapters off)
    ref_model = dist.shard(load_reference(args.model, tokenizer, args.dtype, device, policy), precision) \
        if args.kl_coef > 0 else None
    critic = load_critic(args.resume and os.path.join(args.resume, "critic") or args.critic_model or args.model,
                         tokenizer, args.dtype, device, args.gradient_checkpointing)
    critic = dist.shard(critic, precision, called_alone=(critic.base_model, critic.score))  # see forward_values
    reward_model = args.reward_model and load_reward_model(args.reward_model, precision.frozen_dtype, device)
    optimizer = torch.optim.AdamW([{"params": [p for p in policy.parameters() if p.requires_grad], "lr": args.lr},
                                   {"params": critic.parameters(), "lr": args.critic_lr}],
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    prompt_sampler = torch.Generator().manual_seed(args.seed)
    state = run.restore({"policy": policy, "critic": critic}, optimizer, scheduler, prompt_sampler)  # on --resume
    kl_coef = state.get("kl_coef", args.kl_coef)  # adapted by the KL controller (--target-kl)
    sync_weights(llm, policy)  # vLLM loaded args.model; after --resume the policy differs
    run.start(llm, tokenizer, task)  # says what runs where, evaluates the starting policy
    rollout_params = sampling_params(args, tokenizer)  # G completions a prompt, ending at EOS or end of turn
    G, B = args.completions_per_prompt, args.prompts_per_step // dist.world_size() * args.completions_per_prompt
    for step in run.steps():  # a progress bar; Ctrl-C / SIGTERM: this step ends, is saved, exit
        times = {}
        t_step = time.perf_counter()
        # ---------------------------------------------------------------- 1. rollout
        with timed(times, "rollout"):
            idx = torch.randint(len(task.train), (args.prompts_per_step,), generator=prompt_sampler).tolist()
            examples = dist.share([task.train[i] for i in idx])  # this rank's prompts: B = len(examples) * G
            prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], args.chat_template,
                                        args.system_prompt)
            with awake(llm):  # with sleep mode (CUDA), vLLM's memory is freed again after the rollout
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], rollout_params, use_tqdm=False)
            completions = [c for out in outputs for c in out.outputs]  # G per prompt, consecutive

        # ---------------------------------------------------------------- 2. reward
        rewards, reward_parts = reward_fn([c.text for c in completions], [examples[i // G] for i in range(B)])
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        if reward_model:  # reward_parts keep the task's verifier, logged as reward/correct_mean
            prompt_texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
            rewards = reward_model_scores(*reward_model, [
                prompt_texts[i // G] + tokenizer.decode(c.token_ids, skip_special_tokens=False)
                for i, c in enumerate(completions)], device, args.micro_batch_size).cpu()
        scores = rewards - args.missing_eos_penalty * truncated.float()

        # ---------------------------------------------------------------- 3. old / ref log-probs
        with timed(times, "logprobs"):
            input_ids, attention_mask, completion_mask, loss_mask, truncated = rollout_batch(
                prompt_ids, completions, tokenizer.pad_token_id, device, args.mask_truncated_completions)
            C = completion_mask.shape[1]
            # the update's minibatches, drawn first: old and reference log-probs come from the micro-batches
            # of its first epoch, computed as its forward computes them (in bf16 another batching moves a
            # log-prob by 1e-3..1e-2, GSPO's whole clip range)
            minibatches = draw_minibatches(input_ids.shape[0], args.num_epochs, args.num_minibatches, device)
            old_logprobs = batched_logprobs(policy, input_ids, attention_mask, C, args.temperature,
                                            args.micro_batch_size, precision.autocast_dtype, minibatches[0],
                                            top_p=args.top_p, top_k=args.top_k)
            ref_logprobs = None
            if ref_model is not None:
                ref_logprobs = batched_logprobs(ref_model, input_ids, attention_mask, C, args.temperature,
                                                args.micro_batch_size, precision.autocast_dtype, minibatches[0],
                                                top_p=args.top_p, top_k=args.top_k)
            old_values = torch.zeros_like(old_logprobs)
            with torch.no_grad(), precision.autocast(device):
                for mb in minibatches[0]:  # the update's first micro-batches, as for the log-probs
                    for micro, cols, c in micro_batches(mb, input_ids, attention_mask, C, args.micro_batch_size):
                        old_values[micro, :c] = forward_values(critic, input_ids[micro, cols],
                                                               attention_mask[micro, cols], c)
            vllm_logprobs = sampled_logprobs(completions, C, device)  # vLLM's own, for the mismatch

        # ---------------------------------------------------------------- 4. advantage
        kl = torch.zeros_like(old_logprobs) if ref_logprobs is None else old_logprobs - ref_logprobs
        token_rewards = compute_token_rewards(scores.to(device), kl, loss_mask, kl_coef)
        advantages, returns = compute_advantages(token_rewards, old_values, loss_mask, args.gamma, args.lam)
        if args.whiten_advantages:
            advantages = dist.whiten(advantages, loss_mask)

        # ---------------------------------------------------------------- 5. update
        with timed(times, "train"):
            step_stats, old_logprobs = update(policy, critic, optimizer, scheduler, args, precision, minibatches,
                                              input_ids, attention_mask, completion_mask, loss_mask, old_logprobs,
                                              vllm_logprobs, advantages, old_values, returns)

        # ---------------------------------------------------------------- 6. sync
        with timed(times, "sync"):
            sync_weights(llm, policy)

        # ---------------------------------------------------------------- 7. log / eval / checkpoint
        times["step"] = time.perf_counter() - t_step
        metrics = step_metrics(step_stats, rewards, reward_parts, completion_mask, truncated, old_logprobs,
                               vllm_logprobs, ref_logprobs, precision.rollout_correction, scheduler, times, llm)
        if ref_logprobs is not None:
            kl_per_seq = dist.global_mean((kl * loss_mask).sum(1)).item()  # over all ranks' sequences
            metrics.update({"kl/token_mean": masked_mean(kl, loss_mask), "kl/seq_mean": kl_per_seq, "kl/coef": kl_coef})
            kl_coef = update_kl_coef(kl_coef, kl_per_seq, B * dist.world_size(), args)
        valid = loss_mask.bool()  # the explained variance: 1 - Var(returns - V) / Var(returns)
        metrics.update({
            "reward/score_mean": scores.mean(),  # the sequence score after the missing-EOS penalty
            "reward/shaped_mean": (token_rewards * loss_mask).sum(1).mean(),  # score - beta * sum_t KL_t
            "value/mean": masked_mean(old_values, loss_mask),
            "value/explained_variance": 1 - (returns - old_values)[valid].var()
            / returns[valid].var().clamp(min=1e-8),
        })
        run.log_completions(step + 1, [e["prompt"] for e in examples], [c.text for c in completions], rewards,
                            reward_parts, advantages)
        run.end_step(step + 1, metrics, kl_coef=kl_coef)  # eval, log, save when due

    run.finish(policy, tokenizer, run.eval_metrics)


if __name__ == "__main__":
    cli(main, Args)
