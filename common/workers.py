"""The user's code in worker processes the run can kill: --reward FILE.py:FN, a --task FILE.py:FN's
reward, an --env FILE.py:FN (common/rewards.py, common/tasks.py, common/env.py).

WORKERS, a pool of a few long-lived processes per process of the run (under torchrun, per rank),
runs calls in parallel: WORKERS.map(recipe, calls, timeout). A recipe says how a worker gets the
function (it imports the user's file once, at its first call). A call past `timeout` seconds is
killed with its worker, which is replaced, and answers TIMEOUT; a worker that dies (a segfault,
os._exit, the OOM killer) answers DIED; the run goes on. A time limit in the run's own process
(SIGALRM) cannot promise that: a call can install its own SIGALRM handler, catch BaseException,
sit in one C call that never checks for signals, or leave a never-ending thread that keeps the
process from exiting. A worker is killed whatever it does, and nothing of it outlives the run:
the workers are killed at exit, and die with the run even when it is killed with SIGKILL.

Workers are fresh interpreters (subprocess), not forks: the trainer holds torch's and vLLM's
threads, which a fork would copy in whatever state they are in, and multiprocessing's spawn would
import the script (torch, vLLM) again in every worker. Each call costs a round trip (tens of
microseconds: its arguments and result pickled); a new worker costs a Python start and the import
of the user's file, outside any call's limit (LOAD_S bounds it)."""

from __future__ import annotations

import atexit
import collections
import importlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

from common.errors import ConfigError

OK, RAISED, TIMEOUT, DIED = "ok", "raised", "timeout", "died"  # what a call answers: (kind, value)
LOAD_S = 300.0  # a new worker's start and its import of the user's file, past which it is a one-line error
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool_size() -> int:
    """Workers per process of the run: the cores it may use, shared by the ranks of a node, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class Worker:
    def __init__(self):
        ours, theirs = socket.socketpair()
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from common.workers import serve; serve({theirs.fileno()}, {os.getpid()})"
        # its own session: the terminal's Ctrl-C reaches the run, which stops the workers itself
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(list(sys.path))  # the worker imports what the run would
        self.loaded: set[tuple] = set()

    def kill(self) -> str:
        """Kills it (if it still runs); how it ended, for a message."""
        self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Workers:
    def __init__(self, size: int | None = None):
        self.size, self.idle = size, []
        atexit.register(self.close)

    def map(self, recipe: tuple, calls: list[tuple], timeout: float) -> list[tuple[str, object]]:
        """(kind, value) of each call fn(*args) (args in calls), fn the function `recipe` gives:
        (OK, its result), (RAISED, "Type: message" of what it raised), (TIMEOUT, None) past `timeout`
        seconds (0: no limit) or (DIED, how its worker ended). Calls run in parallel, one a worker."""
        size = self.size or pool_size()
        results: list = [None] * len(calls)
        todo, busy = collections.deque(range(len(calls))), {}  # worker -> (call index, deadline)
        try:
            while todo or busy:
                while todo and len(busy) < size:
                    worker = self.idle.pop() if self.idle else Worker()
                    i, load = todo.popleft(), recipe not in worker.loaded
                    worker.conn.send((recipe, calls[i]))
                    busy[worker] = (i, time.monotonic() + (LOAD_S if load else timeout or float("inf")))
                wait_s = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                for conn in wait([w.conn for w in busy], timeout=None if wait_s == float("inf") else wait_s):
                    worker = next(w for w in busy if w.conn is conn)
                    i, _ = busy[worker]
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        results[i] = (DIED, worker.kill())
                        del busy[worker]
                        continue
                    if kind == "loaded":  # the call itself starts now
                        worker.loaded.add(recipe)
                        busy[worker] = (i, time.monotonic() + (timeout or float("inf")))
                        continue
                    results[i] = (kind, value)
                    del busy[worker]
                    self.idle.append(worker)
                now = time.monotonic()
                for worker, (i, deadline) in list(busy.items()):
                    if now >= deadline:
                        loading = recipe not in worker.loaded
                        worker.kill()
                        results[i] = (RAISED, f"starting a worker and importing took more than {LOAD_S:g} s") \
                            if loading else (TIMEOUT, None)
                        del busy[worker]
        finally:  # a Ctrl-C mid-batch: the calls still running are abandoned with their workers
            for worker in busy:
                worker.kill()
        return results

    def close(self) -> None:
        """Kills every worker: a call's leftover thread cannot keep the run from exiting."""
        while self.idle:
            self.idle.pop().kill()


WORKERS = Workers()


_MODULES: dict[str, object] = {}  # one module object per file: a task and rewards from one file share it


def load_function(spec: str, what: str) -> Callable:
    """'path/to/file.py:name' or 'package.module:name' -> the function; one-line errors that
    name the file, the function and what is wrong."""
    source, colon, name = spec.rpartition(":")
    if not colon or not source or not name:
        raise ConfigError(f"{what} {spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION")
    if source.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(source))
        if not os.path.isfile(path):
            raise ConfigError(f"{what} {spec!r}: file {source!r} does not exist")
        if path not in _MODULES:
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_name = "user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            # registered under its name, so that pickle finds the file's classes: an environment's state
            # holding an object of one goes from a worker to the run and back (common/env.py EnvState)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except (Exception, SystemExit) as e:  # sys.exit() in the file too: not a silent exit
                del sys.modules[module_name]
                raise ConfigError(f"{what} {spec!r}: importing {source!r} failed ({type(e).__name__}: {e})") from None
            _MODULES[path] = module
        module = _MODULES[path]
    else:
        try:
            module = importlib.import_module(source)
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{what} {spec!r}: cannot import module {source!r} ({type(e).__name__}: {e}); "
                              f"a file is written FILE.py:FUNCTION") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{what} {spec!r}: {source!r} has no function {name!r} "
                          f"(it has: {', '.join(public) or 'none'})")
    return fn


def recipe_of(fn: Callable, what: str) -> tuple | None:
    """A recipe that gives fn in a worker, if fn is found by its name in a user's file or a module."""
    name = getattr(fn, "__name__", "")
    for path, module in _MODULES.items():
        if getattr(module, name, None) is fn:
            return "common.workers", "load_function", (f"{path}:{name}", what)
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and module.__name__ != "__main__" and getattr(module, name, None) is fn:
        return "common.workers", "load_function", (f"{module.__name__}:{name}", what)
    return None


def resolve(recipe: tuple):
    """In a worker: the function a recipe (module, name, args) gives: module.name(*args)."""
    module, name, args = recipe
    return getattr(importlib.import_module(module), name)(*args)


def serve(fd: int, run_pid: int) -> None:
    """A worker's life: answer calls until the run closes its end (or dies: then so does the worker)."""
    if sys.platform == "linux":  # killed with the run, even when the run is killed with SIGKILL
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    conn = Connection(fd)
    if os.getppid() != run_pid:  # the run died before prctl
        return
    sys.path[:] = conn.recv()
    functions = {}
    while True:
        try:
            recipe, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # not sys.exit: a call's leftover non-daemon thread would keep it alive
        if recipe not in functions:
            try:
                functions[recipe] = resolve(recipe)
            except BaseException as e:
                conn.send((RAISED, f"{type(e).__name__}: {e}"))
                continue
            conn.send(("loaded", None))
        try:
            out = (OK, functions[recipe](*args))
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: one line in the run
            out = (RAISED, f"{type(e).__name__}: {e}")
        try:
            conn.send(out)
        except Exception as e:  # pickling failed: nothing was sent
            conn.send((RAISED, f"returned {type(out[1]).__name__}, which cannot be sent back to the run ({e})"))
