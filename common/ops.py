"""Per-token log-probs of completions and masked aggregation of per-token losses.

Batch layout used by every script: each row is [left-padded prompt | completion,
right-padded], so the prompt always ends at column P and completion token j sits at
column P + j. `completion_mask` marks real completion tokens (EOS included).
"""

from __future__ import annotations

import torch

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


def position_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each column's position among its row's real tokens (left padding gets 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The logits that score the real completion tokens, [N, V] with N = attention_mask[:, -C:].sum(),
    in the row-major order of those tokens: completion token j of a row is scored by the logit
    at its column P + j - 1.

    Padding costs as much compute as real tokens, and the G completions of a prompt repeat
    it. So when it is cheaper (see pays_to_pack), the micro-batch runs as one packed row
    (pack): each distinct prompt once, then each of its completions (but its last token,
    which scores nothing), no padding, and an attention mask that lets a completion see
    only its own prompt and its own earlier tokens; position ids restart with each prompt
    and go on through each completion, as in vLLM. The same function of the weights as the
    padded batch (autograd sums a shared prompt's gradient over its completions). Otherwise
    the padded batch runs as it is; position ids count real tokens only, so left padding
    does not shift positions. Either way only the N scoring rows go through the output
    layer (logits_to_keep)."""
    C = num_completion_tokens
    packed = pack(model, input_ids, attention_mask, C)
    if packed is not None:
        ids, position_ids, mask, keep = packed
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep,
                     use_cache=False).logits[0]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_of(attention_mask),
                   logits_to_keep=C + 1, use_cache=False).logits[:, :-1]
    return logits[attention_mask[:, -C:].bool()]


def pack(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The micro-batch as one row (see completion_logits): (input_ids [1, L], position_ids [1, L],
    attention mask [1, 1, L, L], keep [N]: the column of the logit that scores each real
    completion token, in row-major order); None if packing does not pay (pays_to_pack) or
    the model's attention takes no custom mask (only transformers' sdpa and eager do)."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    C = num_completion_tokens
    P = input_ids.shape[1] - C
    if attention not in ("sdpa", "eager") or P < 1:
        return None
    prompts, group = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1), dim=0,
                                  return_inverse=True)
    real = attention_mask.bool()
    pieces, keep, n = [], [None] * len(input_ids), 0  # (token ids, first position, row or -1, group); columns so far
    for g, prompt in enumerate(prompts):
        prompt = prompt[:P][prompt[P:].bool()]
        pieces.append((prompt, 0, -1, g))
        n += len(prompt)
        last = n - 1  # the prompt's last token: its logit scores each completion's first token
        for i in (group == g).nonzero().flatten().tolist():
            completion = input_ids[i, P:][real[i, P:]]
            keep[i] = n - 1 + torch.arange(len(completion))  # token j > 0 is scored at token j - 1's column
            keep[i][:1] = last
            pieces.append((completion[:-1], len(prompt), i, g))  # its last token scores nothing
            n += len(completion[:-1])
    L = n  # the packed row's length
    if not pays_to_pack(L, input_ids.numel(), input_ids.shape[1], model.config.hidden_size):
        return None
    ids = torch.cat([tokens for tokens, _, _, _ in pieces])
    position_ids = torch.cat([first + torch.arange(len(tokens)) for tokens, first, _, _ in pieces])
    row = torch.cat([torch.full((len(tokens),), r) for tokens, _, r, _ in pieces])
    group_of = torch.cat([torch.full((len(tokens),), g) for tokens, _, _, g in pieces])
    # a token sees the earlier tokens of its own group that are its prompt or its own completion
    mask = torch.ones(L, L, dtype=torch.bool).tril_() & (group_of[:, None] == group_of[None, :]) & \
        ((row[None, :] == -1) | (row[:, None] == row[None, :]))
    if attention == "eager":  # eager attention adds its mask to the scores
        mask = torch.zeros(L, L).masked_fill_(~mask, float("-inf"))
    device = input_ids.device
    return ids[None].to(device), position_ids[None].to(device), mask[None, None].to(device), torch.cat(keep).to(device)


def pays_to_pack(packed_len: int, padded_tokens: int, padded_len: int, hidden_size: int) -> bool:
    """Whether one packed row of packed_len tokens costs fewer FLOPs than the padded batch
    (padded_tokens in rows of padded_len). Per layer a token costs ~24 d^2 in the linear
    layers and ~4 d per token it attends to; packing turns many short attention spans into
    one long one (quadratic), so long completions (GPU-sized runs) stay padded."""
    def cost(tokens, span):
        return tokens * (1 + span / (6 * hidden_size))
    return cost(packed_len, packed_len) < cost(padded_tokens, padded_len)


def micro_batches(rows: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  num_completion_tokens: int, size: int):
    """Split rows (indices into the batch) into micro-batches of similar length, each cut to
    the columns it needs. Yields (micro, columns, c): input_ids[micro, columns] holds these
    rows' prompts left-padded to their own longest prompt and their completions right-padded
    to their own longest completion, c tokens; per-token tensors line up as [micro, :c].

    Padding costs as much compute as tokens, and a batch's longest prompt and completion are
    rarely in the same row: sorting by length and cutting each micro-batch to its own longest
    row skips most of it. Rows with the same prompt stay next to each other (sorted by their
    group's longest completion), so that a micro-batch holds whole groups whose prompt runs
    once (see completion_logits). Normalizers stay the minibatch's (see aggregate), so the
    summed micro-batch gradients are still the minibatch's gradient."""
    C = num_completion_tokens
    P = attention_mask.shape[1] - C
    prompt_lens = attention_mask[rows, :P].sum(1)
    completion_lens = attention_mask[rows, P:].sum(1)
    _, group = torch.unique(torch.cat([input_ids[rows, :P], attention_mask[rows, :P]], dim=1), dim=0,
                            return_inverse=True)
    group_lens = torch.zeros_like(completion_lens).scatter_reduce(0, group, completion_lens, "amax")[group]
    order = torch.argsort(((group_lens * (P + 1) + prompt_lens) * len(rows) + group) * (C + 1) + completion_lens,
                          stable=True)
    for i in range(0, len(rows), size):
        chunk = order[i:i + size]
        p, c = int(prompt_lens[chunk].max()), max(1, int(completion_lens[chunk].max()))
        yield rows[chunk], slice(P - p, P + c), c


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_completion_tokens: int, temperature: float, micro_batch_size: int,
                     autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """forward_logprobs without gradients, one micro-batch (see micro_batches) at a time;
    [B, C], 0 on completion padding."""
    out = torch.zeros(input_ids.shape[0], num_completion_tokens, device=input_ids.device)
    all_rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    for micro, columns, c in micro_batches(all_rows, input_ids, attention_mask, num_completion_tokens,
                                               micro_batch_size):
        with torch.autocast(input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out[micro, :c] = forward_logprobs(model, input_ids[micro, columns], attention_mask[micro, columns], c,
                                              temperature)
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


def make_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_token_id: int,
               device: str | torch.device):
    """Pad rollouts into the [left-padded prompt | right-padded completion] layout.

    Returns input_ids [B, P+C], attention_mask [B, P+C] and completion_mask [B, C], where
    C is the longest completion. Padding is found by position, never by token id, so an
    EOS that ends a completion stays in the mask even when pad and EOS share an id."""
    P = max(len(p) for p in prompt_ids)
    C = max(1, max(len(c) for c in completion_ids))
    B = len(prompt_ids)
    input_ids = torch.full((B, P + C), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + C), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attention_mask[i, P - len(p):P + len(c)] = 1
    completion_mask = attention_mask[:, P:].clone()
    return input_ids.to(device), attention_mask.to(device), completion_mask.to(device)
