"""Numerics that differ between the CPU in fp32 and a GPU in bf16: the truncated importance
weights that correct for vLLM's own numerics (every script), dropout switched off at load,
and the bf16 path (engine in bf16, trainer under bf16 autocast) run on the CPU."""

import inspect
import json
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ppo
from common.batch import draw_minibatches
from common.metrics import update_metrics
from common.ops import RolloutCorrection
from common.scripts import algorithm_scripts, load_script, update_inputs
from common.setup import Precision
from tests.conftest import TINY_MODEL

LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
SCRIPTS = algorithm_scripts()


def sequence_advantages(script: str) -> bool:
    """A script whose loss holds the KL (takes ref_logprobs) has one advantage per completion, [B]
    (GRPO's family); the others (KL in the reward: REINFORCE, RLOO, PPO) have one per token, [B, C]."""
    return "ref_logprobs" in update_inputs(script)


def policy_gradient(script, weights):
    """d loss / d logprobs of one micro-batch at ratio 1 (old = current), without a KL term. The
    script's compute_loss is called by its parameters' names (the scripts share them), so any loss
    shape is found: advantages [B] where the loss holds the KL (GRPO's family), else [B, C]."""
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    A = torch.tensor([0.5, -1.5])
    module = load_script(script)
    args = module.Args(kl_coef=0.0, loss_agg="token-mean", **({"vf_coef": 0.0} if hasattr(module.Args, "vf_coef")
                                                              else {}))
    zeros = torch.zeros_like(logprobs)
    available = {"logprobs": logprobs, "old_logprobs": logprobs.detach(), "ref_logprobs": None,
                 "advantages": A if sequence_advantages(script) else A.unsqueeze(1) * MASK,
                 "values": zeros, "old_values": zeros, "returns": zeros, "vllm_is_weights": weights, "mask": MASK,
                 "args": args, "num_tokens": MASK.sum(), "num_seqs": 2}
    loss, _ = module.compute_loss(**{k: available[k] for k in inspect.signature(module.compute_loss).parameters})
    return torch.autograd.grad(loss, logprobs)[0]


def test_truncated_importance_weight_by_hand():
    """GRPO at ratio 1, token-mean over 5 tokens: loss = -sum_t w_t A_i / 5."""
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 2.0, 9.0]])  # the last one is padding
    grad = policy_gradient("grpo.py", w)
    expected = -torch.tensor([[2.0 * 0.5, 0.5 * 0.5, 1.0 * 0.5], [1.0 * -1.5, 2.0 * -1.5, 0.0]]) / 5
    assert torch.allclose(grad, expected)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_weights_its_policy_gradient(script):
    """Each token's gradient is scaled by its own weight w_t, or (a loss per sequence: GSPO, GMPO) every
    token's by its sequence's geometric mean of them; found from the gradient, not from the script's name."""
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 1.7, 1.0]])
    unweighted = policy_gradient(script, torch.ones_like(w))
    weighted = policy_gradient(script, w)
    assert unweighted.abs().sum() > 0
    seq_weight = torch.exp((w.log() * MASK).sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True))
    assert torch.allclose(weighted, w * unweighted) or torch.allclose(weighted, seq_weight * unweighted), (
        f"{script}: the weights scale the gradient neither per token nor per sequence")


def test_gspo_weights_a_sequence_by_the_geometric_mean_of_its_token_weights():
    w = torch.tensor([[2.0, 0.5, 4.0], [3.0, 3.0, 100.0]])  # padding's weight must not count
    seq_weight = torch.tensor([[(2.0 * 0.5 * 4.0) ** (1 / 3)], [3.0]])
    assert torch.allclose(policy_gradient("gspo.py", w), seq_weight * policy_gradient("gspo.py", torch.ones_like(w)))


def test_dropout_is_off_whatever_the_config_says(tmp_path, tokenizer):
    """A GPT-2 with every dropout at 0.5 (embeddings, attention, residuals): two passes of the
    loaded policy in train mode, and of ppo's critic, give identical outputs."""
    from common.models import load_policy
    from common.batch import make_batch
    from common.ops import forward_logprobs

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, summary_first_dropout=0.5)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["attn_pdrop"] == 0.5
    ids = tokenizer("sort 3141:1134")["input_ids"]
    input_ids, attention_mask, _ = make_batch([ids[:8]], [ids[8:]], tokenizer.pad_token_id, "cpu")

    policy = load_policy(str(tmp_path / "gpt2"), tokenizer, "float32", "cpu").train()
    with torch.no_grad():
        first, second = (forward_logprobs(policy, input_ids, attention_mask, len(ids) - 8) for _ in range(2))
    assert torch.equal(first, second)

    critic = ppo.load_critic(str(tmp_path / "gpt2"), tokenizer, "float32", "cpu").train()
    with torch.no_grad():
        values = [ppo.forward_values(critic, input_ids, attention_mask, len(ids) - 8) for _ in range(2)]
    assert torch.equal(*values)

    # the check has teeth: the same model loaded plainly does drop out
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").train()
    with torch.no_grad():
        assert not torch.equal(plain(input_ids).logits, plain(input_ids).logits)


