"""The batch layout every script uses, and how a micro-batch runs through the model.

Each row is [left-padded prompt | completion, right-padded], so the prompt always ends at
column P and completion token j sits at column P + j. `completion_mask` marks real
completion tokens (EOS included). Micro-batches are rows of similar length, each cut to
the columns it needs; a micro-batch runs as one packed row when that is cheaper.
"""

from __future__ import annotations

import torch


def position_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each column's position among its row's real tokens (left padding gets 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def completion_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             num_completion_tokens: int):
    """The model's last hidden states (what its output layer takes) at the positions that score the
    real completion tokens, [N, d] with N = attention_mask[:, -C:].sum(), in the row-major order of
    those tokens: completion token j of a row is scored at its column P + j - 1. Also each row's last
    column's hidden states [rows, d] and the model's own logits there [rows, V] (logits_to_keep=1:
    its output layer runs on nothing else), which check common/ops.py's output layer against it.

    Padding costs as much compute as real tokens, and the G completions of a prompt repeat
    it. So when it is cheaper (see pays_to_pack) and allowed (see pack: the mask's memory,
    sliding windows), the micro-batch runs as one packed row: each distinct prompt once, then
    each of its completions (but its last token, which scores nothing), no padding, and an
    attention mask that lets a completion see only its own prompt and its own earlier tokens;
    position ids restart with each prompt and go on through each completion, as in vLLM. The
    same function of the weights as the padded batch (autograd sums a shared prompt's gradient
    over its completions). Otherwise the padded batch runs as it is; position ids count real
    tokens only, so left padding does not shift positions. The model runs through its own
    forward (under FSDP2 the root gathers the embeddings, final norm and head it owns)."""
    C = num_completion_tokens
    packed = pack(model, input_ids, attention_mask, C)
    if packed is not None:
        ids, position_ids, mask, keep = packed
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1,
                    output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1][0, keep], (out.hidden_states[-1][:, -1], out.logits[:, -1])
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_of(attention_mask),
                logits_to_keep=1, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1]
    return hidden[:, -C - 1:-1][attention_mask[:, -C:].bool()], (hidden[:, -1], out.logits[:, -1])


def pack(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The micro-batch as one row (see completion_hidden_states): (input_ids [1, L], position_ids [1, L],
    attention mask [1, 1, L, L], keep [N]: the column of the logit that scores each real
    completion token, in row-major order), all on input_ids' device; None if packing does not
    pay (pays_to_pack), its mask would take more than MAX_PACKED_MASK_BYTES, the model's
    attention takes no custom mask (only transformers' sdpa and eager do) or a row is longer
    than the model's attention window (attention_window)."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    C = num_completion_tokens
    P = input_ids.shape[1] - C
    if attention not in ("sdpa", "eager") or P < 1:
        return None
    # transformers applies no sliding window to a custom mask: a row longer than the window would
    # see tokens that the padded batch (and vLLM) hide from it
    window = attention_window(model.config)
    if window is not None and attention_mask.sum(1).max() > window:
        return None
    device = input_ids.device  # every piece is made there: no L x L copy from the CPU per pass
    B, width = input_ids.shape
    _, group = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1), dim=0, return_inverse=True)
    # the rows by group (in batch order within one): the packed row is this table's taken entries, row-major
    order = torch.argsort(group, stable=True)
    group_of_row = group[order]
    first = torch.ones(B, dtype=torch.bool, device=device)  # the first row of its group gives the prompt
    first[1:] = group_of_row[1:] != group_of_row[:-1]
    real = attention_mask[order].bool()
    column = torch.arange(width, device=device)
    # taken: a group's prompt once, then each of its completions but the last token (which scores nothing)
    take = torch.where(column < P, real & first[:, None], column - P < real[:, P:].sum(1, keepdim=True) - 1)
    L = int(take.sum())  # the packed row's length
    if packed_mask_bytes(L, attention) > MAX_PACKED_MASK_BYTES or \
            not pays_to_pack(L, input_ids.numel(), width, model.config.hidden_size):
        return None
    at = take.flatten().cumsum(0).view(B, width) - 1  # the packed column of each taken entry
    ids = input_ids[order][take]
    # position ids restart with each prompt and go on through each completion (left padding gets none)
    position_ids = position_ids_of(real.long())[take]
    row = torch.where(column < P, -1, order[:, None])[take]  # the completion's batch row; -1: a prompt token
    group_of = group_of_row[:, None].expand(B, width)[take]
    # completion token j > 0 is scored at token j - 1's column, token 0 at its prompt's last token
    scored_at = at[:, P - 1:width - 1].clone()
    scored_at[:, 0] = at[first, P - 1][group_of_row]
    keep = torch.empty_like(scored_at)
    keep[order] = scored_at  # back in batch order
    # a token sees the earlier tokens of its own group that are its prompt or its own completion
    mask = torch.ones(L, L, dtype=torch.bool, device=device).tril_() & (group_of[:, None] == group_of[None, :]) & \
        ((row[None, :] == -1) | (row[:, None] == row[None, :]))
    if attention == "eager":  # eager attention adds its mask to the scores
        mask = torch.zeros(L, L, dtype=MASK_DTYPE["eager"], device=device).masked_fill_(~mask, float("-inf"))
    return ids[None], position_ids[None], mask[None, None], keep[attention_mask[:, P:].bool()]


