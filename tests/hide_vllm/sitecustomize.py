"""RL_LM_HIDE_VLLM=1: `import vllm` fails in this process as it does where vLLM is not installed, so the suite
and the scripts can be run here as a laptop without vLLM runs them (.ci/run). tests/conftest.py imports this
module and puts its folder on PYTHONPATH: every Python the tests start (scripts, torchrun workers) imports it
at start-up, as its sitecustomize, and hides vLLM too."""

import os
import sys


class HideVllm:
    """A finder ahead of all others that refuses vllm and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: RL_LM_HIDE_VLLM=1)", name=name)
        return None


if os.environ.get("RL_LM_HIDE_VLLM") == "1" and not any(type(f).__name__ == "HideVllm" for f in sys.meta_path):
    sys.meta_path.insert(0, HideVllm())
