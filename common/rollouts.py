"""grpo_async.py's sampling side: batches sampled ahead of training by at most K policy versions,
in this process or on rollout ranks of their own (torchrun), behind one interface:

    rollouts.batch(step)          the batch of step `step`, tagged with the version that sampled it
    rollouts.sync(policy, v)      the trainer's weights (version v) to the engine, between generations
    (at exit)                     the rollout ranks stop with the trainer (done, Ctrl-C / SIGTERM, an error)

The rule is the same on both: the engine samples the batch of step n once it holds weights of
version >= n - K, and at most K steps beyond the one being trained; a batch it may not sample yet
waits for its weights (never sampled and then dropped). In one process (`Ahead`) the two sides take
turns: before step s trains, the batches up to s + K are sampled. Under torchrun (`Remote` on the
trainer ranks, `serve` on the rollout ranks, common/dist.py split) the rollout ranks sample the
batch of step s + K while the trainers train step s: a rollout rank hands over a batch when asked,
then samples ahead, then waits for the next request or weights. Weights are broadcast from the first
trainer rank to the rollout ranks (dist.SYNC: NCCL on GPU, gloo on CPU) tensor by tensor, into a
copy of the policy the engine is synced from; requests, batches and evaluation calls are pickled
objects between the first trainer rank and each rollout rank (dist.LINK).
"""

from __future__ import annotations

import atexit
import pickle
import signal
import time

import torch
import torch.distributed as tdist

from common import dist
from common.engine import even_parts, sync_weights
from common.models import merged_weights


class Ahead:
    """Batches sampled ahead by `sample` (() -> this rank's share of a batch, and prompt_sampler's state after
    drawing it), each tagged with the engine's version; K = max_staleness, for a run of `steps` steps. The
    first sync says where the run starts."""

    def __init__(self, sample, llm, prompt_sampler: torch.Generator, max_staleness: int, steps: int):
        self.sample, self.llm, self.prompt_sampler = sample, llm, prompt_sampler
        self.K, self.steps = max_staleness, steps
        self.version, self.sampled, self.busy = None, {}, 0.0  # nothing is sampled before the first sync

    def fill(self, upto: int) -> None:
        """Samples the batches up to step `upto` that the engine's version allows (>= their step - K)."""
        last = min(upto, self.steps - 1)
        while self.version is not None and self.version >= self.next - self.K and self.next <= last:
            t0 = time.perf_counter()
            self.sampled[self.next] = (*self.sample(), self.version)
            self.busy += time.perf_counter() - t0
            self.next += 1

    def take(self, step: int) -> tuple:
        """(examples, prompt_ids, completions, sampler state after drawing them, version, seconds the engine
        sampled since the last batch taken) of step `step`, sampling it first if it is not yet."""
        self.fill(step)
        busy, self.busy, self.served = self.busy, 0.0, step
        return (*self.sampled.pop(step), busy)

    def batch(self, step: int) -> tuple:
        self.fill(step + self.K)  # one process: the batches up to step + K, then the one of step
        return self.take(step)

    def sync(self, policy, version: int, sampler_state: torch.Tensor | None = None) -> None:
        """The engine holds `version` from now on; with sampler_state, the run (re)starts there: from that
        version's step, its prompts drawn from that state."""
        sync_weights(self.llm, policy)
        self.version = version
        if sampler_state is not None:
            self.prompt_sampler.set_state(sampler_state)
            self.next, self.served, self.sampled = version, version - 1, {}  # served: the last step handed over


def send(obj, dst: int) -> None:
    """obj, pickled, to rank dst of dist.LINK (its length first)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    for t in (torch.tensor([data.numel()]), data):
        dist.LINK.send([t], dst, 0).wait()  # LINK is no group of torch.distributed's world: its own methods


def recv(src: int):
    """The object rank src of dist.LINK sends."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.LINK.recv([size], src, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.LINK.recv([data], src, 0).wait()
    return pickle.loads(data.numpy().tobytes())


def broadcast_weight(t: torch.Tensor) -> None:
    """t from the first trainer rank (SYNC's root 0) into the rollout ranks' t, over dist.SYNC."""
    dist.SYNC.broadcast([t], tdist.BroadcastOptions()).wait()


