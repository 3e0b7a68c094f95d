"""Log-probs of completion tokens and the four loss aggregations, against direct computations."""

import math

import pytest
import torch

from common.batch import completion_hidden_states, make_batch
from common.ops import aggregate, batched_logprobs, forward_logprobs, output_layer, top_k_top_p_mask


def reference_logprobs(model, ids: list[int], num_completion: int, temperature: float) -> torch.Tensor:
    """Unpadded, full logits of the whole sequence, log_softmax(logits / T), shifted by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    P = len(ids) - num_completion
    # token at position t is predicted by the logits at position t - 1
    return torch.stack([logp[t - 1, ids[t]] for t in range(P, len(ids))])


def test_logprobs_match_full_log_softmax_with_padding_on_both_sides(tiny_policy, tokenizer):
    prompts = [tokenizer("sort 52813:")["input_ids"], tokenizer("sort 91:")["input_ids"]]
    completions = [tokenizer("12358")["input_ids"] + [tokenizer.eos_token_id], tokenizer("19")["input_ids"]]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    # row 1 is padded on the left (shorter prompt) and on the right (shorter completion)
    assert attention_mask[1, 0] == 0 and attention_mask[1, -1] == 0
    assert completion_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    T = 0.7
    logprobs = forward_logprobs(tiny_policy, input_ids, attention_mask, completion_mask.shape[1], T)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        expected = reference_logprobs(tiny_policy, p + c, len(c), T)
        torch.testing.assert_close(logprobs[row, :len(c)], expected, atol=1e-5, rtol=1e-5)
    # temperature matters: T = 1 gives different numbers
    assert not torch.allclose(forward_logprobs(tiny_policy, input_ids, attention_mask, 6, 1.0), logprobs)


@pytest.mark.parametrize("slice_positions", [None, 2])
def test_entropy_in_slices_and_gradient_through_the_in_place_temperature(tiny_policy, tokenizer, monkeypatch,
                                                                        slice_positions):
    """The entropy, computed in one chunk or two positions at a time, equals -sum p log p of
    softmax(logits / T); the log-probs and their gradient are those of log_softmax(logits / T)
    despite the in-place division."""
    import common.ops

    if slice_positions is not None:
        monkeypatch.setattr(common.ops, "LOGITS_CHUNK", slice_positions * tiny_policy.config.vocab_size)
    ids = tokenizer("sort 52813:12358")["input_ids"]
    input_ids, attention_mask, _ = make_batch([ids[:11]], [ids[11:]], tokenizer.pad_token_id, "cpu")
    T, C = 0.7, len(ids) - 11
    logits = tiny_policy(torch.tensor([ids])).logits[0, 10:-1].float() / T
    expected_logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[11:]).unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    expected_grad = torch.autograd.grad(expected_logprobs.sum(), tiny_policy.lm_head.weight)[0]

    logprobs, entropy = forward_logprobs(tiny_policy, input_ids, attention_mask, C, T, with_entropy=True)
    torch.testing.assert_close(entropy[0], expected_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs[0], expected_logprobs.detach(), atol=1e-5, rtol=1e-5)
    grad = torch.autograd.grad(logprobs.sum(), tiny_policy.lm_head.weight)[0]
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)


def kept(logits: list[float], top_k: int = 0, top_p: float = 1.0) -> list[int]:
    """The token ids top_k_top_p_mask keeps of one row of logits."""
    return top_k_top_p_mask(torch.tensor([logits]), top_k, top_p)[0].nonzero().flatten().tolist()


def test_top_k_top_p_mask_hand_computed():
    """vLLM's rule: top-k keeps every logit tied with the k-th largest; top-p runs after top-k, on its
    renormalized distribution, and keeps the most likely token always."""
    assert kept([3.0, 2.0, 2.0, 1.0, 0.0], top_k=2) == [0, 1, 2]  # 2 tied with the 2nd largest: both stay
    assert kept([0.0, 1.0, 2.0], top_k=1) == [2]
    assert kept([0.0, 1.0, 2.0], top_k=3) == kept([0.0, 1.0, 2.0]) == [0, 1, 2]  # k >= V: off
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    logits = torch.tensor(probs).log().tolist()
    # top-p 0.6 alone: ascending cumulative 0.05, 0.15, 0.30 <= 0.4 dropped, 0.50 kept
    assert kept(logits, top_p=0.6) == [0, 1]
    # top-k 2 first: 0.5 / 0.7 and 0.2 / 0.7 = 0.286 <= 0.4, dropped (top-p first, then top-k, would keep 2)
    assert kept(logits, top_k=2, top_p=0.6) == [0]
    assert kept(logits, top_k=3, top_p=0.6) == [0, 1]  # 0.15 / 0.85 = 0.18 <= 0.4 < 0.41
    assert kept(logits, top_p=0.01) == [0]  # the most likely token stays whatever p
    assert kept([0.0, 0.0], top_p=0.01) in ([0], [1])  # of two tied, one
    # ties under top-p: e / (2e + 1) = 0.42 each and 0.16; at p 0.5 both tied stay, at p 0.3 one of them
    assert kept([1.0, 1.0, 0.0], top_p=0.5) == [0, 1]
    assert kept([1.0, 1.0, 0.0], top_p=0.3) in ([0], [1])


def test_top_k_top_p_mask_is_vllms():
    """The same kept set as vLLM's own apply_top_k_top_p on random rows (rounded: many ties), for
    top-k, top-p and both."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler", reason="needs vLLM")
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        V = int(torch.randint(2, 200, (), generator=g))
        logits = torch.randn(5, V, generator=g) * 4
        logits = logits.round() if trial % 2 else logits
        k, p = [(7, 1.0), (0, 0.8), (20, 0.9), (1, 0.5), (V - 1, 0.95)][trial % 5]
        k = min(k, V)
        ours = top_k_top_p_mask(logits, k, p)
        theirs = sampler.apply_top_k_top_p(logits.clone(), torch.full((5,), k if 0 < k < V else V, dtype=torch.int32)
                                           if 0 < k < V else None, torch.full((5,), p) if p < 1 else None)
        assert torch.equal(ours, theirs > float("-inf")), (trial, k, p)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.8), (3, 0.8)])
