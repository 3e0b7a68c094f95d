"""Nothing non-finite reaches the weights: an optimizer step whose loss or gradient is NaN or inf
is skipped (and a run that keeps producing them stops), and no checkpoint or final model is
saved with a non-finite weight. A run whose engine no longer samples from the policy (a
weight sync lost) stops (SyncGuard), and so does one whose environment answered none of a step's
calls (env_stalled)."""

from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from common import dist
from common.engine import TransformersEngine
from common.errors import RunError
from common.setup import Precision


def step_if_finite(optimizer, scheduler, step_stats: dict, max_in_a_row: int, loss: float, *grad_norms) -> bool:
    """The update's optimizer step: optimizer.step() and scheduler.step() if the minibatch's loss and
    gradient norms (clip_grad_norm_'s) are finite, then zero_grad. Returns whether it stepped.

    A non-finite one is skipped: the weights, AdamW's moments and step count, and the learning-rate
    schedule stay as they were (the schedule counts the updates applied, as AdamW's bias correction
    does; torch also warns of a scheduler stepped without its optimizer), the gradient is dropped,
    stderr says so and step_stats["optim/skipped_steps"] counts it. max_in_a_row skipped in a row
    stop the run (RunError): the model no longer gives a usable gradient. The count lives on the
    optimizer, across updates. Under torchrun every rank decides alike: loss is the minibatch's, summed
    over ranks (common/metrics.py minibatch_stats), and the gradient norms are already global."""
    loss = float(loss)
    finite = math.isfinite(loss) and all(math.isfinite(float(n)) for n in grad_norms)
    skipped = step_stats.setdefault("optim/skipped_steps", [0])  # one entry, a count: the metrics average lists
    if finite:
        optimizer.step()
        scheduler.step()
        optimizer.nonfinite_in_a_row = 0
    else:
        skipped[0] += 1
        optimizer.nonfinite_in_a_row = getattr(optimizer, "nonfinite_in_a_row", 0) + 1
    optimizer.zero_grad(set_to_none=True)
    if finite:
        return True
    n, norms = optimizer.nonfinite_in_a_row, ", ".join(f"{float(g):.4g}" for g in grad_norms)
    if n >= max_in_a_row:
        raise RunError(f"stopping: {n} optimizer steps in a row had a non-finite loss or gradient (the last: loss "
                       f"{loss:.4g}, gradient norm {norms}) and were skipped, so no weight took them; lower --lr or "
                       f"--max-grad-norm, check the reward, or allow more with --max-nonfinite-steps")
    if dist.is_main():  # on its own line, above the progress bar
        tqdm.write(f"skipped an optimizer step: loss {loss:.4g}, gradient norm {norms} ({n} in a row; "
                   f"--max-nonfinite-steps {max_in_a_row} stops the run)", file=sys.stderr)
    return False


def check_finite_weights(models: dict, weights: dict, what: str) -> None:
    """Refuses to save `what` (RunError, one line naming the weight) when a weight of models (by
    name) is NaN or inf. weights: their whole state dicts where dist.full_state_dict gathered them
    (rank 0 under torchrun), else None: the models' own."""
    for model_name, model in models.items():
        for name, t in (weights.get(model_name) or model.state_dict()).items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise RunError(f"not saving {what}: the {model_name}'s weight {name} is not finite (NaN or inf)")


# rollout/logprob_mismatch (mean |engine - trainer| log-prob over the sampled tokens) above which the
# engine is not sampling from the policy, per the numerics of the two: far above what a working sync
# gives, far below what a lost one does (measured, benchmarks/off_policy.py --gap: docs/runs.md, "The
# sync guard"; bf16's working gap is 0.035 on SmolLM2, a lost LoRA sync's crosses 0.1 at step 5)
SYNC_MISMATCH_BOUNDS = {"fp32": 1e-3, "bf16": 0.1}


class SyncGuard:
    """A weight sync that silently does nothing looks like slow learning (TRL, verl and ms-swift each
    shipped one). After a sync the engine samples from the policy up to its numerics, so each step's
    rollout/logprob_mismatch (common/metrics.py step_metrics) stays below the bound of the run's
    numerics (SYNC_MISMATCH_BOUNDS; bf16 under --precision bf16 or --dtype bfloat16); max_in_a_row
    steps in a row above it stop the run. numerics None (the transformers engine, whose samples are
    the policy's own: no sync to lose) or max_in_a_row 0: no check."""

    @classmethod
    def of(cls, args, llm) -> SyncGuard:
        """The run's guard: --max-unsynced-steps, and the numerics of its engine and trainer."""
        bf16 = Precision.of(args, args.device).autocast_dtype is not None or args.dtype == "bfloat16"
        return cls(args.max_unsynced_steps, None if isinstance(llm, TransformersEngine) else "bf16" if bf16 else "fp32")

    def __init__(self, max_in_a_row: int, numerics: str | None):
        self.max_in_a_row, self.numerics, self.in_a_row = max_in_a_row, numerics, 0
        self.bound = SYNC_MISMATCH_BOUNDS[numerics] if numerics and max_in_a_row else None

    def check(self, mismatch: float) -> str | None:
        """After a step: None, or the line that stops the run. Under torchrun mismatch is the mean over
        ranks (Run.end_step's), so every rank decides alike. NaN: no measure this step (grpo_async.py's
        stale batches, sampled by an older policy on purpose), the count left as it is."""
        if self.bound is None or math.isnan(mismatch):
            return None
        self.in_a_row = self.in_a_row + 1 if mismatch > self.bound else 0
        if self.in_a_row < self.max_in_a_row:
            return None
        return (f"the engine is not sampling from the policy: weights not synchronized? Its log-probs of its "
                f"samples were {self.in_a_row} steps in a row far from the policy's (rollout/logprob_mismatch "
                f"{mismatch:.3g}, above the {self.bound:g} that {self.numerics} numerics explain; "
                f"--max-unsynced-steps 0 turns this check off)")


def env_stalled(args, metrics: dict, what: str) -> str | None:
    """Why the run should stop, where every call of the environment (grpo_multiturn.py's --env) in
    these metrics (a step's env/..., an evaluation's eval/env/...) ran past --env-timeout or lost
    its worker: each such call costs the whole limit, and a run of them learns nothing."""
    prefix = "eval/env/" if what.startswith("evaluating") else "env/"
    calls = metrics.get(f"{prefix}calls", 0)
    if calls and metrics[f"{prefix}timeouts"] >= calls:
        return (f"--env {args.env!r}: every one of its {calls:g} calls {what} ran past --env-timeout "
                f"{args.env_timeout:g} s (or its worker died)")
    return None
