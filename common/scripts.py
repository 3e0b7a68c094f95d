"""The algorithm scripts, found rather than registered: every top-level file of the repository
that defines `compute_loss`. The shared tests and the benchmark take their list from here, so a
new method is one new file (copy a script, change its docstring, the algorithm part of its Args
and its loss) and everything that runs the scripts finds it.

What differs between scripts is read from the script itself: its Args (a clip range logs
`policy/clip_frac`, a default `kl_coef` > 0 loads a reference and logs `kl/ref`, no
`num_minibatches` means one update per batch) and the parameters of its `update`.

What a script must define to be found and run: a top-level `compute_loss`, whose parameters take
their names from the shared vocabulary (logprobs, old_logprobs, ref_logprobs, advantages, values,
old_values, returns, vllm_is_weights, mask, args, num_tokens, num_seqs: the tests call it by name,
in any order); `update`, whose parameters after the settings are the rollout-batch tensors it
takes (by the same names); a dataclass `Args`; and `main(args)`. A copy of any script has them."""

import ast
import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def algorithm_scripts() -> list[str]:
    """The algorithm scripts' file names, sorted: grpo.py, ppo.py, ..."""
    return sorted(p.name for p in ROOT.glob("*.py") if re.search(r"^def compute_loss\(", p.read_text(), re.M))


def load_script(script: str):
    """The script as a module (the repository root must be on sys.path)."""
    return importlib.import_module(script.removesuffix(".py"))


def label(script: str) -> str:
    """The algorithm's name as its docstring starts: "GRPO", "PPO", "Dr. GRPO", ...: the words before
    its first colon if they are one or two ("Dr. GRPO: ..."), else its first word ("PPO for RLHF: ...")
    (read, not imported: importing a script imports vLLM)."""
    doc = (ast.get_docstring(ast.parse((ROOT / script).read_text())) or script).strip()
    head = doc.split(":", 1)[0] if ":" in doc.split("\n", 1)[0] else ""
    return head if 0 < len(head.split()) <= 2 else re.split(r"[:\s]", doc, maxsplit=1)[0]


def update_inputs(script: str) -> list[str]:
    """The rollout-batch tensors the script's update takes (after the models, optimizer and settings)."""
    params = list(inspect.signature(load_script(script).update).parameters)
    return params[params.index("input_ids"):]