class Remote:
    """The trainer ranks' side: the first trainer rank asks each rollout rank for its share of a batch
    (in rollout-rank order: the whole batch, as one process samples it) and hands the trainer ranks
    theirs; it is also the engine of the evaluations (`generate`: the requests shared among the rollout ranks)."""

    sleeps, asleep, calls = False, frozenset(), None
    memory = {"device": 0, "allocated": 0}  # the engine's memory is on the rollout ranks

    def __init__(self, kind: str):
        self.engine_kind = kind  # --engine: which SamplingParams the rollout ranks' engine takes
        self.closed = False
        atexit.register(self.close)  # however the trainer ends (done, Ctrl-C, SIGTERM, an error): they stop

    def ask(self, commands: dict[int, tuple]) -> list:
        """commands[r] to rollout rank r, and their replies (in that order); a rollout rank's error is raised."""
        for r, command in commands.items():
            send(command, r)
        replies = [recv(r) for r in commands]
        for reply in replies:
            if isinstance(reply, BaseException):
                self.closed = True  # that rank has stopped
                raise reply
        return replies

    def batch(self, step: int) -> tuple:
        whole = None
        if dist.is_main():
            shares = self.ask({r: ("batch", step) for r in dist.ROLLOUT_RANKS})
            examples, prompt_ids, completions = ([x for share in shares for x in share[i]] for i in range(3))
            whole = (examples, prompt_ids, completions, shares[0][3], min(s[4] for s in shares),
                     max(s[5] for s in shares))
        examples, prompt_ids, completions, *rest = dist.broadcast(whole)
        return (dist.share(examples), dist.share(prompt_ids), dist.share(completions), *rest)

    def sync(self, policy, version: int, sampler_state: torch.Tensor | None = None) -> None:
        if dist.is_main():
            for r in dist.ROLLOUT_RANKS:
                send(("sync", version, sampler_state), r)
        for _, t in merged_weights(policy):  # every trainer rank: under FSDP each tensor is gathered whole in turn
            if dist.is_main():
                broadcast_weight(t.contiguous())

    def generate(self, requests: list, params, use_tqdm: bool = False) -> list:
        """Each rollout rank decodes a contiguous part of the requests (every rank takes part: the transformers
        engine's ranks decode in step); the completions in the requests' order."""
        ranks = dist.ROLLOUT_RANKS
        parts = even_parts(list(range(len(requests))), len(ranks))
        per_request = isinstance(params, (list, tuple))  # one SamplingParams a request, or one for all
        replies = self.ask({r: ("generate", [requests[i] for i in part], [params[i] for i in part] if per_request
                                else params, use_tqdm and r == ranks[0]) for r, part in zip(ranks, parts)})
        return [completion for reply in replies for completion in reply]

    def close(self) -> None:
        if dist.is_main() and not self.closed:
            self.closed = True
            for r in dist.ROLLOUT_RANKS:
                send(("stop",), r)


def serve(ahead: Ahead, model) -> None:
    """A rollout rank's loop, until the trainer says stop (its exit status says how the run ended): hand
    over a batch when asked and sample ahead; take weights into `model` and sync the engine from it;
    generate for the evaluations. Ctrl-C and SIGTERM are left to the trainer ranks, which save and then say
    stop; an error here is the reply to the trainer's next request (raised there)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    error = None
    while True:
        command, *payload = recv(0)
        if command == "stop":
            return
        try:
            if error is not None:
                raise error
            if command == "batch":
                reply = ahead.take(payload[0])
            elif command == "sync":
                with torch.no_grad():
                    for _, p in merged_weights(model):  # the trainer's order (both: the base model's names)
                        broadcast_weight(p)
                ahead.sync(model, *payload)
                reply = None
            else:  # generate: an evaluation's greedy completions
                requests, params, use_tqdm = payload
                reply = ahead.llm.generate(requests, params, use_tqdm=use_tqdm)
        except Exception as e:  # noqa: BLE001 - the trainer raises it
            error, reply = e, e
        if command != "sync" or error is not None:  # a sync has no reply: the trainer goes on training
            send(reply, 0)
        if error is None and command != "generate":
            try:
                ahead.fill(ahead.served + ahead.K)  # ahead, while the trainer trains the batch just handed over
            except Exception as e:  # noqa: BLE001 - the reply to the next request
                error = e
