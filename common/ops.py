"""The math the scripts call: per-token log-probs of completions (and their entropy), under the
sampler's top-k / top-p truncation when it has one, the rollout correction for vLLM's own numerics,
KL estimates as a reward penalty and as a loss term, and masked aggregation of per-token losses.
The batch layout they read is common/batch.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from common.batch import completion_hidden_states, micro_batches
from common.errors import need

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# The [N, V] logits of a micro-batch's N completion tokens would be the largest tensors of a step (16 x 512
# tokens of a 152k vocabulary: 5 GB in fp32, and the backward of log-softmax and gather holds ~3 of them).
# So they never exist whole: the output layer runs on LOGITS_CHUNK / V positions at a time, each chunk
# checkpointed (the backward recomputes its logits instead of the forward keeping them). 2^26 fp32 logits
# (256 MiB; ~440 positions of a 152k vocabulary) bound that peak near 1 GiB whatever N, in matmuls still
# large enough to keep a GPU busy; the recomputation adds one more forward of the output layer (a third of
# its cost, a few % of a 7B model's step).
LOGITS_CHUNK = 2**26


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_completion_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                     with_entropy: bool = False):
    """log pi(y_t | x, y_<t) for the last `num_completion_tokens` columns of each row.

    The logit at position t predicts the token at t+1, so the C completion tokens are
    scored by the logits at columns P-1 .. P+C-2 (see completion_hidden_states), divided by the
    sampling temperature first: the policy that generated the data is softmax(logits / T).
    The log-softmax runs in fp32 even under bf16 autocast (the main source of trainer/vLLM
    mismatch otherwise). Returns [B, C] log-probs, 0 on completion padding (and [B, C]
    entropies, detached, if asked).

    top_p < 1 or top_k > 0: the policy that generated the data is vLLM's truncated sampler, softmax over
    the tokens top_k_top_p_mask keeps of logits / T (renormalized there), and the log-probs and entropies
    are those of that distribution (see chunk_logprobs). The defaults (1.0, 0) run no truncation code.

    Memory: the logits are computed LOGITS_CHUNK at a time from the model's last hidden
    states, each chunk checkpointed, so neither pass holds more than a chunk of them."""
    C = num_completion_tokens
    real = attention_mask[:, -C:].bool()
    hidden, (last_hidden, last_logits) = completion_hidden_states(model, input_ids, attention_mask, C)
    layer = output_layer(model)
    check_output_layer(model, layer, last_hidden, last_logits)
    score = functools.partial(chunk_logprobs, layer, temperature, with_entropy, top_p, top_k)
    step = max(1, LOGITS_CHUNK // last_logits.shape[-1])
    chunks = [checkpoint(score, h, y, use_reentrant=False, preserve_rng_state=False) if torch.is_grad_enabled()
              else score(h, y) for h, y in zip(hidden.split(step), input_ids[:, -C:][real].split(step))]
    token_logprobs = torch.cat([c[0] for c in chunks])
    logprobs = token_logprobs.new_zeros(real.shape).masked_scatter(real, token_logprobs)
    if not with_entropy:
        return logprobs
    return logprobs, torch.zeros_like(logprobs).masked_scatter(real, torch.cat([c[1] for c in chunks]))


def chunk_logprobs(layer, temperature: float, with_entropy: bool, top_p: float, top_k: int, hidden: torch.Tensor,
                   tokens: torch.Tensor):
    """forward_logprobs of one chunk of positions: hidden [n, d], their tokens [n]; (log-probs [n], entropies
    [n] (detached) or None)."""
    logits = layer(hidden).float()
    if temperature != 1.0:
        logits = logits.div_(temperature)  # in place: the layer's output is not needed again
    truncated = top_p < 1.0 or top_k > 0
    if truncated:  # the sampler's distribution: its kept tokens renormalized (of logits / T, as vLLM truncates)
        kept = top_k_top_p_mask(logits, top_k, top_p)  # its sort holds ~4 more chunk-sized tensors, for a moment
        # a sampled token the truncation drops here (its logit on the boundary, within the engine's numerics
        # of ours) stays in the normalizer: a finite log-prob, never -inf or NaN
        kept[torch.arange(len(tokens), device=tokens.device), tokens] = True
        logits = logits.masked_fill(~kept, float("-inf"))
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():  # H = log Z - sum_v p_v * logit_v; after the log-probs: a recomputation stops before it
        probs = torch.softmax(logits, dim=-1)
        if truncated:  # a dropped token adds p_v * logit_v = 0 (0 * -inf would be NaN)
            logits = logits.masked_fill(~kept, 0.0)
        return logprobs, log_z - (probs * logits).sum(-1)


@torch.no_grad()
def top_k_top_p_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens vLLM's sampler keeps of logits [n, V] (already / T): [n, V] bool. vLLM 0.32's rule
    (vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p), step for step, for one exact set:

    top-k (0 < top_k < V; 0: off): the tokens whose logit is at least the k-th largest (ties with it are
        all kept: more than k tokens then);
    top-p (top_p < 1): then, of the top-k distribution sorted ascending, the tokens whose cumulative
        probability (float32, from the smallest) exceeds 1 - top_p, the most likely token always. Of
        tied logits across that boundary, one stays and the other goes, by torch's (unstable) sort order:
        the same call as vLLM's, on the same values.

    The sampler samples from softmax over the kept tokens (the TransformersEngine's too), and vLLM's
    processed log-probs are that distribution's."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    V = logits.shape[-1]
    if 0 < top_k < V:
        sorted_logits.masked_fill_(sorted_logits < sorted_logits[:, V - top_k, None], float("-inf"))
    if top_p < 1.0:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # 1 - p in float32, as vLLM computes it from its float32 tensor of p (a Python 1 - p rounds otherwise)
        dropped = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32, device=logits.device)
        dropped[:, -1] = False  # the most likely token
        sorted_logits.masked_fill_(dropped, float("-inf"))
    return torch.empty_like(logits, dtype=torch.bool).scatter_(-1, order, sorted_logits > float("-inf"))


def output_layer(model):
    """The model's logits as a function of its last hidden states: its output embeddings (lm_head, tied
    or not, under LoRA the adapted layer; under FSDP2 the root's, which stays gathered from the forward
    to the end of the backward), then the final-logit soft-capping of the models that have it (Gemma 2:
    cap * tanh(logits / cap))."""
    head = model.get_output_embeddings()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if not cap:
        return head
    return lambda hidden: torch.tanh(head(hidden) / cap) * cap


def check_output_layer(model, layer, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """Once per model: the layer's logits of hidden [rows, d] are the model's own, logits [rows, V]. A model
    whose forward scales its logits otherwise (Cohere's logit_scale, Granite's logits_scaling) is refused."""
    if getattr(model, "output_layer_checked", False):
        return
    with torch.no_grad():
        ours, own = layer(hidden).float(), logits.float()
        need(bool((ours - own).abs().max() <= 1e-2 * own.abs().max() + 1e-3),
             f"{type(model).__name__}'s forward transforms its output layer's logits in a way forward_logprobs "
             f"does not reproduce (it applies final_logit_softcapping only)")
    model.output_layer_checked = True


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_completion_tokens: int, temperature: float, micro_batch_size: int,
                     autocast_dtype: torch.dtype | None = None, minibatches=None, top_p: float = 1.0,
                     top_k: int = 0) -> torch.Tensor:
    """forward_logprobs without gradients, one micro-batch (see micro_batches) of each of minibatches
    (row indices; None: all rows, one minibatch) at a time; [B, C], 0 on completion padding. top_p, top_k:
    the sampler's truncation (see forward_logprobs).

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
                                                  c, temperature, top_p, top_k)
    return out