def test_truncated_logprobs_entropy_and_gradient_are_the_renormalized_distributions(tiny_policy, tokenizer,
                                                                                   top_k, top_p):
    """With --top-k / --top-p the log-probs are log_softmax over the kept tokens of logits / T, their
    entropy that distribution's, the gradient that of the renormalized log-prob; a token the truncation
    drops keeps its place in the normalizer (finite, below its full-softmax log-prob's share)."""
    ids = tokenizer("sort 52813:12358")["input_ids"]
    input_ids, attention_mask, _ = make_batch([ids[:11]], [ids[11:]], tokenizer.pad_token_id, "cpu")
    T, C = 2.0, len(ids) - 11  # hot enough that the truncation drops some mass
    tokens = torch.tensor(ids[11:])
    logits = tiny_policy(torch.tensor([ids])).logits[0, 10:-1].float() / T
    keep = top_k_top_p_mask(logits.detach(), top_k, top_p)
    assert (keep.sum(-1) < logits.shape[-1]).all()
    keep[torch.arange(C), tokens] = True
    log_z = torch.stack([row[k].logsumexp(-1) for row, k in zip(logits, keep)])  # over the kept set, by hand
    expected_logprobs = logits.gather(-1, tokens[:, None])[:, 0] - log_z
    p = [torch.softmax(row[k], -1) for row, k in zip(logits.detach(), keep)]
    expected_entropy = torch.stack([-(q * q.log()).sum() for q in p])
    expected_grad = torch.autograd.grad(expected_logprobs.sum(), tiny_policy.lm_head.weight)[0]

    logprobs, entropy = forward_logprobs(tiny_policy, input_ids, attention_mask, C, T, top_p, top_k, with_entropy=True)
    torch.testing.assert_close(logprobs[0], expected_logprobs.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[0], expected_entropy, atol=1e-5, rtol=1e-5)
    grad = torch.autograd.grad(logprobs.sum(), tiny_policy.lm_head.weight)[0]
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)
    full = forward_logprobs(tiny_policy, input_ids, attention_mask, C, T).detach()
    assert (logprobs[0] >= full[0] - 1e-6).all() and (logprobs[0] > full[0] + 1e-3).any()  # renormalized

    dropped = (~top_k_top_p_mask(logits.detach(), top_k, top_p)[0]).nonzero()[0, 0]  # a token outside the set
    other = torch.cat([input_ids[:, :-C], dropped.view(1, 1), input_ids[:, -C + 1:]], dim=1)
    lp, ent = forward_logprobs(tiny_policy, other, attention_mask, C, T, top_p, top_k, with_entropy=True)
    row = logits[0].detach()
    in_set = top_k_top_p_mask(row[None], top_k, top_p)[0]
    in_set[dropped] = True
    assert lp[0, 0].item() == pytest.approx(float(row[dropped] - row[in_set].logsumexp(-1)), abs=1e-5)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_the_default_sampler_runs_no_truncation_and_gives_the_same_bits(tiny_policy, tokenizer, monkeypatch):
    """top-p 1 and top-k 0 (the defaults) never reach the truncation, and give bit for bit the log-probs
    and entropies of the plain log-softmax of logits / T, chunk by chunk as before."""
    import common.ops

    def never(*a):
        raise AssertionError("the truncation ran at the default sampler")

    ids = tokenizer("sort 52813:12358")["input_ids"]
    input_ids, attention_mask, _ = make_batch([ids[:11]], [ids[11:]], tokenizer.pad_token_id, "cpu")
    C, T = len(ids) - 11, 0.7
    with torch.no_grad():
        hidden, _ = completion_hidden_states(tiny_policy, input_ids, attention_mask, C)
        logits = output_layer(tiny_policy)(hidden).float().div_(T)
        log_z = torch.logsumexp(logits, dim=-1)
        before = logits.gather(-1, input_ids[0, -C:, None]).squeeze(-1) - log_z
        before_entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        monkeypatch.setattr(common.ops, "top_k_top_p_mask", never)
        logprobs, entropy = forward_logprobs(tiny_policy, input_ids, attention_mask, C, T, with_entropy=True)
        assert torch.equal(logprobs[0], before) and torch.equal(entropy[0], before_entropy)
        assert torch.equal(batched_logprobs(tiny_policy, input_ids, attention_mask, C, T, 4), logprobs)


