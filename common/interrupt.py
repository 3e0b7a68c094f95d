"""Stopping on Ctrl-C or SIGTERM: cleanly, on every rank after the same step, in the training loop
(GracefulInterrupt); at once, in one line, anywhere else (StopAtOnce, which cli() holds)."""

from __future__ import annotations

import math
import signal
import sys
import time

import torch
from tqdm import tqdm

from common import dist

# A repeat of the signal this soon after the first is the same request delivered twice, not a
# second Ctrl-C: a scheduler that signals every process of the job (SLURM at a time limit) hits
# each rank directly and through torchrun, which forwards what it gets to its workers.
SAME_REQUEST_S = 5.0


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM that stops the run at once, saving nothing more: cli() says it in one
    line and exits with 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class StopAtOnce:
    """with StopAtOnce(): Ctrl-C and SIGTERM raise Interrupted within the block (the previous
    handlers return after it). What cli() holds outside the training loop: loading, vLLM starting,
    the first evaluation, the final save (which is atomic: a stop leaves no half final/). Without it
    SIGTERM would kill the process with no word, and Ctrl-C end in a traceback."""

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        raise Interrupted(signum)

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False


class GracefulInterrupt(StopAtOnce):
    """The first Ctrl-C or SIGTERM (what schedulers and `timeout` send) asks the loop to stop
    after the current step, which then saves a checkpoint and exits with 128 + the signal's
    number (130, 143), so a wrapper can tell it from a finished run. Another one, SAME_REQUEST_S
    or more later, stops at once (StopAtOnce; a checkpoint it cuts short is not left half written).

    Under torchrun, signal the launcher (schedulers do): it forwards the signal to every rank and
    SIGKILLs them `--shutdown-timeout` seconds later (30 by default: too short for a GPU step and
    a checkpoint). torchrun itself then exits 1, as for a crash: it does not pass on its workers'
    exit codes."""

    def __init__(self):
        self.requested, self.exit_code, self.requested_at = False, 0, -math.inf

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self.requested_at < SAME_REQUEST_S:
                return  # the same request, delivered again (see SAME_REQUEST_S)
            super()._handle(signum, frame)  # raises Interrupted: stop at once
        self.requested, self.exit_code, self.requested_at = True, 128 + signum, time.monotonic()
        # stderr: under torchrun only rank 0's stdout is shown, and the signal may reach another rank;
        # tqdm.write: on a line of its own, above the progress bar
        tqdm.write(f"{signal_name(signum)}: finishing this step, then saving a checkpoint (again to abort)",
                   file=sys.stderr)

    def stop(self) -> bool:
        """Whether to save and stop after this step. Every rank calls it once per step: under
        torchrun a signal that reached one rank stops them all after the same step, with one
        checkpoint, and the same exit code."""
        if dist.world_size() > 1:
            self.exit_code = int(dist.all_gather(torch.tensor([self.exit_code])).max())
            if self.exit_code > 0 and not self.requested:  # another rank's signal: this one's may follow
                self.requested, self.requested_at = True, time.monotonic()
            if self.requested and dist.is_main():
                tqdm.write("stopping: torchrun will exit 1 as for a crash (it does not pass on its workers' exit "
                           f"code, {self.exit_code}); the run is resumable, with the --resume line below",
                           file=sys.stderr)
        return self.requested
