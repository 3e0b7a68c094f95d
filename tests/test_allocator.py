"""On CPU the scripts run with tcmalloc when it is installed (common/allocator.py, setup.sh installs
it): the process re-runs itself with the library preloaded, once, as the same process (same PID:
torchrun and signals see no difference); RL_LM_ALLOCATOR=system keeps the system malloc. A script
run records which one ran (tests/test_runs.py, the SIGTERM test)."""

import os
import subprocess
import sys

import pytest

from common.allocator import tcmalloc_path
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(tcmalloc_path() is None, reason="tcmalloc is not installed (setup.sh installs it)")

# what the scripts do first, then what this process is running with
PROBE = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r}); from common.allocator import allocator, use_tcmalloc; "
         "use_tcmalloc(); print(allocator(), os.getpid(), 'libtcmalloc' in open('/proc/self/maps').read())")


def probe(**env) -> tuple[list[str], int]:
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RL_LM_ALLOCATOR")}
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env={**environment, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.split(), proc.pid


def test_a_script_process_re_runs_itself_with_tcmalloc_loaded():
    (name, pid, loaded), started = probe()
    assert (name, loaded) == ("tcmalloc", "True")  # in the process's memory map, not only named
    assert int(pid) == started  # exec: the same process


def test_rl_lm_allocator_system_keeps_the_system_malloc():
    (name, _, loaded), _ = probe(RL_LM_ALLOCATOR="system")
    assert (name, loaded) == ("system", "False")