def large_vocab_model(architecture: str, vocab_size: int = 50_000):
    """A random one-layer model with a large vocabulary and a small body: Qwen2 with an untied output
    layer, or Gemma 2 (tied) with its final-logit soft-capping at 3, which the logits of a
    0.5-initialized head exceed."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen2Config

    sizes = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, initializer_range=0.5)
    config = Qwen2Config(**sizes, tie_word_embeddings=False) if architecture == "qwen2" else \
        Gemma2Config(**sizes, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def unchunked_logprobs(model, input_ids, attention_mask, C: int, temperature: float):
    """The model's own [B, C, V] logits of the padded batch (its forward, soft-capping included), all at
    once: log-probs and entropies ([B, C], padding included)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -C - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, input_ids[:, -C:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def random_batch(vocab_size: int, num_prompts: int = 2, completions=(7, 3, 0, 5)):
    """Two prompts of different lengths, two completions each (one of them empty), random tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in (4, 2) for _ in range(2)]
    return make_batch(prompts, [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in completions],
                      0, "cpu")


@pytest.mark.parametrize("architecture", ["qwen2", "gemma2"])
def test_chunked_logprobs_entropy_and_gradient_equal_the_whole_logits(monkeypatch, architecture):
    """Log-probs computed 3 positions at a time from the last hidden states, each chunk checkpointed,
    equal those of the model's own logits all at once, with their entropies and the gradient of every
    weight: a 50k vocabulary, an untied head, or a tied one with soft-capping."""
    import common.ops

    model = large_vocab_model(architecture)
    monkeypatch.setattr(common.ops, "LOGITS_CHUNK", 3 * model.config.vocab_size, raising=False)
    input_ids, attention_mask, completion_mask = random_batch(model.config.vocab_size)
    C, T = completion_mask.shape[1], 0.7
    weights = torch.linspace(-1.0, 2.0, C) * completion_mask
    expected, expected_entropy = unchunked_logprobs(model, input_ids, attention_mask, C, T)
    expected_grad = torch.autograd.grad((expected * weights).sum(), list(model.parameters()))
    logprobs, entropy = forward_logprobs(model, input_ids, attention_mask, C, T, with_entropy=True)
    grad = torch.autograd.grad((logprobs * weights).sum(), list(model.parameters()))
    torch.testing.assert_close(logprobs, expected * completion_mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach() * completion_mask, atol=1e-5, rtol=1e-5)
    for got, want in zip(grad, expected_grad):  # sums over chunks, in another order: fp32 rounding
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-3)


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of tensor storage allocated inside the mode that were alive at once (storage made
    before it, e.g. the weights, is not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                self.live.add(storage.data_ptr())
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self.free, storage.data_ptr(), storage.nbytes())
        return out

    def free(self, ptr: int, nbytes: int):
        self.live.discard(ptr)
        self.now -= nbytes


def test_the_logits_peak_is_one_chunk_not_the_whole(monkeypatch):
    """Forward and backward of 320 completion positions of a 50k vocabulary: the whole fp32 logits are
    64 MB, and log-softmax's backward holds several such tensors; in chunks of 2^20 logits (4 MB, 20
    positions) less than one of them is ever alive."""
    import common.ops

    model = large_vocab_model("qwen2")
    V = model.config.vocab_size
    monkeypatch.setattr(common.ops, "LOGITS_CHUNK", 2**20, raising=False)
    input_ids, attention_mask, completion_mask = random_batch(V, completions=(80, 80, 80, 80))
    N = int(completion_mask.sum())
    with LiveBytes() as tracker:
        logprobs, entropy = forward_logprobs(model, input_ids, attention_mask, completion_mask.shape[1], 0.7,
                                             with_entropy=True)
        logprobs.sum().backward()
    assert N == 320 and tracker.peak < N * V * 4, tracker.peak


def test_position_shift_on_hand_made_sequence():
    """A fake model whose logits at position t put all mass on token (input_t + 1) % V:
    with the right shift every completion token of a counting sequence has log-prob ~0."""
    V = 10

    class Counter(torch.nn.Module):
        config = type("Config", (), {})()  # no soft-capping, no attention implementation: runs padded

        def get_output_embeddings(self):
            return torch.nn.Identity()  # the last hidden states are the logits

        def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0,
                    output_hidden_states=False, use_cache=False):
            hidden = torch.nn.functional.one_hot((input_ids + 1) % V, V).float() * 50.0
            return type("Out", (), {"hidden_states": (hidden,), "logits": hidden[:, -logits_to_keep:]})()

    input_ids = torch.tensor([[0, 3, 4, 5, 6, 7]])  # prompt [0, 3, 4], completion [5, 6, 7]
    logprobs = forward_logprobs(Counter(), input_ids, torch.ones_like(input_ids), 3)
    assert torch.allclose(logprobs, torch.zeros(1, 3), atol=1e-6)
    # an off-by-one (scoring token t with the logits at t) would give -50 everywhere
    wrong = torch.tensor([[0, 3, 4, 4, 4, 4]])
    assert (forward_logprobs(Counter(), wrong, torch.ones_like(wrong), 3)[0, 1:] < -40).all()


def packable_rollout(tokenizer):
    """Two groups with prompts and completions of different lengths and an empty completion:
    prompts and completions, token ids."""
    prompts = [tokenizer("sort 52813:")["input_ids"]] * 3 + [tokenizer("sort 91:")["input_ids"]] * 2
    completions = [tokenizer(s)["input_ids"] for s in ["12358", "1", "853", "19", ""]]
    return prompts, completions


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_row_gives_the_padded_batch_log_probs_and_gradient(tokenizer, monkeypatch, attention):
    """A micro-batch packed into one row (each prompt once, no padding, a mask that lets a
    completion see only its prompt and itself) gives the log-probs and gradient of the padded
    batch: two groups with prompts and completions of different lengths and an empty
    completion, their rows interleaved (as in a shuffled minibatch), under sdpa's boolean mask
    and eager attention's additive one."""
    import common.batch
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_MODEL

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=attention)
    prompts, completions = packable_rollout(tokenizer)
    interleaved = [0, 3, 1, 4, 2]  # groups A B A B A
    prompts, completions = [prompts[i] for i in interleaved], [completions[i] for i in interleaved]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    C = completion_mask.shape[1]
    weights = torch.linspace(-1.0, 2.0, C)
    batch_sizes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: batch_sizes.append(i[0].shape))
    results = []
    for packed in (True, False):
        monkeypatch.setattr(common.batch, "pays_to_pack", lambda *args: packed)
        logprobs = forward_logprobs(model, input_ids, attention_mask, C, 0.7)
        grad = torch.autograd.grad((logprobs * weights).sum(), [p for p in model.parameters()])
        results.append((logprobs, grad))
    hook.remove()
    packed_len = len(prompts[0]) + len(prompts[1]) + sum(len(c) - 1 for c in completions if c)
    assert batch_sizes == [(1, packed_len), input_ids.shape]  # one packed row, then the padded batch
    (packed_logprobs, packed_grad), (padded_logprobs, padded_grad) = results
    assert (packed_logprobs[completion_mask == 0] == 0).all() and (packed_logprobs[completion_mask == 1] < 0).all()
    torch.testing.assert_close(packed_logprobs * completion_mask, padded_logprobs * completion_mask,
                               atol=1e-5, rtol=1e-5)
    for got, want in zip(packed_grad, padded_grad):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


