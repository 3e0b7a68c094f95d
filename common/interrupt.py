"""Stopping cleanly on Ctrl-C or SIGTERM, on every rank after the same step."""

from __future__ import annotations

import signal
import sys

import torch

from common import dist


class GracefulInterrupt:
    """The first Ctrl-C or SIGTERM (what schedulers and `timeout` send) asks the loop to stop
    after the current step, which then saves a checkpoint and exits with 128 + the signal's
    number (130, 143), so a wrapper can tell it from a finished run. A second one stops at once."""

    def __init__(self):
        self.requested, self.exit_code = False, 0

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.exit_code = True, 128 + signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # stderr: under torchrun only rank 0's stdout is shown, and the signal may reach another rank
        print(f"\n{name}: finishing this step, then saving a checkpoint (again to abort)", file=sys.stderr, flush=True)

    def stop(self) -> bool:
        """Whether to save and stop after this step. Every rank calls it once per step: under
        torchrun a signal that reached one rank stops them all after the same step, with one
        checkpoint, and the same exit code."""
        if dist.world_size() > 1:
            self.exit_code = int(dist.all_gather(torch.tensor([self.exit_code])).max())
            self.requested = self.exit_code > 0
        return self.requested

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
