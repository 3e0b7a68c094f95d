#!/usr/bin/env bash
# TRL, for benchmarks/vs_trl.py only, into .trl/ (git-ignored): the version that benchmark names,
# without its dependencies, which setup.sh's .venv already has (accelerate, datasets, transformers),
# so that nothing in .venv changes.
set -euo pipefail
cd "$(dirname "$0")/.."
trl=$(.venv/bin/python -c "from benchmarks.vs_trl import TRL_VERSION; print(TRL_VERSION)")
.venv/bin/python -m pip install --quiet --no-deps --upgrade --target .trl "trl==$trl"
echo "trl_deps.sh: trl $trl in .trl/ ($(du -sh .trl | cut -f1))"
