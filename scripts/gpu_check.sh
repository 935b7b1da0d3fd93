#!/usr/bin/env bash
# The device check of issue 8 on one NVIDIA GPU, offline, in at most ~8 minutes:
# two Agon steps (and one GRPO step) per generation backend on a Qwen3-0.6B-shaped
# random-weight model; figures and checks to a JSON file (scripts/gpu_check.py --help).
#   scripts/gpu_check.sh [OUT.json] [extra gpu_check arguments, e.g. --dry-run]
# Each backend runs against its own deadline (scripts/gpu_check.py TIME_BUDGET_S, 480 s in all): the vLLM
# share holds Unsloth's engine start-up (torch.compile and CUDA graphs, 1-3 minutes in a fresh runtime).
# `timeout 540` is the hard stop should the check itself hang past its budget.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/gpu_check.json}"
shift || true
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing is downloaded
export TOKENIZERS_PARALLELISM=false
exec timeout 540 "$PY" scripts/gpu_check.py "$OUT" --time-limit 480 "$@"
