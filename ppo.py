"""PPO for RLHF: a learned critic, GAE and KL-shaped per-token rewards (Schulman et al. 2017,
arXiv:1707.06347; Ouyang et al. 2022; Huang et al. 2024, "The N+ implementation details of RLHF
with PPO", arXiv:2403.17031).

Four models: the policy pi, a frozen reference pi_ref, a critic V (a value head on its own
transformer, initialized from the policy or from a reward model) and the reward: the task's
verifier, or a sequence-classification reward model (--reward-model). Each completion is an
episode whose per-token reward is a KL penalty, plus the sequence score R at its last token:

    r_t = -beta * KL_t + [t = T] * (R - missing_eos_penalty * [no EOS])
    KL_t = old_t - ref_t                                   (k1, at the sampled token)

The advantage is GAE with the critic's values, over completion tokens only (V_{T+1} = 0):

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * A_{t+1},     returns_t = A_t + V_t

whitened over the batch's tokens. Policy and critic minimize, over num_epochs x
num_minibatches updates per rollout batch,

    L = agg_t [ -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) * w_t ]
        + vf_coef * agg_t [ 0.5 * max((V_t - returns_t)^2, (clip(V_t, V_old_t +- vf_clip) - returns_t)^2) ]
    r_t = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    w_t = min(pi_old(y_t) / pi_vllm(y_t), C)               (--vllm-is-cap C; vLLM's own numerics; 1 when off)

One AdamW holds two parameter groups (policy at --lr, critic at --critic-lr) and the two
gradients are clipped separately, so a large value loss never shrinks the policy's step.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weight sync is a copy
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the progress bar is the output, not vLLM's INFO lines

import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from tqdm import tqdm
from vllm import SamplingParams

from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common import dist
from common.errors import RunError, need
from common.models import (awake, check_model, create_engine, encode_prompts, freeze, load_policy, load_pretrained,
                           load_reference, load_tokenizer, resolve_model, stop_token_ids, sync_weights)
from common.ops import (aggregate, batched_logprobs, forward_logprobs, make_batch, masked_mean, micro_batches,
                        truncated_is_weights)
from common.rewards import load_reward
from common.tasks import evaluate, load_task
from common.utils import GracefulInterrupt, Run, check_args, memory_metrics, parse_args, seed_everything, timed


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
    the run's own arguments are restored (see RESUMABLE_CHANGES in common/utils.py)"""

    # rollout
    prompts_per_step: int = 32
    """distinct prompts sampled per step"""
    completions_per_prompt: int = 8
    """completions sampled per prompt (the critic, not the group, gives the baseline)"""
    max_new_tokens: int = 12
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template: raw text)"""
    system_prompt: str | None = None
    """system message of chat-template prompts"""

    # optimization
    lr: float = 2e-4
    """policy learning rate"""
    critic_lr: float = 1e-3
    """critic learning rate"""
    num_epochs: int = 1
    """passes over each rollout batch"""
    num_minibatches: int = 4
    """optimizer steps per pass over the rollout batch"""
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
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """the policy's modules that get adapters (Llama/Qwen/Mistral names)"""

    # models
    critic_model: str | None = None
    """initial critic: a reward model, or any model of the policy's tokenizer (default: the policy's
    initial model with a new, zero-initialized value head)"""
    reward_model: str | None = None
    """sequence-classification reward model scoring decoded prompt+completion with its own tokenizer
    (default: the task's verifiable reward)"""

    # algorithm
    eps_low: float = 0.2
    """lower clip range: ratio is clipped at 1 - eps_low"""
    eps_high: float = 0.2
    """upper clip range: ratio is clipped at 1 + eps_high"""
    kl_coef: float = 0.05
    """beta, weight of the per-token KL penalty in the reward (initial value if --target-kl); 0 loads
    no reference model"""
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
    vllm_is_cap: float | None = None
    """C of truncated importance sampling: the policy-gradient term of each token is weighted by
    min(pi_old / pi_vllm, C), as vLLM samples with its own numerics; None: 2 under bf16 precision
    (vLLM and the trainer differ by ~1e-2 there), off in fp32 (they agree to ~1e-5); 0: off"""

    # infra
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """numerics of rollouts and forward/backward: bf16 (vLLM in bfloat16, the trainer under bfloat16
    autocast over its --dtype weights, frozen models in bfloat16) or fp32; auto: bf16 on CUDA, fp32 on CPU"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """trainer weight dtype: float32 keeps fp32 master weights and AdamW state; bfloat16 halves
    them but rounds away updates smaller than ~1/256 of a weight (small learning rates are lost)"""
    gradient_checkpointing: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache)"""
    vllm_sleep: bool = True
    """on CUDA, vLLM sleeps between rollouts (sleep mode level 1: KV cache freed, weights in CPU
    memory), leaving the GPU's memory to the trainer; --no-vllm-sleep keeps it resident"""
    vllm_cpu_kv_cache_gib: int = 1
    """KV cache size on CPU"""
    eval_every: int = 10
    """greedy held-out evaluation every N steps (and at start and end); 0 only at start and end"""
    save_every: int = 50
    """checkpoint every N steps; 0 only on Ctrl-C"""
    log_completions: int = 4
    """completions written to completions.jsonl each step with their prompt, rewards and advantage
    (a W&B table with --track); 0: none"""
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


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, texts: list[str], device: str, micro_batch_size: int):
    """The reward model's score of each text (prompt + completion as generated, end-of-turn
    token included: what a reward model is trained to read), at its last real token, a
    micro-batch at a time. A text that starts with BOS (a decoded prompt) gets no second one."""
    bos = rm_tokenizer.bos_token
    if bos is not None and rm_tokenizer("")["input_ids"][:1] == [rm_tokenizer.bos_token_id]:
        texts = [t.removeprefix(bos) for t in texts]
    scores = []
    for i in range(0, len(texts), micro_batch_size):
        batch = rm_tokenizer(texts[i:i + micro_batch_size], return_tensors="pt", padding=True,
                             padding_side="right").to(device)
        hidden = reward_model.base_model(**batch, use_cache=False).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        scores.append(reward_model.score(hidden[torch.arange(len(last), device=device), last]).squeeze(-1).float())
    return torch.cat(scores)


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


