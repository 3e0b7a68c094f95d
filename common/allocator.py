"""On CPU, tcmalloc instead of glibc's malloc, without asking the user to set anything.

vLLM's CPU backend and PyTorch's CPU tuning guide ask for tcmalloc preloaded: the update's
many short-lived tensors are allocated and freed faster (measured here: benchmarks/README.md,
"The allocator"). A library is preloaded only when the process starts, so a script whose
process has not got it yet re-runs itself (the same command, the same PID) with LD_PRELOAD
set, before anything heavy is imported. setup.sh installs it where it can (Debian's
libtcmalloc-minimal4); where it is absent (macOS, no root), everything runs as before.
RL_LM_ALLOCATOR=system keeps glibc's malloc. Imports nothing but the standard library.
"""

from __future__ import annotations

import glob
import os
import sys

LIBRARY = "libtcmalloc_minimal.so.4"


def tcmalloc_path() -> str | None:
    """The installed tcmalloc (Debian / Ubuntu multiarch, or the plain lib folders), or None."""
    for pattern in (f"/usr/lib/*-linux-gnu/{LIBRARY}", f"/usr/lib64/{LIBRARY}", f"/usr/lib/{LIBRARY}",
                    f"/usr/local/lib/{LIBRARY}"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def allocator() -> str:
    """The allocator this process runs with, for args.json and summary.json."""
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "system"


def use_tcmalloc() -> None:
    """Re-run this process with tcmalloc preloaded if it is installed, on a machine without an
    NVIDIA GPU (there the CPU's allocator is not what limits), and not preloaded yet. Call it
    first in a script's __main__ path (under torchrun each rank does): what ran before runs again."""
    if (sys.platform != "linux" or os.environ.get("RL_LM_ALLOCATOR") == "system" or allocator() == "tcmalloc"
            or os.path.exists("/proc/driver/nvidia/version")):
        return
    path = tcmalloc_path()
    if path is None:
        return
    preload = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    sys.stdout.flush()
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:  # cannot re-run: go on as we are
        os.environ["LD_PRELOAD"] = preload or ""
