import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_MODEL = str(ROOT / "models" / "tiny-sort")


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


@pytest.fixture(scope="session")
def llm():
    """One in-process vLLM engine for the whole session (an engine takes seconds to start)."""
    from common.models import create_engine

    return create_engine(TINY_MODEL, seed=0, max_model_len=64)
