import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pythonpath() -> str:
    """PYTHONPATH for a Python a test starts: the repository, and tests/hide_vllm where it hides vLLM."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


# RL_LM_HIDE_VLLM=1: the suite as it runs where vLLM is not installed (tests/hide_vllm), in this process and
# in every one it starts
if os.environ.get("RL_LM_HIDE_VLLM") == "1":
    HIDE_VLLM = str(Path(__file__).resolve().parent / "hide_vllm")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HIDE_VLLM, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, HIDE_VLLM)
    import sitecustomize  # noqa: E402,F401  (this Python started before PYTHONPATH named it)

    sys.path.remove(HIDE_VLLM)

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_MODEL = str(ROOT / "models" / "tiny-sort")


def read_optimizer_state(checkpoint) -> dict:
    """A checkpoint's optimizer/ folder (torch.distributed.checkpoint, one shard per rank) as one
    plain dict: {"state": {parameter name: {"step", "exp_avg", ...}}, "param_groups": [...]}."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(Path(checkpoint) / "optimizer", Path(folder) / "optimizer.pt")
        return torch.load(Path(folder) / "optimizer.pt", weights_only=False)["optimizer"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: learning runs and whole benchmark or real-model runs, minutes "
                                       "each (CI runs them; a quick loop: pytest -m 'not slow')")


@pytest.fixture(scope="session")
def tokenizer():
    from common.models import load_tokenizer

    return load_tokenizer(TINY_MODEL)


@pytest.fixture()
def tiny_policy(tokenizer):
    """The bundled model, freshly loaded in float32 (tests may change its weights)."""
    from common.models import load_policy

    torch.manual_seed(0)
    return load_policy(TINY_MODEL, tokenizer, "float32", "cpu")


# Every vLLM engine a test creates lives until the session ends: dropping one tears down
# vLLM's process-wide parallel state, which breaks the engines still in use. None sleeps
# (sleep mode exists on CUDA only): a script run would leave a shared engine asleep for the
# next test; test_sync simulates sleep mode instead.
ENGINES = []


def keep_engine(engine):
    ENGINES.append(engine)
    return engine


# on a GPU the engines of one session share it: each takes a small slice
GPU_SHARE = 0.08


def device_processes() -> int:
    """How many processes of one job a test may start on this machine's compute device: one a GPU
    on CUDA (each rank takes a GPU of its own; NCCL refuses two ranks on one), any number on CPU
    (gloo: they share the cores)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else sys.maxsize


def need_processes(n: int) -> None:
    """Skips the calling test (or fixture), saying why, if it would start more than device_processes()."""
    if n > device_processes():
        pytest.skip(f"starts {n} processes, one a GPU: this machine has {device_processes()} GPU(s)")


def node_env(node: int) -> dict:
    """The environment of "node" `node` when a test runs several launchers on this one machine: on
    CUDA its own GPU (every node's first rank has LOCAL_RANK 0, and so would take GPU 0), as on
    machines of their own; on CPU nothing."""
    if not torch.cuda.is_available():
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": visible.split(",")[node]}


def logprob_tolerance(args) -> float:
    """vLLM's and the trainer's log-probs of the same tokens agree to ~1e-5 in float32 and
    to ~1e-2 in bfloat16, the default precision on CUDA."""
    from common.setup import Precision

    bf16 = Precision.of(args, "cuda" if torch.cuda.is_available() else "cpu").autocast_dtype is not None
    return 0.1 if bf16 else 1e-3


def vllm_installed() -> bool:
    from common.args import vllm_installed

    return vllm_installed()


NO_VLLM = "needs vLLM, which is not installed here (or hidden: RL_LM_HIDE_VLLM=1)"
needs_vllm = pytest.mark.skipif(not vllm_installed(), reason=NO_VLLM)
"""A test that creates a vLLM engine, or runs a script or worker with one, is skipped where vLLM is absent."""


def vllm_module(name: str = "vllm"):
    """vllm (or its submodule name), imported; where vLLM is absent the calling test (or module) is skipped."""
    return pytest.importorskip(name, reason=NO_VLLM)


def vllm_sampling_params(**kwargs):
    """vLLM's SamplingParams(**kwargs); skips the calling test where vLLM is absent."""
    return vllm_module().SamplingParams(**kwargs)


@pytest.fixture(scope="session")
def llm():
    """One in-process vLLM engine for the whole session (an engine takes seconds to start); skips the test
    where vLLM is absent."""
    from common.engine import create_engine

    vllm_module()
    return keep_engine(create_engine(TINY_MODEL, seed=0, max_model_len=64, gpu_memory_utilization=GPU_SHARE,
                                     sleep_mode=False))


@pytest.fixture()
def run_main(request, monkeypatch):
    """run_main("grpo.py", *flags): the script's main() in this process, from a command line
    parsed as its __main__ parses it; returns the parsed arguments. A new engine costs
    seconds, so runs share one: the session's on the tiny model, or the `engine` given for
    another model. main() syncs its policy into the engine first, as into a fresh one. --engine auto
    is the transformers engine where vLLM is absent; a vLLM run there is skipped."""
    from common.args import parse_args
    from common.engine import create_engine
    from common.scripts import load_script
    from common.setup import choose_engine

    monkeypatch.chdir(ROOT)  # the scripts' default model is a relative path

    def run(script: str, *flags, engine=None):
        module = load_script(script)
        args = parse_args(module.Args, [str(f) for f in flags])
        choose_engine(args)  # as main() does first
        if args.engine == "vllm" and not vllm_installed():  # asked for by name (the tiny model's `llm` skips too)
            pytest.skip(NO_VLLM)
        if args.engine == "transformers":  # no engine of its own to share: the policy samples
            module.main(args)
            return args
        if engine is None and os.path.isdir(args.model) and os.path.samefile(args.model, TINY_MODEL):
            engine = request.getfixturevalue("llm")

        def shared_engine(name_or_path, **kwargs):
            if engine is None:  # another model: a new engine, kept (see ENGINES)
                return keep_engine(create_engine(name_or_path, **{**kwargs, "gpu_memory_utilization": GPU_SHARE,
                                                                  "sleep_mode": False}))
            max_len = engine.llm_engine.vllm_config.model_config.max_model_len
            assert kwargs["max_model_len"] <= max_len, (kwargs, max_len)
            return engine

        monkeypatch.setattr(module, "create_engine", shared_engine)
        module.main(args)
        return args

    return run
