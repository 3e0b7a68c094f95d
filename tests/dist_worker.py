"""One optimizer step of the scripts' update on a fixed rollout batch, in one process or under
torchrun: `python tests/dist_worker.py OUT.pt` or `torchrun --nproc-per-node 2 tests/dist_worker.py OUT.pt`.

Every rank builds the same batch (8 completions, 2 prompts x 4) and takes its share, as the scripts
do with their prompts; the scripts' own advantage and loss functions and common/dist.py's
normalizers and FSDP2 sharding compute the gradient, then AdamW takes one step. Rank 0 saves, per
case, the whole gradient and the parameter change, so that tests/test_dist.py can compare N processes
with one.
"""

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
from common.ops import forward_logprobs, make_batch, micro_batches, truncated_is_weights  # noqa: E402

TINY_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "tiny-sort")
G, NUM_PROMPTS, MICRO = 4, 2, 3  # micro-batches of 3 rows: one process and each rank cut the batch differently


def rollout_batch(vocab: int):
    """A fixed batch: prompts and completions of different lengths, rewards with spread."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (5, 9)]
    completions = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 12, (G * NUM_PROMPTS,), generator=gen)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    return [p for p in prompts for _ in range(G)], completions, rewards


def update(policy, case: str, input_ids, attention_mask, completion_mask, rewards):
    """The scripts' step 4 and 5 for one case on this rank's rows: advantages, micro-batch losses
    with the minibatch's global totals, backward."""
    loss_mask, C = completion_mask, completion_mask.shape[1]
    with torch.no_grad():
        old_logprobs = torch.cat([forward_logprobs(policy, input_ids[i:i + 1], attention_mask[i:i + 1], C)
                                  for i in range(len(input_ids))])
    # a stand-in for the policy that sampled and for the reference: fixed offsets, so ratios and KL are not trivial
    offsets = torch.linspace(-0.05, 0.05, C).expand_as(old_logprobs)
    old_logprobs, ref_logprobs = old_logprobs + offsets, old_logprobs - 2 * offsets
    if case.startswith("grpo"):
        args = grpo.Args(loss_agg=case.split(":")[1], kl_coef=0.04)
        advantages = grpo.compute_advantages(rewards, G, args.scale_rewards)
    elif case == "reinforce":
        args = reinforce.Args(baseline="batch-mean", kl_coef=0.0)
        returns = reinforce.compute_returns(rewards, torch.zeros_like(old_logprobs), loss_mask, args.kl_coef)
        baseline, _ = reinforce.update_baseline(None, returns, args)
        advantages = reinforce.compute_advantages(returns, loss_mask, baseline)
    else:
        args = ppo.Args(whiten_advantages=True)
        values = torch.zeros_like(old_logprobs)
        token_rewards = ppo.compute_token_rewards(rewards, old_logprobs - ref_logprobs, loss_mask, args.kl_coef)
        advantages, returns = ppo.compute_advantages(token_rewards, values, loss_mask, args.gamma, args.lam)
        advantages = ppo.whiten(advantages, loss_mask)
    rows = torch.arange(len(input_ids))
    num_tokens, num_seqs = dist.minibatch_totals(loss_mask[rows])
    for micro, cols, c in micro_batches(rows, input_ids, attention_mask, C, MICRO):
        logprobs = forward_logprobs(policy, input_ids[micro, cols], attention_mask[micro, cols], c)
        weights = truncated_is_weights(old_logprobs[micro, :c], old_logprobs[micro, :c], 0.0)
        if case.startswith("grpo"):
            loss, _ = grpo.compute_loss(logprobs, old_logprobs[micro, :c], ref_logprobs[micro, :c], advantages[micro],
                                        weights, loss_mask[micro, :c], args, num_tokens, num_seqs)
        elif case == "reinforce":
            loss, _ = reinforce.compute_loss(logprobs, advantages[micro, :c], weights, loss_mask[micro, :c], args,
                                             num_tokens, num_seqs)
        else:
            loss, _ = ppo.compute_loss(logprobs, old_logprobs[micro, :c], advantages[micro, :c], values[micro, :c],
                                       values[micro, :c], returns[micro, :c], weights, loss_mask[micro, :c], args,
                                       num_tokens, num_seqs)
        loss.backward()


def main(out: str) -> None:
    device = dist.init()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(TINY_MODEL)
    results = {"world_size": dist.world_size()}
    for case in ("grpo:token-mean", "grpo:seq-mean-token-mean", "reinforce", "ppo"):
        policy = dist.shard(load_policy(TINY_MODEL, tokenizer, "float32", device))
        before = {n: dist.full_tensor(p.detach()).clone() for n, p in policy.named_parameters()}
        # a large step: the parameter change stays far above the float32 rounding of the parameters themselves
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
        prompts, completions, rewards = rollout_batch(len(tokenizer))
        share = dist.share(list(range(len(prompts))))  # whole groups: 4 rows per rank under 2 processes
        batch = make_batch([prompts[i] for i in share], [completions[i] for i in share], tokenizer.pad_token_id,
                           device)
        update(policy, case, *batch, rewards[share])
        grad = {n: dist.full_tensor(p.grad).clone() for n, p in policy.named_parameters()}
        grad_norm = dist.full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        optimizer.step()
        delta = {n: dist.full_tensor(p.detach()) - before[n] for n, p in policy.named_parameters()}
        results[case] = {"grad": grad, "delta": delta, "grad_norm": float(grad_norm)}
    if dist.is_main():
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