@pytest.mark.slow
def test_bf16_path_learns_on_the_cpu_with_a_bf16_sized_mismatch(tmp_path):
    """--precision bf16 on the CPU: vLLM in bfloat16, the trainer under bfloat16 autocast
    (fp32 weights), truncated importance sampling (--rollout-correction auto) on by default: what a GPU runs, as close as
    this machine gets. It learns, and vLLM's log-probs differ from the trainer's by a bf16
    amount (fp32: ~1e-6), which the importance weights then carry."""
    from tests.test_grpo_e2e import read_metrics, run_script

    out = tmp_path / "run"
    r = run_script("grpo.py", "--precision", "bf16", "--steps", "4", "--eval-every", "4", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out)
    mismatch = [m["rollout/logprob_mismatch"] for m in metrics[1:]]
    assert all(1e-4 < x < 0.1 for x in mismatch), mismatch
    assert all(m["rollout/is_weight_mean"] != 1.0 for m in metrics[1:])  # TIS is on: weights differ from 1
    assert metrics[-1]["eval/accuracy"] >= metrics[0]["eval/accuracy"] + 0.3, (metrics[0], metrics[-1])


class GradientRecorder:
    """An optimizer that keeps the gradient each of its steps sees and changes no weight."""

    def __init__(self, params):
        self.params, self.grads = list(params), []

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.params if p.grad is not None]))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def rollout_batch(tokenizer_len: int = 20):
    """Six completions (3 prompts x 2) of different lengths, as make_batch lays them out."""
    from common.batch import make_batch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, tokenizer_len, (n,), generator=g).tolist() for n in (3, 5, 4, 6, 2, 5)]
    completions = [torch.randint(3, tokenizer_len, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 5, 2)]
    return make_batch(prompts, completions, 0, "cpu"), g


def call_update(script, policy, critic, batch: dict, optimizer, scheduler, **flags) -> dict:
    """The script's own update on one rollout batch, as its loop calls it (no clipping: max_grad_norm
    1e9, unless flags say); returns its statistics."""
    module = load_script(script)
    args = module.Args(**{"kl_coef": 0.0, "loss_agg": "token-mean", "max_grad_norm": 1e9, **flags})
    available = {"policy": policy, "optimizer": optimizer, "scheduler": scheduler, "args": args,
                 "precision": Precision(None, "float32", "float32", RolloutCorrection.of("token-truncate")), **batch}
    if critic is not None:
        available["critic"] = critic
    torch.manual_seed(0)  # the minibatch permutation
    available["minibatches"] = draw_minibatches(batch["input_ids"].shape[0], getattr(args, "num_epochs", 1),
                                                getattr(args, "num_minibatches", 1), "cpu")
    stats, _ = module.update(**{k: available[k] for k in inspect.signature(module.update).parameters})
    return stats


def run_update(script, policy, critic, batch: dict, micro_batch_size: int, **flags):
    """call_update with a recorder for an optimizer: returns the losses as the step logs them
    ({"loss/total": ..., ...}) and the gradients the optimizer steps saw."""
    optimizer = GradientRecorder(policy.parameters())
    stats = call_update(script, policy, critic, batch, optimizer, types.SimpleNamespace(step=lambda: None),
                        micro_batch_size=micro_batch_size, **flags)
    return {k: float(v) for k, v in update_metrics(stats).items() if k.startswith("loss/")}, optimizer.grads