def test_packing_pays_for_short_rows_not_for_long_ones():
    """FLOPs per layer, ~ tokens x (1 + span / 6d): SmolLM2 (d = 576) with 2 groups of 4
    completions, 440 packed tokens against 8 padded rows of 95, packs (496 < 781); 16 rows of
    1,200 tokens of a d = 1536 model (17,000 packed) stay padded (48,360 > 21,700)."""
    from common.batch import pays_to_pack

    assert pays_to_pack(440, 8 * 95, 95, 576)
    assert not pays_to_pack(17_000, 16 * 1200, 1200, 1536)
    assert not pays_to_pack(100, 100, 100, 576)  # nothing to save: a row with no padding


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_micro_batch_whose_packed_mask_exceeds_the_memory_bound_runs_padded(tokenizer, monkeypatch, attention):
    """The packed row's L x L mask takes packed_mask_bytes (10^8 bytes at L = 10k under sdpa,
    4 x 10^8 as eager's floats); a micro-batch whose mask would take more than
    MAX_PACKED_MASK_BYTES runs padded, even where packing would pay."""
    import common.batch
    from transformers import AutoModelForCausalLM

    from common.batch import pack, packed_mask_bytes
    from tests.conftest import TINY_MODEL

    assert packed_mask_bytes(10_000, "sdpa") == 10**8 and packed_mask_bytes(10_000, "eager") == 4 * 10**8
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=attention)
    prompts, completions = packable_rollout(tokenizer)
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    C = completion_mask.shape[1]
    monkeypatch.setattr(common.batch, "pays_to_pack", lambda *args: True)
    ids, _, mask, _ = pack(model, input_ids, attention_mask, C)
    L = ids.shape[1]
    assert mask.nbytes == packed_mask_bytes(L, attention)

    def packs(bound):
        monkeypatch.setattr(common.batch, "MAX_PACKED_MASK_BYTES", bound)
        return pack(model, input_ids, attention_mask, C) is not None

    assert packs(packed_mask_bytes(L, attention)) and not packs(packed_mask_bytes(L, attention) - 1)
    batch_shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: batch_shapes.append(i[0].shape))
    with torch.no_grad():
        forward_logprobs(model, input_ids, attention_mask, C)
    hook.remove()
    assert batch_shapes == [input_ids.shape]  # the padded batch


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_packed_row_is_made_on_the_inputs_device(tokenizer, attention):
    """pack makes every tensor on input_ids' device, the L x L mask included (none made on the
    CPU and copied per pass): with the default device elsewhere ("meta"), a tensor made without
    naming the device would land there and the packed row of CPU inputs would not be on the CPU
    (or the copy back would fail)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from common.batch import pack
    from tests.conftest import TINY_MODEL

    model = SimpleNamespace(config=AutoConfig.from_pretrained(TINY_MODEL, attn_implementation=attention))
    prompts, completions = packable_rollout(tokenizer)
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    C = completion_mask.shape[1]
    expected = pack(model, input_ids, attention_mask, C)
    with torch.device("meta"):
        packed = pack(model, input_ids, attention_mask, C)
    for got, want in zip(packed, expected, strict=True):
        assert got.device == input_ids.device
        assert torch.equal(got, want)


def sliding_window_model(architecture: str, attention: str, window: int | None):
    """A random two-layer model whose attention slides over `window` tokens: Qwen2 with
    use_sliding_window (the first layer full, max_window_layers = 1, the second sliding) or
    Mistral (every layer sliding)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, initializer_range=0.2)
    if architecture == "qwen2":
        config = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    else:
        config = MistralConfig(**sizes, sliding_window=window)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_packing_keeps_the_sliding_window(monkeypatch, architecture, attention):
    """transformers applies no sliding window to a custom 4-D mask, so a packed row would let a
    token see further back than the window. A micro-batch with a row (prompt + completion) longer
    than the window runs padded; one whose rows all fit the window still packs, into a row longer
    than the window. Either way each completion gets the log-probs of its sequence run alone."""
    import common.batch
    from common.batch import pack

    window = 4
    model = sliding_window_model(architecture, attention, window)
    monkeypatch.setattr(common.batch, "pays_to_pack", lambda *args: True)
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(2, 64, (n,), generator=g).tolist()

    def group(prompt_len, completion_lens):
        prompt = tokens(prompt_len)
        return [prompt] * len(completion_lens), [tokens(n) for n in completion_lens]

    long_rows = [group(3, [4, 1, 6]), group(5, [2, 7])]  # rows of up to 12 tokens
    short_rows = [group(2, [2, 2, 1]), group(3, [1, 1])]  # rows of up to 4 tokens: the window
    for groups, packs in ((long_rows, False), (short_rows, True)):
        prompts, completions = [sum(lists, []) for lists in zip(*groups)]
        input_ids, attention_mask, completion_mask = make_batch(prompts, completions, 0, "cpu")
        C = completion_mask.shape[1]
        with torch.no_grad():
            logprobs = forward_logprobs(model, input_ids, attention_mask, C)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            torch.testing.assert_close(logprobs[row, :len(c)], reference_logprobs(model, p + c, len(c), 1.0),
                                       atol=1e-5, rtol=1e-5)
        packed = pack(model, input_ids, attention_mask, C)
        assert (packed is not None) == packs
        if packs:
            assert packed[0].shape[1] > window
    # the window matters to the long rows: the same weights attending to everything score them otherwise
    full = sliding_window_model(architecture, attention, window=None)
    p, c = long_rows[1][0][1], long_rows[1][1][1]  # 12 tokens
    windowed, unwindowed = (reference_logprobs(m, p + c, len(c), 1.0) for m in (model, full))
    assert not torch.allclose(windowed, unwindowed, atol=1e-3)


