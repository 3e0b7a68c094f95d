"""Nothing non-finite reaches the weights: an optimizer step whose loss or gradient is NaN or inf
is skipped (and a run that keeps producing them stops), and no checkpoint or final model is
saved with a non-finite weight."""

from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from common import dist
from common.errors import RunError


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
