#!/usr/bin/env bash
# Everything a session with one GPU runs, in one command (at most about 9.5 minutes on an H100):
#   bash benchmarks/gpu_session.sh OUT_DIR
# 1. benchmarks/gpu_check.py: CUDA exactness (and the wide-factor arithmetic), QLoRA exactness, stock / DP /
#    Opacus at Llama 8 x 2048, a profile;
# 2. benchmarks/llm_memory.py on CUDA, full fine-tuning with checkpointing in fp32 and bf16 at T 1024, B 4:
#    stock and DP at issue 30's shape (Llama 8 x 256, vocabulary 16k) and at 8 x 1024 (more cells:
#    benchmarks/gpu_memory_grid.sh).
# Each step has its own time limit; a step that fails leaves the others' results.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_DP_CACHE=${HF_DP_CACHE:-/tmp/hf_dp_cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.txt" 2>&1
timeout 200 python3 -u benchmarks/gpu_check.py --out "$out/gpu_check.json" --budget-s 150 > "$out/gpu_check.log" 2>&1
echo "gpu_check: exit $?"
bash benchmarks/gpu_memory_grid.sh "$out" session