# --rollout-correction's modes; each one's thresholds by default, the peer's (DESIGN.md section 8)
ROLLOUT_CORRECTIONS = ("off", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "geometric-mask")
CORRECTION_DEFAULTS = {"token-truncate": {"cap": 2.0}, "sequence-truncate": {"cap": 2.0},
                       "token-mask": {"low": 0.5, "high": 5.0}, "sequence-mask": {"low": 0.5, "high": 2.0},
                       "geometric-mask": {"low": 0.99, "high": 1.01}}
MAX_LOG_RATIO = 20.0  # every log-ratio is clamped to +-20 before exp (verl's): finite however long the sequence


@dataclass(frozen=True)
class RolloutCorrection:
    """--rollout-correction made concrete: the mode and the thresholds it uses (None: one it does not use)."""
    mode: str = "off"
    cap: float | None = None   # C of the truncate modes
    low: float | None = None   # C_low of the mask modes
    high: float | None = None  # C_high of the mask modes

    @classmethod
    def of(cls, mode: str, cap: float | None = None, low: float | None = None,
           high: float | None = None) -> RolloutCorrection:
        """The mode with its thresholds, a None one the mode's default (CORRECTION_DEFAULTS)."""
        given = {"cap": cap, "low": low, "high": high}
        defaults = CORRECTION_DEFAULTS.get(mode, {})
        return cls(mode, **{k: default if given[k] is None else given[k] for k, default in defaults.items()})


class CorrectionTerms(NamedTuple):
    weights: torch.Tensor     # [B, C] w, detached; 1 outside the mask
    rho: torch.Tensor         # [B, C] rho_t (its log-ratio clamped), 1 outside the mask
    seq_rho: torch.Tensor     # [B] rho_i = prod_t rho_t (its log clamped)
    truncated: torch.Tensor   # [B, C] bool: tokens whose weight was capped below their ratio
    masked: torch.Tensor      # [B, C] bool: tokens left out (weight 0)


