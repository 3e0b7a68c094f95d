#!/usr/bin/env bash
# Create .venv and install the GPU set (requirements.txt) when an NVIDIA GPU is present,
# the CPU set (requirements-cpu.txt) otherwise, then requirements-nodeps.txt without
# dependencies. Re-running is cheap: it reinstalls only when one of those files changed.
# Override the choice with RL_LM_DEVICE=cpu|cuda.
set -euo pipefail
cd "$(dirname "$0")"
device="${RL_LM_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case "$device" in
  cuda) reqs=requirements.txt ;;
  cpu) reqs=requirements-cpu.txt ;;
  *) echo "setup.sh: RL_LM_DEVICE must be cpu or cuda, got '$device'" >&2; exit 2 ;;
esac
# tcmalloc, which the scripts preload on CPU (common/allocator.py): Debian's package, where root and apt-get allow
if [ "$device" = cpu ] && [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "setup.sh: could not install libtcmalloc-minimal4: the scripts run with the system malloc"
  else
    echo "setup.sh: no tcmalloc; 'sudo apt-get install libtcmalloc-minimal4' speeds up CPU updates (common/allocator.py)"
  fi
fi
python=${PYTHON:-python3}
# the stamp changes with either requirements file (and so reinstalls)
stamp=.venv/.installed-$(cat "$reqs" requirements-nodeps.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  echo "setup.sh: .venv is up to date ($reqs)"
  exit 0
fi
echo "setup.sh: installing $reqs into .venv ($device)"
[ -d .venv ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r "$reqs"
# packages whose declared dependencies must not be installed (see the file)
.venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
if [ "$device" = cpu ]; then
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import torch, transformers, vllm, math_verify, reasoning_gym, gguf, accelerate, peft; \
print('setup.sh: torch', torch.__version__, \
'| transformers', transformers.__version__, '| vllm', vllm.__version__)"
rm -f .venv/.installed-*
touch "$stamp"
