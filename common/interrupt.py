"""Stopping cleanly on Ctrl-C or SIGTERM, on every rank after the same step."""

from __future__ import annotations

import math
import signal
import sys
import time

import torch

from common import dist

# A repeat of the signal this soon after the first is the same request delivered twice, not a
# second Ctrl-C: a scheduler that signals every process of the job (SLURM at a time limit) hits
# each rank directly and through torchrun, which forwards what it gets to its workers.
SAME_REQUEST_S = 5.0


class GracefulInterrupt:
    """The first Ctrl-C or SIGTERM (what schedulers and `timeout` send) asks the loop to stop
    after the current step, which then saves a checkpoint and exits with 128 + the signal's
    number (130, 143), so a wrapper can tell it from a finished run. Another one, SAME_REQUEST_S
    or more later, stops at once.

    Under torchrun, signal the launcher (schedulers do): it forwards the signal to every rank and
    SIGKILLs them `--shutdown-timeout` seconds later (30 by default: too short for a GPU step and
    a checkpoint). torchrun itself then exits 1, as for a crash: it does not pass on its workers'
    exit codes."""

    def __init__(self):
        self.requested, self.exit_code, self.requested_at = False, 0, -math.inf

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self.requested_at < SAME_REQUEST_S:
                return  # the same request, delivered again (see SAME_REQUEST_S)
            raise KeyboardInterrupt
        self.requested, self.exit_code, self.requested_at = True, 128 + signum, time.monotonic()
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # stderr: under torchrun only rank 0's stdout is shown, and the signal may reach another rank
        print(f"\n{name}: finishing this step, then saving a checkpoint (again to abort)", file=sys.stderr, flush=True)

    def stop(self) -> bool:
        """Whether to save and stop after this step. Every rank calls it once per step: under
        torchrun a signal that reached one rank stops them all after the same step, with one
        checkpoint, and the same exit code."""
        if dist.world_size() > 1:
            self.exit_code = int(dist.all_gather(torch.tensor([self.exit_code])).max())
            if self.exit_code > 0 and not self.requested:  # another rank's signal: this one's may follow
                self.requested, self.requested_at = True, time.monotonic()
            if self.requested and dist.is_main():
                print("stopping: torchrun will exit 1 as for a crash (it does not pass on its workers' exit "
                      f"code, {self.exit_code}); the run is resumable, with the --resume line below",
                      file=sys.stderr, flush=True)
        return self.requested

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
