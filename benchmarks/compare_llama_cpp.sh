#!/usr/bin/env bash
# Compare mla-deploy with llama.cpp on one checkpoint in one command (see benchmarks/llama_compare/__main__.py):
#   benchmarks/compare_llama_cpp.sh CHECKPOINT [--out DIR] [--weights float,int8,int4] [--context 0,1024] [--threads 2]
#       [--rounds 3] [--pairs 0] [-r 3] [-p 512] [-n 128] [--our-repeat 10] [--version 0.3.36] [--cache DIR] [--dry-run]
# The Python is $COMPARE_PYTHON, else the project's .venv, else python3 (it needs mla-deploy installed).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${COMPARE_PYTHON:-}" ]; then
    py="$COMPARE_PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
    py="$repo/.venv/bin/python"
else
    py="$(command -v python3)"
fi
export PYTHONPATH="$repo/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m llama_compare "$@"
