#!/usr/bin/env bash
# One command from a fresh clone to a working memspec:
#   creates .venv, installs memspec with its test tools (building its native kernels), pulls
#   SmolLM2-135M's GGUF into the model store (the native engine runs it as it is; where ONNX
#   Runtime runs targets, a GPU or no compiler, its fp32 and q4 graphs too), then answers one prompt.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,test]"
.venv/bin/memspec pull smollm2-135m
.venv/bin/memspec generate "What is the capital of France? Answer in one sentence."