def update_batch(script, policy, tokenizer):
    """One rollout batch (rollout_batch) as the script's update takes it, old log-probs from policy's
    own pass, and PPO's critic (else None)."""
    from common.ops import batched_logprobs

    (input_ids, attention_mask, mask), g = rollout_batch()
    B, C = mask.shape
    old_logprobs = batched_logprobs(policy, input_ids, attention_mask, C, 1.0, 4)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, completion_mask=mask, loss_mask=mask,
                 old_logprobs=old_logprobs, ref_logprobs=None,
                 vllm_logprobs=old_logprobs + 0.3 * torch.randn(B, C, generator=g),  # some weights capped at 2
                 advantages=torch.randn(B, generator=g))
    if not sequence_advantages(script):
        batch["advantages"] = batch["advantages"].unsqueeze(1) * mask
        batch["old_values"], batch["returns"] = 0.1 * torch.randn(B, C, generator=g), torch.randn(B, C, generator=g)
    else:  # GRPO's family: a reference, for the KL term of the loss (with --kl-coef > 0)
        batch["ref_logprobs"] = old_logprobs - 0.1 * torch.rand(B, C, generator=g)
    critic = ppo.load_critic(TINY_MODEL, tokenizer, "float32", "cpu") if "old_values" in update_inputs(script) \
        else None
    return batch, critic


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_update_gives_one_gradient_whatever_the_micro_batches(script, tiny_policy, tokenizer):
    """Each script's own update (step 5): micro-batches of 2 rows and one micro-batch of the whole
    batch give the same gradients (normalizers over the minibatch) and the same logged losses (each
    "loss/..." the minibatch's, not a micro-batch's share), to fp32 rounding; where the update can
    take old log-probs from its own forward (one optimizer step on the batch), doing so gives them too."""
    batch, critic = update_batch(script, tiny_policy, tokenizer)
    B = batch["loss_mask"].shape[0]
    one_step = {"num_minibatches": 1} if hasattr(load_script(script).Args, "num_minibatches") else {}
    one_step.update({"kl_coef": 0.04} if sequence_advantages(script) else {})  # GRPO's family logs loss/kl
    losses, grads = run_update(script, tiny_policy, critic, batch, B, **one_step)
    assert len(grads) == 1 and grads[0].abs().sum() > 0
    micro_losses, micro_grads = run_update(script, tiny_policy, critic, batch, 2, **one_step)
    assert micro_losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert (micro_grads[0] - grads[0]).norm() < 1e-5 * grads[0].norm()
    if "old_values" not in batch:  # PPO's old log-probs come from their own pass (the critic's values too)
        reused = {**batch, "old_logprobs": None}
        reused_losses, reused_grads = run_update(script, tiny_policy, critic, reused, 2, **one_step)
        assert reused_losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
        assert (reused_grads[0] - grads[0]).norm() < 1e-5 * grads[0].norm()


@pytest.mark.parametrize("script", SCRIPTS)
def test_under_bf16_the_update_starts_at_ratio_1_and_kl_0(script, run_main, tmp_path, monkeypatch):
    """--precision bf16 on the CPU (the policy's fp32 weights under bf16 autocast): the old and the
    reference log-probs are computed on the update's own micro-batches, the reference in the policy's
    dtype and autocast, so the update's first micro-batch sees every ratio at exactly 1 (in bf16 another
    batching moves a log-prob by ~1e-3, past GSPO's clip range of 3e-4) and step 1 logs kl/ref exactly 0
    (the reference is the initial policy)."""
    module = load_script(script)
    compute_loss, first = module.compute_loss, []

    def recording(*args, **kwargs):
        inputs = inspect.signature(compute_loss).bind(*args, **kwargs).arguments
        if not first and "old_logprobs" in inputs:  # REINFORCE and RLOO have no ratio
            first.append((inputs["logprobs"].detach() - inputs["old_logprobs"]) * inputs["mask"])
        return compute_loss(*args, **kwargs)

    monkeypatch.setattr(module, "compute_loss", recording)
    several = ["--num-minibatches", "2"] if hasattr(module.Args, "num_minibatches") else []
    # a reference (--kl-coef) and several minibatches: the old log-probs come from a pass of their own
    run_main(script, "--precision", "bf16", "--steps", "1", "--eval-every", "0", "--kl-coef", "0.04",
             "--prompts-per-step", "4", "--completions-per-prompt", "4", "--max-new-tokens", "10",
             "--micro-batch-size", "3", *several, "--output-dir", tmp_path / "run")
    from tests.test_grpo_e2e import read_metrics

    if "old_logprobs" in inspect.signature(compute_loss).parameters:
        assert first and torch.equal(first[0], torch.zeros_like(first[0])), first[0].abs().max()
    assert [m["kl/ref"] for m in read_metrics(tmp_path / "run") if "kl/ref" in m] == [0.0]
