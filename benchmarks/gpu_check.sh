#!/usr/bin/env bash
# The GPU check of docs/gpu-verification.md: prepare (here), install and run (on the GPU machine), plan.
#   benchmarks/gpu_check.sh prepare [--update-doc]
#   benchmarks/gpu_check.sh install
#   benchmarks/gpu_check.sh run [--dry-run] [--out DIR] [--steps LIST] [--models LIST] [--precisions LIST] [--budget S]
# The Python is $GPU_CHECK_PYTHON, else the project's .venv (here), else python3 (the GPU machine's, with torch).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    py="$GPU_CHECK_PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
    py="$repo/.venv/bin/python"
else
    py="$(command -v python3)"
fi
export PYTHONPATH="$repo/benchmarks:$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m gpu_check "$@"