def test_attention_window_of_transformers_configs():
    """attention_window reads the smallest window or chunk of a model's layers from its config,
    None where every layer sees the whole row."""
    from transformers import (AutoConfig, Gemma2Config, Gemma3Config, Llama4Config, LlamaConfig, MistralConfig,
                              Qwen2Config)

    from common.batch import attention_window
    from tests.conftest import TINY_MODEL

    assert attention_window(AutoConfig.from_pretrained(TINY_MODEL)) is None
    for architecture in ("qwen2", "mistral"):
        assert attention_window(sliding_window_model(architecture, "sdpa", 4).config) == 4
    assert attention_window(LlamaConfig()) is None
    assert attention_window(Qwen2Config(sliding_window=64)) is None  # use_sliding_window is off
    # on, but only from layer max_window_layers on: none of 4 layers, or the last 2
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=64, num_hidden_layers=4)) is None
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=64, num_hidden_layers=4,
                                        max_window_layers=2)) == 64
    assert attention_window(MistralConfig(sliding_window=4096)) == 4096  # no layer_types: every layer
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(Gemma2Config(sliding_window=4096)) == 4096  # every other layer
    assert attention_window(Gemma3Config(text_config={"sliding_window": 512})) == 512  # its text model's
    assert attention_window(Llama4Config(text_config={"attention_chunk_size": 2048})) == 2048  # chunked layers


def test_batched_logprobs_equal_single_pass(tiny_policy, tokenizer):
    prompts = [tokenizer(f"sort {d}:")["input_ids"] for d in ["123", "98765", "4", "55555555"]]
    completions = [tokenizer(s)["input_ids"] for s in ["123", "5678", "4", "5"]]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        full = forward_logprobs(tiny_policy, input_ids, attention_mask, completion_mask.shape[1])
    chunked = batched_logprobs(tiny_policy, input_ids, attention_mask, completion_mask.shape[1], 1.0, 3)
    torch.testing.assert_close(chunked * completion_mask, full * completion_mask, atol=1e-5, rtol=1e-5)


def test_completions_of_one_prompt_share_its_forward(tiny_policy, tokenizer):
    """Two groups of three completions (prompts of different lengths, completions of
    different lengths): micro_batches keeps each group in one micro-batch, which runs packed
    (the prompt once, no padding), and the log-probs and their gradient are those of every
    row on its own."""
    from common.batch import micro_batches

    prompts = [tokenizer("sort 52813:")["input_ids"]] * 3 + [tokenizer("sort 91:")["input_ids"]] * 3
    completions = [tokenizer(s)["input_ids"] for s in ["12358", "1", "853", "19", "91", "1999"]]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    B, C = completion_mask.shape
    params = [p for p in tiny_policy.parameters() if p.requires_grad]
    expected = [reference_logprobs(tiny_policy, p + c, len(c), 1.0) for p, c in zip(prompts, completions)]

    def row_alone(i):  # one unpadded row: nothing to share
        ids = torch.tensor([prompts[i] + completions[i]])
        return forward_logprobs(tiny_policy, ids, torch.ones_like(ids), len(completions[i]))[0]
    expected_grad = torch.autograd.grad(sum((i + 1.0) * row_alone(i).sum() for i in range(B)), params)

    tokens_in = []
    hook = tiny_policy.get_input_embeddings().register_forward_hook(lambda m, i, o: tokens_in.append(i[0].numel()))
    micro = list(micro_batches(torch.randperm(B, generator=torch.Generator().manual_seed(1)), input_ids,
                               attention_mask, C, 3))
    assert sorted(sorted(m.tolist()) for m, _, _ in micro) == [[0, 1, 2], [3, 4, 5]]  # whole groups
    loss = 0.0
    for rows, cols, c in micro:
        logprobs = forward_logprobs(tiny_policy, input_ids[rows, cols], attention_mask[rows, cols], c)
        for row, lp in zip(rows.tolist(), logprobs):
            torch.testing.assert_close(lp[:len(completions[row])], expected[row], atol=1e-5, rtol=1e-5)
        loss = loss + ((rows.unsqueeze(1) + 1.0) * logprobs * completion_mask[rows, :c]).sum()
    hook.remove()
    # one packed row per micro-batch, no padding: its prompt once, then each completion but its last token
    packed = [len(prompts[i]) + sum(len(c) - 1 for c in completions[i:i + 3]) for i in (0, 3)]
    assert sorted(tokens_in) == sorted(packed) and packed[0] < 3 * (len(prompts[0]) + 5)
    for got, want in zip(torch.autograd.grad(loss, params), expected_grad):
        # fp32 rounding: the shared prompt sums three rows' gradients in another order (~2e-6 of the largest)
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 10 + 20) / 5),                  # 7.2
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (10 + 20) / 2) / 2),  # 8.5
    ("seq-mean-token-sum", ((1 + 2 + 3) + (10 + 20)) / 2),       # 18
    ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + (10 + 20) / 4) / 2),  # 4.5 with max_tokens = 4
])
def test_aggregation_modes_hand_computed(mode, expected):
    assert aggregate(VALUES, MASK, mode, max_tokens=4).item() == pytest.approx(expected)


def test_aggregation_of_fully_masked_batch_is_zero_not_nan():
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        out = aggregate(VALUES, torch.zeros_like(MASK), mode, max_tokens=4)
        assert out.item() == 0.0


