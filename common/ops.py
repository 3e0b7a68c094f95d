"""The math the scripts call: per-token log-probs of completions (and their entropy), the
truncated importance weights for vLLM's own numerics, KL estimates as a reward penalty, and
masked aggregation of per-token losses. The batch layout they read is common/batch.py's.
"""

from __future__ import annotations

import torch

from common.batch import completion_logits, micro_batches

# the entropy is computed over slices of at most this many logits (2^26 fp32: 256 MiB)
ENTROPY_SLICE = 2**26
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_completion_tokens: int, temperature: float = 1.0,
                     with_entropy: bool = False):
    """log pi(y_t | x, y_<t) for the last `num_completion_tokens` columns of each row.

    The logit at position t predicts the token at t+1, so the C completion tokens are
    scored by the logits at columns P-1 .. P+C-2 (see completion_logits), divided by the
    sampling temperature first: the policy that generated the data is softmax(logits / T).
    The log-softmax runs in fp32 even under bf16 autocast (the main source of trainer/vLLM
    mismatch otherwise). Returns [B, C] log-probs, 0 on completion padding (and [B, C]
    entropies, detached, if asked).

    Memory: the [N, V] logits of the N real completion tokens are the largest tensors of a
    step (8k x 152k in fp32 is 5 GB), so none is copied needlessly: the temperature divides
    in place, and the entropy is computed a slice of tokens at a time."""
    C = num_completion_tokens
    real = attention_mask[:, -C:].bool()
    logits = completion_logits(model, input_ids, attention_mask, C).float()
    if temperature != 1.0:
        logits = logits.div_(temperature)  # in place: the model's output is not needed again
    log_z = torch.logsumexp(logits, dim=-1)
    token_logprobs = logits.gather(-1, input_ids[:, -C:][real].unsqueeze(-1)).squeeze(-1) - log_z
    logprobs = token_logprobs.new_zeros(real.shape).masked_scatter(real, token_logprobs)
    if not with_entropy:
        return logprobs
    with torch.no_grad():
        # H = log Z - sum_v p_v * logit_v, a slice of tokens at a time: no second [N, V] tensor
        step = max(1, ENTROPY_SLICE // logits.shape[-1])
        entropy = torch.cat([z - (torch.softmax(chunk, dim=-1) * chunk).sum(-1)
                             for chunk, z in zip(logits.detach().split(step), log_z.split(step))])
    return logprobs, torch.zeros_like(logprobs).masked_scatter(real, entropy)


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_completion_tokens: int, temperature: float, micro_batch_size: int,
                     autocast_dtype: torch.dtype | None = None, minibatches=None) -> torch.Tensor:
    """forward_logprobs without gradients, one micro-batch (see micro_batches) of each of minibatches
    (row indices; None: all rows, one minibatch) at a time; [B, C], 0 on completion padding.

    Pass the update's minibatches (its first epoch's, common/batch.py draw_minibatches): a micro-batch's
    log-probs depend on the rows it runs with (padding, packing), by 1e-3..1e-2 in bf16, so only the same
    micro-batches give the very values the update's forward computes before its first step."""
    if minibatches is None:
        minibatches = [torch.arange(input_ids.shape[0], device=input_ids.device)]
    out = torch.zeros(input_ids.shape[0], num_completion_tokens, device=input_ids.device)
    for rows in minibatches:
        for micro, columns, c in micro_batches(rows, input_ids, attention_mask, num_completion_tokens,
                                               micro_batch_size):
            with torch.autocast(input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out[micro, :c] = forward_logprobs(model, input_ids[micro, columns], attention_mask[micro, columns],
                                                  c, temperature)
    return out


def truncated_is_weights(old_logprobs: torch.Tensor, vllm_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """w_t = min(pi_old(y_t) / pi_vllm(y_t), cap): vLLM sampled each token from its own numerics,
    not exactly from pi_old, and truncated importance sampling corrects the policy gradient for
    it (the cap bounds the variance). cap 0: off, every weight 1."""
    ratio = torch.exp(old_logprobs - vllm_logprobs)
    return ratio.clamp(max=cap) if cap else torch.ones_like(ratio)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str,
              num_tokens: float | torch.Tensor | None = None, num_seqs: int | None = None,
              max_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, C] to a scalar over the tokens where mask is 1.

    token-mean               sum_i,t v / (number of tokens)                    (DAPO)
    seq-mean-token-mean      mean_i ( sum_t v / |y_i| )                        (GRPO paper)
    seq-mean-token-sum       mean_i ( sum_t v )
    seq-mean-token-sum-norm  mean_i ( sum_t v / max_tokens )                   (Dr. GRPO)

    Under gradient accumulation pass the minibatch's totals as num_tokens and num_seqs:
    each micro-batch then contributes its exact share, and the summed gradients equal
    the gradient of one pass over the whole minibatch."""
    mask = mask.to(values.dtype)
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    token_sums = (values * mask).sum(-1)
    if mode == "token-mean":
        # max(., 1): a minibatch whose completions are all masked out gives 0, not NaN
        return token_sums.sum() / max(float(num_tokens), 1.0)
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if max_tokens is None:
            raise ValueError("seq-mean-token-sum-norm needs max_tokens (e.g. max_new_tokens)")
        return token_sums.sum() / (max_tokens * num_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over mask (0 for an empty mask), for metrics."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_penalty(old_logprobs, ref_logprobs, estimator: str):
    """Per-token estimate of KL(pi_old || pi_ref) at the sampled tokens, as a reward penalty:
    k1 = log ratio (unbiased), k2 = log ratio^2 / 2, k3 = exp(-log ratio) + log ratio - 1."""
    log_ratio = old_logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1  # k3
