"""Several script runs in one torchrun launch, sharing one vLLM engine per rank (an engine
takes seconds to start; a run with --engine transformers gets its own):
`torchrun --nproc-per-node 2 tests/dist_runner.py RUNS.json`, where RUNS.json is a list of
[script, flag, ...]. Each run is the script's main() on its parsed
command line, as its __main__ runs it. Each rank writes its pid to RUNS.json's folder
(pid_RANK), so a test can signal one rank.

With RECORD_COLLECTIVES=FOLDER each rank also writes FOLDER/collectives_RANK.json: every
collective it called, with the device types it was handed and from where (`record_collectives`)."""

import atexit
import collections
import functools
import importlib
import inspect
import json
import os
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed._functional_collectives as funcol

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = Path(torch.__file__).parent.parent  # where torch (and vllm, ...) are installed
sys.path.insert(0, str(ROOT))

# what communicates, where a torch version has it: torch.distributed's calls, and the functional
# ones (funcol.*) that DTensor's gathers use
COLLECTIVES = {tdist: ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
                       "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
                       "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object",
                       "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
                       "recv_object_list", "barrier", "monitored_barrier"),
               funcol: ("all_reduce", "all_reduce_inplace", "all_gather_tensor", "all_gather_tensor_autograd",
                        "all_gather_single", "all_gather_single_autograd", "all_gather_inplace",
                        "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single",
                        "reduce_scatter_single_autograd", "all_to_all_single", "all_to_all_single_autograd",
                        "broadcast")}
# pickled objects travel, and barriers synchronize, on a device torch picks from the group
ON_GROUP_DEVICE = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                   "send_object_list", "recv_object_list", "barrier", "monitored_barrier"}


def record_collectives(folder: str) -> None:
    """Wraps COLLECTIVES so that this rank writes, at exit, to folder/collectives_RANK.json a list of
    {op, devices, via, callers, count}: the device types of the tensors handed to op (ON_GROUP_DEVICE:
    the one torch picks), the function that called it (torch's or the repository's), and the
    repository's functions on the stack, innermost first. Collectives that torch calls inside a
    recorded one are its business, not recorded; a module that bound torch's functions before this
    ran is not seen."""
    calls = collections.Counter()
    inside = threading.local()

    def wrap(module, name):
        fn, op = getattr(module, name), name if module is tdist else f"funcol.{name}"

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if getattr(inside, "busy", False):
                return fn(*args, **kwargs)
            if name in ON_GROUP_DEVICE:
                group = inspect.signature(fn).bind(*args, **kwargs).arguments.get("group")
                devices = [tdist.distributed_c10d._get_object_coll_device(group)]
            else:
                devices = sorted({t.device.type for t in tensors_in((args, kwargs))})
            frames = [f for f, _ in traceback.walk_stack(sys._getframe(1))]
            callers = [where(f) for f in frames if is_ours(f)]
            calls[op, tuple(devices), where(frames[0]), tuple(callers)] += 1
            inside.busy = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside.busy = False

        setattr(module, name, recorded)
        if module is tdist:  # also for torch's modules that import it from there
            setattr(tdist.distributed_c10d, name, recorded)

    for module, names in COLLECTIVES.items():
        for name in names:
            if hasattr(module, name):
                wrap(module, name)

    def write():
        Path(folder, f"collectives_{os.environ['RANK']}.json").write_text(json.dumps(
            [{"op": op, "devices": list(devices), "via": via, "callers": list(callers), "count": n}
             for (op, devices, via, callers), n in sorted(calls.items())], indent=1))

    atexit.register(write)


def tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from tensors_in(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from tensors_in(item)


def is_ours(frame) -> bool:
    path = Path(frame.f_code.co_filename)
    return path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".venv") and path.parts[-2] != "tests"


def where(frame) -> str:
    """path:function, the path from the repository's root or, in an installed package, from the
    package's folder on (torch/distributed/...)."""
    code = frame.f_code
    path = Path(code.co_filename)
    for base in (PACKAGES, ROOT):
        if path.is_relative_to(base):
            path = path.relative_to(base)
            break
    return f"{path.as_posix()}:{getattr(code, 'co_qualname', code.co_name)}"


if os.environ.get("RECORD_COLLECTIVES"):  # before anything binds torch's functions
    record_collectives(os.environ["RECORD_COLLECTIVES"])

from common import dist  # noqa: E402
from common.errors import RunError  # noqa: E402
from common.engine import create_engine  # noqa: E402
from common.args import parse_args  # noqa: E402

MAX_MODEL_LEN = 64


def main(spec: str) -> None:
    os.chdir(ROOT)  # the scripts' default model is a relative path
    dist.init()  # before the engine, as in the scripts
    Path(spec).with_name(f"pid_{dist.rank()}").write_text(str(os.getpid()))
    engine = None  # vLLM's, started at the first run that asks for it

    def shared_engine(name_or_path, **kwargs):
        nonlocal engine
        if kwargs.get("engine", "vllm") != "vllm":  # the transformers engine starts in no time: the run's own
            return create_engine(name_or_path, **kwargs)
        assert kwargs["max_model_len"] <= MAX_MODEL_LEN, kwargs
        if engine is None:
            engine = create_engine("models/tiny-sort", seed=dist.rank(), max_model_len=MAX_MODEL_LEN, sleep_mode=False)
        return engine

    for script, *flags in json.loads(Path(spec).read_text()):
        module = importlib.import_module(script.removesuffix(".py"))
        module.create_engine = shared_engine
        module.main(parse_args(module.Args, flags))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except RunError as e:
        sys.exit(f"error: {e}")