def test_unknown_aggregation_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(VALUES, MASK, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batched_gradient_equals_full_batch_gradient(mode):
    """Accumulating micro-batch losses normalized by minibatch totals == one big batch."""
    torch.manual_seed(0)
    B, C = 6, 5
    weight = torch.randn(C, requires_grad=True)
    x = torch.randn(B, C)
    mask = (torch.rand(B, C) > 0.3).long()
    mask[0] = 0  # include a fully masked sequence

    def per_token(rows):
        return (x[rows] * weight) ** 2

    full = aggregate(per_token(slice(None)), mask, mode, max_tokens=C)
    (g_full,) = torch.autograd.grad(full, weight)
    num_tokens, num_seqs = mask.sum(), B
    g_acc = torch.zeros_like(weight)
    for rows in [slice(0, 2), slice(2, 5), slice(5, 6)]:  # uneven micro-batches
        loss = aggregate(per_token(rows), mask[rows], mode, num_tokens, num_seqs, max_tokens=C)
        g_acc += torch.autograd.grad(loss, weight)[0]
    torch.testing.assert_close(g_acc, g_full)
    # normalizing by the micro-batch's own counts instead gives a different gradient
    g_naive = sum(torch.autograd.grad(aggregate(per_token(r), mask[r], mode, max_tokens=C), weight)[0]
                  for r in [slice(0, 2), slice(2, 5), slice(5, 6)])
    assert not torch.allclose(g_naive, g_full)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_cut_micro_batches_of_similar_length_give_the_full_batch_gradient(tiny_policy, tokenizer, mode):
    """micro_batches sorts rows by length and cuts each micro-batch to its own longest prompt and
    completion: every real token is kept, padding is skipped, and the accumulated gradient is
    that of one pass over the whole padded batch."""
    from common.batch import micro_batches

    digits = ["1", "98765432", "44", "123", "5550", "9", "31415926", "27"]
    prompts = [tokenizer(f"sort {d}:")["input_ids"] for d in digits]
    completions = [tokenizer("".join(sorted(d)))["input_ids"] + [tokenizer.eos_token_id] for d in digits]
    input_ids, attention_mask, completion_mask = make_batch(prompts, completions, tokenizer.pad_token_id, "cpu")
    B, C = completion_mask.shape
    advantages = torch.linspace(-1.0, 1.5, B).unsqueeze(1)
    params = [p for p in tiny_policy.parameters() if p.requires_grad]

    full = aggregate(-advantages * forward_logprobs(tiny_policy, input_ids, attention_mask, C), completion_mask,
                     mode, max_tokens=C)
    g_full = torch.autograd.grad(full, params)

    g_acc, seen, widths = [torch.zeros_like(p) for p in params], [], []
    for micro, cols, c in micro_batches(torch.arange(B), input_ids, attention_mask, C, 3):
        assert attention_mask[micro, cols].sum() == attention_mask[micro].sum()  # no real token cut off
        seen += micro.tolist()
        widths.append(cols.stop - cols.start)
        logprobs = forward_logprobs(tiny_policy, input_ids[micro, cols], attention_mask[micro, cols], c)
        loss = aggregate(-advantages[micro] * logprobs, completion_mask[micro, :c], mode, completion_mask.sum(), B,
                         max_tokens=C)
        for acc, g in zip(g_acc, torch.autograd.grad(loss, params)):
            acc += g
    assert sorted(seen) == list(range(B))
    assert sum(widths) < 3 * input_ids.shape[1]  # padding was skipped
    for acc, g in zip(g_acc, g_full):
        torch.testing.assert_close(acc, g, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# --rollout-correction (common/ops.py rollout_correction) and --kl-estimator (kl_loss)
# ---------------------------------------------------------------------------------------

# two sequences, the first with one padding token: log rho = [0.5, -1, 0] and [0.1, -0.2, 0.2, 0]
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.2, -0.8, -1.0]])
ENGINE = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-1.1, -1.0, -1.0, -1.0]])
SAMPLED = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
E = math.exp


@pytest.mark.parametrize("mode,thresholds,expected", [
    ("off", {}, [[1, 1, 1, 1], [1, 1, 1, 1]]),
    ("token-truncate", {"cap": 1.2}, [[1.2, E(-1), 1, 1], [E(0.1), E(-0.2), 1.2, 1]]),
    ("token-mask", {}, [[E(0.5), 0, 1, 1], [E(0.1), E(-0.2), E(0.2), 1]]),          # [0.5, 5]
    ("token-mask", {"low": 0.9, "high": 1.2}, [[0, 0, 1, 1], [E(0.1), 0, 0, 1]]),
    ("sequence-truncate", {"cap": 1.05}, [[E(-0.5)] * 3 + [1], [1.05] * 4]),
    ("sequence-mask", {}, [[E(-0.5)] * 3 + [1], [E(0.1)] * 4]),                     # [0.5, 2]
    ("sequence-mask", {"low": 0.7}, [[0, 0, 0, 1], [E(0.1)] * 4]),
    ("geometric-mask", {}, [[0, 0, 0, 1], [0, 0, 0, 0]]),            # exp(-1/6), exp(0.025) outside [0.99, 1.01]
    ("geometric-mask", {"high": 1.03}, [[0, 0, 0, 1], [1, 1, 1, 1]]),
])
def test_each_rollout_correction_gives_its_hand_computed_weights(mode, thresholds, expected):
    """Padding (mask 0) keeps weight 1 in every mode: a geometric mean of the weights (gspo.py) takes no log(0)."""
    from common.ops import RolloutCorrection, rollout_correction

    weights = rollout_correction(OLD, ENGINE, SAMPLED, RolloutCorrection.of(mode, **thresholds))
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float32))