def whiten(values, mask, eps: float = 1e-8):
    """(v - mean) / std over the masked entries (the batch's completion tokens, on all ranks); 0 elsewhere."""
    mean = dist.global_masked_mean(values, mask)
    var = dist.global_masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


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


def update(policy, critic, optimizer, scheduler, args: Args, vllm_is_cap: float, autocast_dtype, input_ids,
           attention_mask, completion_mask, loss_mask, old_logprobs, vllm_logprobs, advantages, old_values, returns):
    """Step 5 on one rollout batch ([B, C] tensors): num_epochs x num_minibatches optimizer steps of
    policy and critic, each loss accumulated over micro-batches. Returns the per-micro-batch
    statistics and the old log-probs."""
    (B, C), device = loss_mask.shape, input_ids.device.type
    policy.train()
    critic.train()
    step_stats = defaultdict(list)
    for epoch in range(args.num_epochs):
        for mb in torch.randperm(B, device=device).split(B // args.num_minibatches):
            num_tokens, num_seqs = dist.minibatch_totals(loss_mask[mb])  # over all ranks
            mb_loss = 0.0
            # micro-batches of similar length, each cut to its longest row: [micro, :c] lines up
            for micro, cols, c in micro_batches(mb, input_ids, attention_mask, C, args.micro_batch_size):
                with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logprobs, entropy = forward_logprobs(policy, input_ids[micro, cols], attention_mask[micro, cols],
                                                         c, args.temperature, with_entropy=True)
                    values = forward_values(critic, input_ids[micro, cols], attention_mask[micro, cols], c)
                # vLLM sampled from its own numerics, not exactly pi_old: truncated importance weights
                vllm_is_weights = truncated_is_weights(old_logprobs[micro, :c], vllm_logprobs[micro, :c], vllm_is_cap)
                loss, stats = compute_loss(logprobs, old_logprobs[micro, :c], advantages[micro, :c], values,
                                           old_values[micro, :c], returns[micro, :c], vllm_is_weights,
                                           loss_mask[micro, :c], args, num_tokens, num_seqs)
                loss.backward()  # micro-batch losses add up to the minibatch loss
                mb_loss += loss.item()
                stats["policy/entropy"] = masked_mean(entropy, completion_mask[micro, :c])
                for k, v in stats.items():
                    step_stats[k].append(float(v))
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_stats["loss/total"].append(mb_loss)
            step_stats["optim/grad_norm"].append(float(grad_norm))
            step_stats["optim/critic_grad_norm"].append(float(critic_grad_norm))
    return step_stats, old_logprobs


def main(args: Args) -> None:
    # ---------------------------------------------------------------- setup
    device = dist.init()  # under torchrun: the ranks' process group, before vLLM exists (see common/dist.py)
    config = check_model(args.model)
    task = load_task(args.task, seed=args.seed)
    reward_fn = load_reward(args.reward, task)  # checked on a probe, before anything heavy
    tokenizer = load_tokenizer(args.model)
    max_prompt_len = max(len(p) for p in encode_prompts(tokenizer, [e["prompt"] for e in task.train + task.eval],
                                                        args.chat_template, args.system_prompt))
    check_args(args, max_context=config.max_position_embeddings, max_prompt_len=max_prompt_len, min_completions=1)
    need(0 <= args.eps_low < 1, f"--eps-low must be in [0, 1), got {args.eps_low}")
    need(args.eps_high >= 0, f"--eps-high must be >= 0, got {args.eps_high}")
    need(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    need(args.target_kl is None or args.target_kl > 0, f"--target-kl must be positive, got {args.target_kl}")
    need(args.target_kl is None or args.kl_coef > 0, "--target-kl needs --kl-coef > 0 (its initial value)")
    need(args.kl_horizon > 0, f"--kl-horizon must be positive, got {args.kl_horizon}")
    need(0 <= args.gamma <= 1 and 0 <= args.lam <= 1,
         f"--gamma and --lam must be in [0, 1], got {args.gamma} and {args.lam}")
    need(args.vf_coef >= 0 and args.vf_clip > 0,
         f"--vf-coef must be >= 0 and --vf-clip > 0, got {args.vf_coef} and {args.vf_clip}")
    need(not (args.reward and args.reward_model), "--reward and --reward-model both define the reward: give one")
    need(args.critic_lr > 0, f"--critic-lr must be positive, got {args.critic_lr}")
    for path in (args.critic_model, args.reward_model):
        if path is not None:
            check_model(path)
    need(args.vllm_is_cap is None or args.vllm_is_cap == 0 or args.vllm_is_cap >= 1,
         f"--vllm-is-cap must be 0 (off) or >= 1, got {args.vllm_is_cap}")
    need(args.lora_rank >= 0 and args.lora_alpha > 0, f"--lora-rank must be >= 0 and --lora-alpha > 0, got "
         f"{args.lora_rank} and {args.lora_alpha}")
    run = Run(args)  # the run folder (new, or the resumed run's), checked before anything heavy
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device == "cuda")
    autocast_dtype = torch.bfloat16 if bf16 else None
    frozen_dtype = "bfloat16" if bf16 else args.dtype  # forward-only models: half the memory
    vllm_is_cap = args.vllm_is_cap if args.vllm_is_cap is not None else (2.0 if bf16 else 0.0)

    llm = create_engine(args.model, seed=args.seed + dist.rank(), max_model_len=max_prompt_len + args.max_new_tokens,
                        dtype="bfloat16" if bf16 else "float32",
                        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                        cpu_kv_cache_gib=args.vllm_cpu_kv_cache_gib, sleep_mode=args.vllm_sleep)
    seed_everything(args.seed)  # after the engine: in-process vLLM reseeds the global RNGs
    policy = dist.shard(load_policy(args.model, tokenizer, args.dtype, device, args.gradient_checkpointing,
                                    args.lora_rank, args.lora_alpha, args.lora_target_modules,
                                    args.resume and os.path.join(args.resume, "policy")))
    # the reference is the initial model, also when resuming (under LoRA: the policy, adapters off)
    ref_model = dist.shard(load_reference(args.model, tokenizer, frozen_dtype, device, policy)) if args.kl_coef > 0 \
        else None
    critic = load_critic(args.resume and os.path.join(args.resume, "critic") or args.critic_model or args.model,
                         tokenizer, args.dtype, device, args.gradient_checkpointing)
    critic = dist.shard(critic, called_alone=(critic.base_model, critic.score))  # see forward_values
    reward_model = rm_tokenizer = None
    if args.reward_model is not None:
        reward_model = freeze(load_pretrained(AutoModelForSequenceClassification, args.reward_model, frozen_dtype,
                                              num_labels=1)[0].to(device))
        rm_tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.reward_model))
        if rm_tokenizer.pad_token is None:
            rm_tokenizer.pad_token = rm_tokenizer.eos_token  # right padding, scores read before it
    optimizer = torch.optim.AdamW([{"params": [p for p in policy.parameters() if p.requires_grad], "lr": args.lr},
                                   {"params": critic.parameters(), "lr": args.critic_lr}],
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    prompt_sampler = torch.Generator().manual_seed(args.seed)
    kl_coef = args.kl_coef
    if args.resume:
        state = run.load_checkpoint({"policy": policy, "critic": critic}, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        prompt_sampler.set_state(state["prompt_sampler"])
        kl_coef = state["kl_coef"]
    sync_weights(llm, policy)  # vLLM loaded args.model; after --resume the policy differs

    def checkpoint(step: int) -> str:
        state = {"scheduler": scheduler.state_dict(), "prompt_sampler": prompt_sampler.get_state(), "kl_coef": kl_coef}
        return run.save_checkpoint(step, {"policy": policy, "critic": critic}, tokenizer, state, optimizer)

    print(f"{args.exp_name}: {args.model} on {args.task} ({device}), {args.steps} steps of "
          f"{args.prompts_per_step} prompts x {args.completions_per_prompt} completions -> {run.dir}")
    first_eval = evaluate(llm, tokenizer, task, args.max_new_tokens, args.chat_template, args.system_prompt)
    if run.start_step == 0:
        run.log(0, first_eval)
    # the template's end-of-turn token ends a completion like EOS (and stays in its loss mask)
    sampling_params = SamplingParams(n=args.completions_per_prompt, temperature=args.temperature,
                                     max_tokens=args.max_new_tokens, logprobs=0,
                                     stop_token_ids=stop_token_ids(tokenizer))
    G, B = args.completions_per_prompt, args.prompts_per_step // dist.world_size() * args.completions_per_prompt
    metrics, eval_metrics = {}, first_eval
    progress = tqdm(range(run.start_step, args.steps), initial=run.start_step, total=args.steps, desc=args.exp_name,
                    disable=not dist.is_main())
    with GracefulInterrupt() as interrupt:
        for step in progress:
            times = {}
            t_step = time.perf_counter()
            # ---------------------------------------------------------------- 1. rollout
            with timed(times, "rollout"):
                idx = torch.randint(len(task.train), (args.prompts_per_step,), generator=prompt_sampler).tolist()
                examples = dist.share([task.train[i] for i in idx])  # this rank's prompts: B = len(examples) * G
                prompt_ids = encode_prompts(tokenizer, [e["prompt"] for e in examples], args.chat_template,
                                            args.system_prompt)
                with awake(llm):  # with sleep mode (CUDA), vLLM's memory is freed again after the rollout
                    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sampling_params,
                                           use_tqdm=False)
                completions = [c for out in outputs for c in out.outputs]  # G per prompt, consecutive

            # ---------------------------------------------------------------- 2. reward
            rewards, reward_parts = reward_fn([c.text for c in completions], [examples[i // G] for i in range(B)])
            truncated = torch.tensor([c.finish_reason == "length" for c in completions])
            if reward_model is not None:  # reward_parts keep the task's verifier, logged as reward/correct_mean
                prompt_texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
                rewards = reward_model_scores(reward_model, rm_tokenizer, [
                    prompt_texts[i // G] + tokenizer.decode(c.token_ids, skip_special_tokens=False)
                    for i, c in enumerate(completions)], device, args.micro_batch_size).cpu()
            scores = rewards - args.missing_eos_penalty * truncated.float()

            # ---------------------------------------------------------------- 3. old / ref log-probs
            with timed(times, "logprobs"):
                input_ids, attention_mask, completion_mask = make_batch(
                    [p for p in prompt_ids for _ in range(G)], [list(c.token_ids) for c in completions],
                    tokenizer.pad_token_id, device)
                truncated = truncated.to(device)
                loss_mask = completion_mask.clone()
                if args.mask_truncated_completions:
                    loss_mask[truncated] = 0  # no EOS: we don't know how these would have ended
                C = completion_mask.shape[1]
                old_logprobs = batched_logprobs(policy, input_ids, attention_mask, C, args.temperature,
                                                args.micro_batch_size, autocast_dtype)
                ref_logprobs = None
                if ref_model is not None:
                    ref_logprobs = batched_logprobs(ref_model, input_ids, attention_mask, C, args.temperature,
                                                    args.micro_batch_size, autocast_dtype)
                old_values = torch.zeros_like(old_logprobs)
                with torch.no_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    for micro, cols, c in micro_batches(torch.arange(B, device=device), input_ids, attention_mask, C,
                                                        args.micro_batch_size):
                        old_values[micro, :c] = forward_values(critic, input_ids[micro, cols],
                                                               attention_mask[micro, cols], c)
                vllm_logprobs = torch.zeros_like(old_logprobs)
                for i, c in enumerate(completions):
                    vllm_logprobs[i, :len(c.token_ids)] = torch.tensor(
                        [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])

            # ---------------------------------------------------------------- 4. advantage
            kl = torch.zeros_like(old_logprobs) if ref_logprobs is None else old_logprobs - ref_logprobs
            token_rewards = compute_token_rewards(scores.to(device), kl, loss_mask, kl_coef)
            advantages, returns = compute_advantages(token_rewards, old_values, loss_mask, args.gamma, args.lam)
            if args.whiten_advantages:
                advantages = whiten(advantages, loss_mask)

            # ---------------------------------------------------------------- 5. update
            with timed(times, "train"):
                step_stats, old_logprobs = update(policy, critic, optimizer, scheduler, args, vllm_is_cap,
                                                  autocast_dtype, input_ids, attention_mask, completion_mask,
                                                  loss_mask, old_logprobs, vllm_logprobs, advantages, old_values,
                                                  returns)

            # ---------------------------------------------------------------- 6. sync
            with timed(times, "sync"):
                sync_weights(llm, policy)

            # ---------------------------------------------------------------- 7. log / eval / checkpoint
            times["step"] = time.perf_counter() - t_step
            metrics = {k: sum(v) / len(v) for k, v in step_stats.items()}
            metrics.update({
                "reward/mean": rewards.mean(), "reward/std": rewards.std(),
                **{f"reward/{k}_mean": v.mean() for k, v in reward_parts.items()},
                "response/length_mean": completion_mask.sum(1).float().mean(),
                "response/truncated_frac": truncated.float().mean(),
                "rollout/logprob_mismatch": masked_mean((vllm_logprobs - old_logprobs).abs(), completion_mask),
                "rollout/is_weight_mean": masked_mean(truncated_is_weights(old_logprobs, vllm_logprobs, vllm_is_cap),
                                                      completion_mask),
                "rollout/is_capped_frac": masked_mean((torch.exp(old_logprobs - vllm_logprobs) > vllm_is_cap).float(),
                                                      completion_mask) if vllm_is_cap else 0.0,
                "optim/lr": scheduler.get_last_lr()[0],
                **{f"time/{k}": v for k, v in times.items()},
                "throughput/tokens_per_s": completion_mask.sum() / times["step"],
                **memory_metrics(llm),
            })
            if ref_logprobs is not None:
                log_ref_ratio = ref_logprobs - old_logprobs
                metrics["kl/ref"] = masked_mean(torch.exp(log_ref_ratio) - log_ref_ratio - 1, completion_mask)
                kl_per_seq = dist.global_mean((kl * loss_mask).sum(1)).item()  # over all ranks' sequences
                metrics.update({"kl/token_mean": masked_mean(kl, loss_mask), "kl/seq_mean": kl_per_seq,
                                "kl/coef": kl_coef})
                kl_coef = update_kl_coef(kl_coef, kl_per_seq, B * dist.world_size(), args)
            valid = loss_mask.bool()
            metrics.update({
                "reward/score_mean": scores.mean(),  # the sequence score after the missing-EOS penalty
                "reward/shaped_mean": (token_rewards * loss_mask).sum(1).mean(),  # score - beta * sum_t KL_t
                "value/mean": masked_mean(old_values, loss_mask),
                # 1 - Var(returns - V) / Var(returns): how much of the return the critic predicts
                "value/explained_variance": 1 - (returns - old_values)[valid].var()
                / returns[valid].var().clamp(min=1e-8),
            })
            metrics = dist.mean_over_ranks(metrics)
            if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
                eval_metrics = evaluate(llm, tokenizer, task, args.max_new_tokens, args.chat_template, args.system_prompt)
                metrics.update(eval_metrics)
            run.log(step + 1, metrics)
            run.log_completions(step + 1, [e["prompt"] for e in examples], [c.text for c in completions], rewards,
                                reward_parts, advantages)
            progress.set_postfix(reward=f"{float(metrics['reward/mean']):.3f}",
                                 eval_acc=f"{eval_metrics['eval/accuracy']:.3f}",
                                 kl=f"{float(metrics.get('kl/ref', 0.0)):.4f}")
            stop = interrupt.stop()  # under torchrun every rank stops after the same step
            if (args.save_every and (step + 1) % args.save_every == 0) or stop:
                path = checkpoint(step + 1)
                if stop:
                    print(f"saved checkpoint {path}; continue with --resume {path}")
                    run.close()
                    sys.exit(interrupt.exit_code)  # 130 (Ctrl-C), 143 (SIGTERM): not a finished run

    run.finish(policy, tokenizer, eval_metrics)


if __name__ == "__main__":
    try:
        main(parse_args(Args))
    except RunError as e:
        sys.exit(f"error: {e}")
