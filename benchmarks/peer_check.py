"""REINFORCE++, Dr. GRPO and GMPO against verl's own functions, on crafted tensors.

    bash benchmarks/verl_deps.sh                  # verl (pinned) and omegaconf into .verl/, git-ignored
    .venv/bin/python benchmarks/peer_check.py     # one line per comparison; exit 1 on a disagreement

verl's `verl.trainer.ppo.core_algos` holds each peer function as a plain function of tensors:
`compute_policy_loss_geo_mean` (GMPO), `compute_reinforce_plus_plus_outcome_advantage` and
`..._baseline_outcome_advantage` (REINFORCE++), `compute_grpo_outcome_advantage` with
`norm_adv_by_std_in_grpo=False` and `agg_loss(..., "seq-mean-token-sum-norm")` (Dr. GRPO). Importing
it pulls in verl's distributed stack (ray, tensordict, ...), which none of these functions touch: those
modules are stand-ins here (STUBBED), so a function that did use one would fail, not pass.

Known difference, by design: verl whitens with the unbiased variance (n / (n - 1)), this project with
the biased one, as PPO's reference implementations do; the advantages differ by sqrt((n - 1) / n),
which the comparison takes out (and reports)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
VERL = ROOT / ".verl"
VERL_VERSION = "0.9.1"
STUBBED = ("ray", "tensordict", "codetiming", "hydra", "orjson", "pydantic_core")
sys.path.insert(0, str(ROOT))


def _inert(attr):
    if attr.startswith("__"):  # what Python's machinery asks a module (__file__, __spec__, ...): absent
        raise AttributeError(attr)
    return type(attr, (), {"__init__": lambda self, *a, **k: None})


class _Stubs:
    """A finder answering for STUBBED with empty modules whose every attribute is an inert class."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBBED else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _inert
        return module

    def exec_module(self, module):
        pass


def load_verl():
    if not (VERL / "verl").is_dir():
        sys.exit(f"peer_check.py: no verl in {VERL}: run `bash benchmarks/verl_deps.sh` first")
    sys.meta_path.insert(0, _Stubs())
    sys.path.append(str(VERL))
    import verl.trainer.ppo.core_algos as core_algos

    return core_algos


def crafted(seed=0, B=8, C=12, G=4):
    """Log-probs, a ragged completion mask, rewards in groups of G, some ratios past any clip."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, C, generator=g) * 3
    logprobs = (old + torch.randn(B, C, generator=g) * 0.5).requires_grad_()
    lengths = torch.randint(2, C + 1, (B,), generator=g)
    mask = (torch.arange(C) < lengths.unsqueeze(1)).float()
    rewards = torch.randint(0, 2, (B,), generator=g).float() + torch.rand(B, generator=g) * 0.1
    return logprobs, old, mask, rewards, lengths, G


def report(name, ours, theirs, tol=1e-5) -> bool:
    diff = (ours - theirs).abs().max().item()
    ok = diff <= tol * max(1.0, theirs.abs().max().item())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |ours - verl| = {diff:.2e}")
    return ok


def check_gmpo(c) -> list[bool]:
    import gmpo

    logprobs, old, mask, rewards, _, G = crafted()
    A = gmpo.compute_advantages(rewards, G, scale_rewards=True)
    args = gmpo.Args()
    weights = torch.ones_like(old)
    ours, _ = gmpo.compute_loss(logprobs, old, None, A, weights, mask, args, mask.sum(), len(A))
    (ours_grad,) = torch.autograd.grad(ours, logprobs)
    config = types.SimpleNamespace(clip_ratio=args.eps_low, clip_ratio_low=args.eps_low, clip_ratio_high=args.eps_high)
    theirs, _ = c.compute_policy_loss_geo_mean(old, logprobs, A.unsqueeze(1) * mask, mask, config=config)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    (theirs_grad,) = torch.autograd.grad(theirs, logprobs)
    return [report("GMPO loss", ours.detach(), theirs.detach()), report("GMPO gradient", ours_grad, theirs_grad)]


def check_reinforce_pp(c) -> list[bool]:
    import reinforce_pp

    logprobs, _, mask, rewards, lengths, G = crafted(seed=1)
    kl = (torch.rand(logprobs.shape, generator=torch.Generator().manual_seed(2)) - 0.3) * mask
    beta, n = 0.05, mask.sum()
    bessel = torch.sqrt((n - 1) / n)  # verl's unbiased variance against our biased one
    token_rewards = -beta * kl  # verl's input: r_t = -beta KL_t, R added at the last token
    token_rewards[torch.arange(len(lengths)), lengths - 1] += rewards
    returns = reinforce_pp.compute_returns(rewards, kl, mask, beta)
    ours = reinforce_pp.compute_advantages(returns, rewards, mask, "none", G)
    theirs, _ = c.compute_reinforce_plus_plus_outcome_advantage(token_rewards, mask, config=types.SimpleNamespace(gamma=1.0))
    ok = [report("REINFORCE++ advantages (x sqrt((n-1)/n))", ours * bessel, theirs)]
    # the baseline variant: outcome reward only (verl adds the KL to the reward before; here beta = 0)
    outcome = torch.zeros_like(mask)
    outcome[torch.arange(len(lengths)), lengths - 1] = rewards
    ours = reinforce_pp.compute_advantages(reinforce_pp.compute_returns(rewards, kl, mask, 0.0), rewards, mask, "group", G)
    index = np.repeat(np.arange(len(rewards) // G), G)
    theirs, _ = c.compute_reinforce_plus_plus_baseline_outcome_advantage(outcome, mask, index)
    ok.append(report("REINFORCE++-baseline advantages (x sqrt((n-1)/n))", ours * bessel, theirs))
    return ok


def check_dr_grpo(c) -> list[bool]:
    import dr_grpo
    from common.ops import aggregate

    logprobs, _, mask, rewards, lengths, G = crafted(seed=3)
    outcome = torch.zeros_like(mask)
    outcome[torch.arange(len(lengths)), lengths - 1] = rewards
    args = dr_grpo.Args()
    ours = dr_grpo.compute_advantages(rewards, G, args.scale_rewards)
    index = np.repeat(np.arange(len(rewards) // G), G)
    theirs, _ = c.compute_grpo_outcome_advantage(outcome, mask, index, norm_adv_by_std_in_grpo=False)
    ok = [report("Dr. GRPO advantages", ours.unsqueeze(1) * mask, theirs)]
    per_token = logprobs.detach() * 1.7  # any per-token loss: the aggregation alone
    ours = aggregate(per_token, mask, args.loss_agg, mask.sum(), len(rewards), args.max_new_tokens)
    theirs = c.agg_loss(per_token, mask, "seq-mean-token-sum-norm", loss_scale_factor=args.max_new_tokens)
    ok.append(report("Dr. GRPO aggregation (token sum / max_new_tokens, mean over completions)", ours, theirs))
    return ok


def main() -> None:
    c = load_verl()
    print(f"verl {VERL_VERSION} ({VERL}), torch {torch.__version__}")
    results = check_gmpo(c) + check_reinforce_pp(c) + check_dr_grpo(c)
    print(f"{sum(results)}/{len(results)} agree")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