def test_each_modes_default_thresholds_are_the_peers():
    from common.ops import RolloutCorrection

    assert RolloutCorrection.of("token-truncate") == RolloutCorrection("token-truncate", cap=2.0)
    assert RolloutCorrection.of("sequence-truncate") == RolloutCorrection("sequence-truncate", cap=2.0)
    assert RolloutCorrection.of("token-mask") == RolloutCorrection("token-mask", low=0.5, high=5.0)  # IcePop
    assert RolloutCorrection.of("sequence-mask") == RolloutCorrection("sequence-mask", low=0.5, high=2.0)  # Seq-MIS
    assert RolloutCorrection.of("geometric-mask") == RolloutCorrection("geometric-mask", low=0.99, high=1.01)
    assert RolloutCorrection.of("off") == RolloutCorrection("off")


@pytest.mark.parametrize("mode,long_weight,zero_weight", [
    ("token-truncate", E(0.05), E(-20)),   # rho 0: its log clamped to -20
    ("token-mask", E(0.05), 0.0),
    ("sequence-truncate", 2.0, E(-20)),    # prod_t rho_t = e^200: clamped to e^20, then capped at 2
    ("sequence-mask", 0.0, 0.0),
    ("geometric-mask", 0.0, 1.0),          # e^0.05 > 1.01; rho 0's log clamped to -20 moves the mean of
])                                         # 4,000 only to e^-0.005, inside [0.99, 1.01] (verl's clamp alike)
def test_a_long_sequence_and_a_zero_ratio_give_finite_weights(mode, long_weight, zero_weight):
    """A 4,000-token sequence whose product of ratios overflows float32 (e^200), and sequences with one
    token of rho 0 (old log-prob -inf, or -1e4, the engine's finite): every weight finite, as derived."""
    from common.ops import RolloutCorrection, rollout_correction

    T = 4000
    engine = torch.full((3, T), -1.0)
    old = engine + 0.05
    old[1:] = engine[1:]
    old[1, 7], old[2, 7] = -float("inf"), -1e4
    assert torch.isinf(torch.exp((old[0] - engine[0]).sum()))  # the naive product overflows
    w = rollout_correction(old, engine, torch.ones(3, T), RolloutCorrection.of(mode))
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[0], torch.full((T,), long_weight))
    for row in (1, 2):
        if mode.startswith("token"):
            assert w[row, 7].item() == pytest.approx(zero_weight) and (w[row, :7] == 1).all()
        else:  # the whole sequence: its sum of log-ratios is -20 (clamped) + 0
            torch.testing.assert_close(w[row], torch.full((T,), zero_weight))


def test_the_default_correction_is_todays_bit_for_bit():
    """--rollout-correction auto: in fp32 every weight exactly 1; in bf16 exactly min(rho_t, 2), the
    truncated importance weights the scripts used before the menu."""
    import argparse

    from common.ops import rollout_correction
    from common.setup import Precision

    g = torch.Generator().manual_seed(0)
    old, engine = -torch.rand(8, 16, generator=g) * 3, -torch.rand(8, 16, generator=g) * 3
    mask = torch.ones(8, 16)
    mask[3, 9:] = 0
    old[3, 9:] = engine[3, 9:] = 0.0  # padding, as the batch has it
    flags = dict(rollout_correction="auto", rollout_correction_cap=None, rollout_correction_low=None,
                 rollout_correction_high=None, dtype="float32")
    fp32 = Precision.of(argparse.Namespace(precision="fp32", **flags), "cpu").rollout_correction
    bf16 = Precision.of(argparse.Namespace(precision="bf16", **flags), "cpu").rollout_correction
    assert torch.equal(rollout_correction(old, engine, mask, fp32), torch.ones(8, 16))
    assert torch.equal(rollout_correction(old, engine, mask, bf16), torch.exp(old - engine).clamp(max=2.0))


def grpo_family() -> list[str]:
    """The scripts whose loss has a KL term to a reference (GRPO's family): their update takes ref_logprobs."""
    from common.scripts import algorithm_scripts, update_inputs

    return [s for s in algorithm_scripts() if "ref_logprobs" in update_inputs(s)]


