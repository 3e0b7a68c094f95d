"""One optimizer step of the scripts' update on a fixed rollout batch, in one process or under
torchrun: `python tests/dist_worker.py OUT.pt` or `torchrun --nproc-per-node 2 tests/dist_worker.py OUT.pt`,
then optionally `--precision bf16`, `--gradient-checkpointing`, `--cases CASE ...` (default: CASES).

Every rank builds the same batch (8 completions, 2 prompts x 4) and takes its share, as the scripts
do with their prompts; the scripts' own advantage functions and their own update (step 5: the
micro-batch loop, common/dist.py's normalizers, FSDP2 sharding, clipping) compute the gradient,
then AdamW takes one step. Rank 0 saves, per case, the whole (clipped) gradient and the parameter
change and the losses as logged, so that tests/test_dist.py can compare N processes with one, and the
dtypes of the weights the linear layers ran with (FSDP2 gathers them just before: its mixed precision
shows there).
"""

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import grpo  # noqa: E402
import ppo  # noqa: E402
import reinforce  # noqa: E402
from common import dist  # noqa: E402
from common.models import load_policy, load_tokenizer  # noqa: E402
from common.batch import draw_minibatches, make_batch  # noqa: E402
from common.metrics import update_metrics  # noqa: E402
from common.ops import RolloutCorrection  # noqa: E402
from common.setup import Precision  # noqa: E402

TINY_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "tiny-sort")
G, NUM_PROMPTS, MICRO = 4, 2, 3  # micro-batches of 3 rows: one process and each rank cut the batch differently
OFF = RolloutCorrection("off")  # vLLM's log-probs are pi_old's here: no weights
FP32 = Precision(None, "float32", "float32", rollout_correction=OFF)
PRECISIONS = {"fp32": FP32, "bf16": Precision(torch.bfloat16, "bfloat16", "bfloat16", rollout_correction=OFF)}
CASES = ("grpo:token-mean", "grpo:seq-mean-token-mean", "reinforce", "ppo")


def rollout_batch(vocab: int):
    """A fixed batch: prompts and completions of different lengths, rewards with spread."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (5, 9)]
    completions = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 12, (G * NUM_PROMPTS,), generator=gen)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    return [p for p in prompts for _ in range(G)], completions, rewards


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps, at its step, the whole gradient (gathered over ranks) it applies."""

    def step(self, closure=None):
        self.grad = {n: dist.full_tensor(p.grad).clone() for n, p in self.named}
        return super().step(closure)


