#!/usr/bin/env bash
# verl and omegaconf, for benchmarks/peer_check.py only, into .verl/ (git-ignored), without verl's other
# dependencies (ray, vLLM's GPU build, ...): the functions compared need none of them, and .venv stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
verl=$(.venv/bin/python -c "from benchmarks.peer_check import VERL_VERSION; print(VERL_VERSION)")
.venv/bin/python -m pip install --quiet --no-deps --upgrade --target .verl "verl==$verl" "omegaconf==2.4.0"
echo "verl_deps.sh: verl $verl in .verl/ ($(du -sh .verl | cut -f1))"