def family_args(module, **flags):
    """The script's Args, token-mean aggregation where it has the choice."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(module.Args)}
    return module.Args(**{k: v for k, v in {"loss_agg": "token-mean", **flags}.items() if k in names})


@pytest.mark.parametrize("script", grpo_family())
def test_masked_tokens_get_exactly_zero_gradient_through_compute_loss(script):
    """token-mask's weight 0 takes a token out of the policy gradient exactly (in GSPO and GMPO, through the
    sequence's geometric mean, its sequence), with no NaN from padding, and the loss's normalizer keeps it."""
    from common.ops import RolloutCorrection, rollout_correction
    from common.scripts import load_script

    module = load_script(script)
    weights = rollout_correction(OLD, ENGINE, SAMPLED, RolloutCorrection.of("token-mask", low=0.9, high=1.2))
    masked = (weights == 0) & SAMPLED.bool()
    assert masked.tolist() == [[True, True, False, False], [False, True, True, False]]
    logprobs = torch.tensor([[-0.9, -1.3, -0.7, 0.0], [-0.4, -0.6, -1.1, -0.8]], requires_grad=True)
    args = family_args(module, kl_coef=0.0)
    loss, _ = module.compute_loss(logprobs, logprobs.detach() + 0.01, None, torch.tensor([1.0, -0.5]), weights,
                                  SAMPLED, args, SAMPLED.sum(), 2)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[masked] == 0).all()
    for i in range(2):  # the kept tokens learn, or (a sequence weighted by its tokens' geometric mean, as in
        kept = SAMPLED[i].bool() & ~masked[i]  # GSPO and GMPO) the sequence with a 0 leaves whole
        assert (logprobs.grad[i, kept] != 0).all() or (logprobs.grad[i] == 0).all(), (script, i, logprobs.grad)
    if script == "grpo.py":  # token-mean: the kept tokens' terms over all 7 sampled tokens, masked ones counted
        ratio = math.exp(-0.01)
        kept = [(0, 2, 1.0), (1, 0, -0.5), (1, 3, -0.5)]  # (sequence, token, advantage)
        assert loss.item() == pytest.approx(sum(-ratio * a * weights[i, t].item() for i, t, a in kept) / 7)


@pytest.mark.parametrize("script", grpo_family())
def test_k2_is_gradient_is_the_exact_kl_gradient_and_k3s_is_not(script):
    """A categorical policy pi = softmax(logits) over 5 categories, pi_old and pi_ref other ones: the exact
    expectation over y ~ pi_old of the gradient of the script's own compute_loss KL term at y (advantage 0,
    beta 1) against the closed form of grad_logits KL(pi || pi_ref) = pi * (log pi/pi_ref - KL)."""
    from common.scripts import load_script

    module = load_script(script)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_()
    old_logp = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)
    ref_logp = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        pi = logp.exp()
        kl_grad = pi * (logp - ref_logp - (pi * (logp - ref_logp)).sum())

    def expected_gradient(estimator: str) -> torch.Tensor:
        args = family_args(module, kl_coef=1.0, kl_estimator=estimator)
        total = torch.zeros(5, dtype=torch.float64)
        for y in range(5):  # one completion of one token: y
            logprobs = torch.log_softmax(logits, -1)[y].view(1, 1)
            loss, _ = module.compute_loss(logprobs, old_logp[y].view(1, 1), ref_logp[y].view(1, 1),
                                          torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                                          torch.ones(1, 1), args, 1, 1)
            total += old_logp[y].exp() * torch.autograd.grad(loss, logits)[0]
        return total

    torch.testing.assert_close(expected_gradient("k2-is"), kl_grad, rtol=1e-10, atol=1e-12)
    assert (expected_gradient("k3") - kl_grad).abs().max() > 1e-2


def test_rollout_metrics_on_a_crafted_batch():
    """The raw ratios (per token over the 7 sampled tokens, per sequence), the weights' mean, and the
    fractions truncated and masked, of the tokens and of the sequences."""
    from common.metrics import rollout_metrics
    from common.ops import RolloutCorrection

    rho = [E(0.5), E(-1), 1, E(0.1), E(-0.2), E(0.2), 1]
    m = {k: float(v) for k, v in rollout_metrics(OLD, ENGINE, SAMPLED,
                                                 RolloutCorrection.of("token-truncate", cap=1.2)).items()}
    expected = {"rollout/is_ratio_mean": sum(rho) / 7, "rollout/is_ratio_min": E(-1), "rollout/is_ratio_max": E(0.5),
                "rollout/is_seq_ratio_mean": (E(-0.5) + E(0.1)) / 2, "rollout/is_seq_ratio_min": E(-0.5),
                "rollout/is_seq_ratio_max": E(0.1),
                "rollout/is_weight_mean": (1.2 + E(-1) + 1 + E(0.1) + E(-0.2) + 1.2 + 1) / 7,
                "rollout/is_truncated_frac": 2 / 7, "rollout/is_seq_truncated_frac": 1.0,  # e^0.5, e^0.2 > 1.2
                "rollout/is_masked_frac": 0.0, "rollout/is_seq_masked_frac": 0.0}
    assert m == pytest.approx(expected)
    masked = rollout_metrics(OLD, ENGINE, SAMPLED, RolloutCorrection.of("sequence-mask", low=0.7))
    assert float(masked["rollout/is_masked_frac"]) == pytest.approx(3 / 7)  # the first sequence's 3 tokens
    assert float(masked["rollout/is_seq_masked_frac"]) == 0.5
    assert float(masked["rollout/is_truncated_frac"]) == 0.0


def test_extremes_over_ranks_reduce_by_min_and_max(monkeypatch):
    """Under torchrun a step's *_min is the whole batch's min, its *_max the max; a mean stays the average."""
    from common import dist

    ranks = [{"rollout/is_ratio_min": 0.5, "rollout/is_ratio_max": 1.5, "rollout/is_ratio_mean": 1.0},
             {"rollout/is_ratio_min": 0.8, "rollout/is_ratio_max": 3.0, "rollout/is_ratio_mean": 2.0}]
    keys = sorted(ranks[0])
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_sum", lambda x: sum(torch.tensor([r[k] for k in keys], dtype=torch.float64)
                                                        for r in ranks))
    signs = {k: -1.0 if k.endswith("_min") else 1.0 for k in keys}
    extremes = [k for k in keys if not k.endswith("_mean")]
    monkeypatch.setattr(dist, "all_max", lambda x: torch.stack(
        [torch.tensor([signs[k] * r[k] for k in extremes], dtype=torch.float64) for r in ranks]).max(0).values)
    assert dist.mean_over_ranks(ranks[0]) == {"rollout/is_ratio_min": 0.5, "rollout/is_ratio_max": 3.0,
                                              "rollout/is_ratio_mean": 1.5}


def test_vllm_is_cap_is_refused_naming_its_replacement_and_an_old_run_resumes():
    from common.args import parse_args, upgrade_saved_args
    from common.errors import ConfigError
    import grpo

    with pytest.raises(ConfigError, match=r"^--vllm-is-cap is replaced by --rollout-correction token-truncate "
                                          r"--rollout-correction-cap C"):
        parse_args(grpo.Args, ["--vllm-is-cap", "3"])
    assert upgrade_saved_args({"seed": 1, "vllm_is_cap": 3.0}) == {
        "seed": 1, "rollout_correction": "token-truncate", "rollout_correction_cap": 3.0}
    assert upgrade_saved_args({"vllm_is_cap": None}) == {"rollout_correction": "auto", "rollout_correction_cap": None}
    assert upgrade_saved_args({"vllm_is_cap": 0.0}) == {"rollout_correction": "off", "rollout_correction_cap": None}
    grpo.Args(**upgrade_saved_args({"vllm_is_cap": 3.0}))  # what saved_args builds from an old run.json