def update(policy, critic, optimizer, case: str, input_ids, attention_mask, completion_mask, rewards, precision=FP32):
    """The scripts' step 4 and their own step 5 for one case on this rank's rows: advantages, then
    one optimizer step over micro-batches with the minibatch's global totals. Returns its statistics."""
    from common.ops import batched_logprobs

    loss_mask, C = completion_mask, completion_mask.shape[1]
    old_logprobs = batched_logprobs(policy, input_ids, attention_mask, C, 1.0, 1, precision.autocast_dtype)
    # a stand-in for the policy that sampled and for the reference: fixed offsets, so ratios and KL are not trivial
    offsets = torch.linspace(-0.05, 0.05, C).expand_as(old_logprobs)
    old_logprobs, ref_logprobs = old_logprobs + offsets, old_logprobs - 2 * offsets
    batch = dict(minibatches=draw_minibatches(len(input_ids), 1, 1, input_ids.device), input_ids=input_ids,
                 attention_mask=attention_mask, completion_mask=completion_mask, loss_mask=loss_mask,
                 old_logprobs=old_logprobs, vllm_logprobs=old_logprobs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if case.startswith("grpo"):
        args = grpo.Args(loss_agg=case.split(":")[1], kl_coef=0.04, num_minibatches=1, micro_batch_size=MICRO)
        advantages = grpo.compute_advantages(rewards, G, args.scale_rewards)
        stats, _ = grpo.update(policy, optimizer, scheduler, args, precision, **batch, ref_logprobs=ref_logprobs,
                               advantages=advantages)
    elif case == "reinforce":
        args = reinforce.Args(baseline="batch-mean", kl_coef=0.0, micro_batch_size=MICRO)
        returns = reinforce.compute_returns(rewards, torch.zeros_like(old_logprobs), loss_mask, args.kl_coef)
        baseline, _ = reinforce.update_baseline(None, returns, args)
        advantages = reinforce.compute_advantages(returns, loss_mask, baseline)
        stats, _ = reinforce.update(policy, optimizer, scheduler, args, precision, **batch, advantages=advantages)
    else:
        args = ppo.Args(whiten_advantages=True, num_minibatches=1, micro_batch_size=MICRO)
        values = torch.zeros_like(old_logprobs)
        token_rewards = ppo.compute_token_rewards(rewards, old_logprobs - ref_logprobs, loss_mask, args.kl_coef)
        advantages, returns = ppo.compute_advantages(token_rewards, values, loss_mask, args.gamma, args.lam)
        advantages = dist.whiten(advantages, loss_mask)
        stats, _ = ppo.update(policy, critic, optimizer, scheduler, args, precision, **batch, advantages=advantages,
                              old_values=values, returns=returns)
    return stats


def record_weight_dtypes(model, seen: collections.Counter) -> None:
    """Counts in seen the linear layers' calls by the dtype of the weight they ran with (under FSDP2
    the gathered weight; autocast casts a copy inside the layer, not the weight), and under
    "recomputed" the calls of a decoder layer in a backward pass: gradient checkpointing's (the output
    layer's calls in a backward are common/ops.py forward_logprobs' own chunks, recomputed always)."""
    def hook(module, _):
        seen.update([str(module.weight.dtype)] + (["recomputed"] if torch._C._current_graph_task_id() >= 0 else []))

    def head_hook(module, _):
        seen.update([str(module.weight.dtype)])

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(head_hook if module is head else hook)


def main(out: str, precision: str = "fp32", gradient_checkpointing: bool = False, cases=CASES) -> None:
    device = dist.init()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(TINY_MODEL)
    precision = PRECISIONS[precision]
    results = {"world_size": dist.world_size(), "weight_dtypes": collections.Counter()}
    for case in cases:
        policy = dist.shard(load_policy(TINY_MODEL, tokenizer, "float32", device, gradient_checkpointing), precision)
        record_weight_dtypes(policy, results["weight_dtypes"])
        before = {n: dist.full_tensor(p.detach()).clone() for n, p in policy.named_parameters()}
        params = list(policy.parameters())
        critic = None
        if case == "ppo":  # its value head starts at zero: values 0, as the stand-in old values
            critic = ppo.load_critic(TINY_MODEL, tokenizer, "float32", device, gradient_checkpointing)
            critic = dist.shard(critic, precision, called_alone=(critic.base_model, critic.score))
            record_weight_dtypes(critic, results["weight_dtypes"])
            params += list(critic.parameters())
        # a large step: the parameter change stays far above the float32 rounding of the parameters themselves
        optimizer = RecordingAdamW(params, lr=0.1)
        optimizer.named = list(policy.named_parameters())
        prompts, completions, rewards = rollout_batch(len(tokenizer))
        share = dist.share(list(range(len(prompts))))  # whole groups: 4 rows per rank under 2 processes
        batch = make_batch([prompts[i] for i in share], [completions[i] for i in share], tokenizer.pad_token_id,
                           device)
        stats = update(policy, critic, optimizer, case, *batch, rewards[share], precision)
        delta = {n: dist.full_tensor(p.detach()) - before[n] for n, p in policy.named_parameters()}
        # the losses as the scripts log them: averaged over minibatches, then over ranks
        losses = dist.mean_over_ranks({k: v for k, v in update_metrics(stats).items() if k.startswith("loss/")})
        results[case] = {"grad": optimizer.grad, "delta": delta, "grad_norm": stats["optim/grad_norm"][0],
                         "losses": {k: float(v) for k, v in losses.items()}}
    results["recomputed"] = results["weight_dtypes"].pop("recomputed", 0)
    results["weight_dtypes"] = dict(results["weight_dtypes"])
    if dist.is_main():
        torch.save(results, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp32")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    options = parser.parse_args()
    main(options.out, options.precision, options.gradient_checkpointing, options.cases)