# A packed row's mask is L x L, the one tensor of a packed pass that grows as L^2, and sdpa
# turns it into a float copy in the compute dtype for each layer, kept for the backward pass
# unless gradient checkpointing is on (seen on CPU: 2 bytes an entry in bf16). The bound, 64 MiB
# (L = 8192 under sdpa, 4096 under eager), keeps that under 64 MiB + 128 MiB a layer. It seldom
# costs speed: past a few thousand tokens packing's quadratic attention eats its savings (in the
# GPU recipe, Qwen2.5-0.5B with 16 rows of <= ~200 + 512 tokens, pays_to_pack stops at L ~ 6k).
MASK_DTYPE = {"sdpa": torch.bool, "eager": torch.float32}
MAX_PACKED_MASK_BYTES = 64 * 2**20


def packed_mask_bytes(packed_len: int, attention: str) -> int:
    """Bytes of the attention mask of a packed row of packed_len tokens under attention ("sdpa"
    or "eager")."""
    return packed_len * packed_len * MASK_DTYPE[attention].itemsize


def attention_window(config) -> int | None:
    """The longest row every layer of the model attends to in full: its smallest sliding window
    (a token sees itself and the window - 1 tokens before it) or attention chunk; None if every
    layer sees the whole row. transformers marks such layers in config.layer_types (Gemma 2/3,
    Qwen2/3 with use_sliding_window past max_window_layers, Llama 4's chunks); configs without
    layer_types (Mistral, Mixtral, Phi-3, Starcoder2) slide every layer when sliding_window is set."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    windows = []
    if layer_types is None or any("sliding" in t for t in layer_types):
        windows.append(getattr(config, "sliding_window", None))
    if layer_types is not None and "chunked_attention" in layer_types:
        windows.append(getattr(config, "attention_chunk_size", None))
    return min((w for w in windows if w is not None), default=None)


def pays_to_pack(packed_len: int, padded_tokens: int, padded_len: int, hidden_size: int) -> bool:
    """Whether one packed row of packed_len tokens costs fewer FLOPs than the padded batch
    (padded_tokens in rows of padded_len). Per layer a token costs ~24 d^2 in the linear
    layers and ~4 d per token it attends to; packing turns many short attention spans into
    one long one (quadratic), so long completions (GPU-sized runs) stay padded."""
    def cost(tokens, span):
        return tokens * (1 + span / (6 * hidden_size))
    return cost(packed_len, packed_len) < cost(padded_tokens, padded_len)


def draw_minibatches(num_rows: int, num_epochs: int, num_minibatches: int, device) -> list[tuple[torch.Tensor, ...]]:
    """Each epoch's minibatches: a random permutation of the rows cut into num_minibatches parts
    whose sizes differ by at most one (tensor_split: DAPO's kept batch need not divide; min: no
    empty part). A script draws them before its old and reference log-probs, so that those come
    from the micro-batches its update's first epoch runs (batched_logprobs)."""
    return [torch.randperm(num_rows, device=device).tensor_split(min(num_minibatches, num_rows))
            for _ in range(num_epochs)]


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
    once (see completion_hidden_states). Normalizers stay the minibatch's (see aggregate), so the
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
    chunks = order.split(size)
    # every micro-batch's longest prompt and completion, read to the host in one transfer (they are shapes)
    longest = torch.stack([torch.stack([prompt_lens[chunk].max(), completion_lens[chunk].max()])
                           for chunk in chunks]).tolist()
    for chunk, (p, c) in zip(chunks, longest):
        c = max(1, c)
        yield rows[chunk], slice(P - p, P + c), c


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


def rollout_batch(prompt_ids: list[list[int]], completions, pad_token_id: int, device, mask_truncated: bool = False):
    """A rollout (each prompt's completions consecutive, vLLM's outputs) in the batch layout:
    input_ids, attention_mask, completion_mask, loss_mask ([B, C]: completion_mask, less the
    completions that hit the token limit when mask_truncated: no EOS, so we don't know how they
    would have ended) and truncated [B]."""
    G = len(completions) // len(prompt_ids)
    input_ids, attention_mask, completion_mask = make_batch([p for p in prompt_ids for _ in range(G)],
                                                            [list(c.token_ids) for c in completions], pad_token_id,
                                                            device)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=device)
    loss_mask = completion_mask.clone()
    if mask_truncated:
        loss_mask[truncated] = 0
    return input_ids, attention_mask, completion_mask, loss_mask, truncated


def episode_batch(prompt_ids: list[list[int]], episodes, pad_token_id: int, device, mask_truncated: bool = False):
    """rollout_batch of multi-turn episodes (common/env.py Episode: the model's turns and the
    environment's observations after the prompt, as completions): the same tensors, but
    completion_mask and loss_mask mark the model's own tokens only. Observation tokens stay in
    input_ids and attention_mask, as context, and get no loss and no KL."""
    input_ids, attention_mask, completion_mask, loss_mask, truncated = rollout_batch(
        prompt_ids, episodes, pad_token_id, device, mask_truncated)
    model_mask = torch.zeros_like(completion_mask)
    for i, e in enumerate(episodes):
        model_mask[i, :len(e.model_mask)] = torch.tensor(e.model_mask)
    return input_ids, attention_mask, completion_mask * model_mask, loss_mask * model_mask, truncated