@torch.no_grad()
def rollout_correction(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       correction: RolloutCorrection) -> torch.Tensor:
    """The weights [B, C] on each token's policy gradient that correct for the engine (vLLM) sampling
    from its own numerics, not exactly from pi_old. With rho_t = pi_old(y_t) / pi_engine(y_t) and a
    sequence's rho_i = prod_t rho_t over its sampled tokens (mask):

        off                w = 1
        token-truncate     w_t = min(rho_t, C)                             TIS (Yao et al. 2025); C 2
        token-mask         w_t = rho_t * 1[C_low <= rho_t <= C_high]       IcePop (OpenRLHF icepop); [0.5, 5]
        sequence-truncate  w_i = min(rho_i, C)                             verl rollout_is sequence; C 2
        sequence-mask      w_i = rho_i * 1[C_low <= rho_i <= C_high]       MIS (verl Seq-MIS); [0.5, 2]
        geometric-mask     w_i = 1[C_low <= exp(mean_t log rho_t) <= C_high]   verl Geo-RS, SkyRL; [0.99, 1.01]

    A sequence's weight is broadcast to its tokens. Each log rho_t and each sum of them is clamped to
    +-20 before exp, so one bad token (rho 0, or a product that would overflow) gives a finite weight.
    The weights are detached, and 1 outside mask (so a geometric mean of them, gspo.py, takes no log(0)
    there). A masked token (weight 0) leaves the loss but keeps its place in the loss's normalizer
    (the aggregate's count is untouched), as the peers do."""
    return rollout_correction_terms(old_logprobs, engine_logprobs, mask, correction).weights


@torch.no_grad()
def rollout_correction_terms(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                             correction: RolloutCorrection) -> CorrectionTerms:
    """rollout_correction's weights with the ratios and the decisions behind them (for the metrics)."""
    mask = mask.bool()
    log_rho = (old_logprobs - engine_logprobs).float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).masked_fill(~mask, 0.0)
    seq_log_rho = log_rho.sum(-1, keepdim=True)
    rho, seq_rho = log_rho.exp(), seq_log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    mode, cap, low, high = correction.mode, correction.cap, correction.low, correction.high
    nothing = torch.zeros_like(mask)
    if mode == "off":
        weights, truncated, masked = torch.ones_like(rho), nothing, nothing
    elif mode == "token-truncate":
        weights, truncated, masked = rho.clamp(max=cap), rho > cap, nothing
    elif mode == "token-mask":
        keep = (low <= rho) & (rho <= high)
        weights, truncated, masked = rho * keep, nothing, ~keep
    elif mode == "sequence-truncate":
        weights, truncated, masked = seq_rho.clamp(max=cap).expand_as(rho), (seq_rho > cap).expand_as(mask), nothing
    elif mode == "sequence-mask":
        keep = ((low <= seq_rho) & (seq_rho <= high)).expand_as(mask)
        weights, truncated, masked = seq_rho * keep, nothing, ~keep
    elif mode == "geometric-mask":
        geo_mean = torch.exp(seq_log_rho / mask.sum(-1, keepdim=True).clamp(min=1))
        keep = ((low <= geo_mean) & (geo_mean <= high)).expand_as(mask)
        weights, truncated, masked = keep.to(rho.dtype), nothing, ~keep
    else:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    return CorrectionTerms(torch.where(mask, weights, 1.0), rho, seq_rho.squeeze(-1), truncated & mask, masked & mask)


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
        # (a tensor count stays on its device: no host transfer per micro-batch)
        return token_sums.sum() / torch.as_tensor(num_tokens, device=token_sums.device).clamp(min=1.0)
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


KL_LOSS_ESTIMATORS = ("k3", "k2-is")


def kl_loss(logprobs, old_logprobs, ref_logprobs, estimator: str):
    """Per-token KL term of a loss (--kl-estimator) at tokens sampled from pi_old; logprobs carry the gradient.

    k3 = exp(ref_t - logp_t) - (ref_t - logp_t) - 1: an unbiased estimate of KL(pi || pi_ref) at samples
    of pi (the GRPO paper's), but its gradient is not grad KL: E_pi[grad k3] = E_pi[(1 - pi_ref/pi) grad log pi]
    = -E_pi_ref[grad log pi], the gradient of KL(pi_ref || pi).

    k2-is = sg(r_t) * (logp_t - ref_t)^2 / 2, r_t = pi / pi_old (sg: no gradient through it), whose
    gradient is unbiased for grad KL(pi || pi_ref) at samples of pi_old:
        grad KL = E_pi[(log pi - log pi_ref + 1) grad log pi]
                = E_pi[(log pi - log pi_ref) grad log pi]              (E_pi[grad log pi] = 0)
                = E_pi_old[r_t (log pi - log pi_ref) grad log pi],
    which is E_pi_old[grad k2-is] term by term (OpenRLHF's opt-in sg(ratio) estimators are of this kind)."""
    if estimator == "k3":
        log_ref_ratio = ref_logprobs - logprobs
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1
    if estimator == "k2-is":
        return torch.exp(logprobs - old_logprobs).detach() * 0.5 * (logprobs - ref_logprobs) ** 2
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_LOSS_ESTIMATORS)}")
