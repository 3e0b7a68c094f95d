"""Several script runs in one torchrun launch, sharing one vLLM engine per rank (an engine
takes seconds to start): `torchrun --nproc-per-node 2 tests/dist_runner.py RUNS.json`, where
RUNS.json is a list of [script, flag, ...]. Each run is the script's main() on its parsed
command line, as its __main__ runs it. Each rank writes its pid to RUNS.json's folder
(pid_RANK), so a test can signal one rank."""

import importlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import dist  # noqa: E402
from common.errors import RunError  # noqa: E402
from common.engine import create_engine  # noqa: E402
from common.args import parse_args  # noqa: E402

MAX_MODEL_LEN = 64


def main(spec: str) -> None:
    os.chdir(ROOT)  # the scripts' default model is a relative path
    dist.init()  # before the engine, as in the scripts
    Path(spec).with_name(f"pid_{dist.rank()}").write_text(str(os.getpid()))
    engine = create_engine("models/tiny-sort", seed=dist.rank(), max_model_len=MAX_MODEL_LEN, sleep_mode=False)

    def shared_engine(name_or_path, **kwargs):
        assert kwargs["max_model_len"] <= MAX_MODEL_LEN, kwargs
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
