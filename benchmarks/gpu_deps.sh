#!/usr/bin/env bash
# The pure-Python packages the scripts need beyond torch, transformers and peft (tyro and its two
# dependencies), into .gpu_deps/ (git-ignored), for a GPU machine that has those three but no
# internet: run it here, carry .gpu_deps/ there; benchmarks/gpu_check.py puts it on the path.
# tyro's version is requirements.txt's; its dependencies' are those setup.sh installs with it.
set -euo pipefail
cd "$(dirname "$0")/.."
tyro=$(grep '^tyro==' requirements.txt)
python3 -m pip install --quiet --no-deps --upgrade --target .gpu_deps "$tyro" docstring-parser==0.18.0 typeguard==4.6.1
echo "gpu_deps.sh: $tyro and its dependencies in .gpu_deps/ ($(du -sh .gpu_deps | cut -f1))"
