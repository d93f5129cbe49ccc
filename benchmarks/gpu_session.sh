#!/usr/bin/env bash
# Everything a session with one GPU runs, in one command (about 6 minutes on an H100):
#   bash benchmarks/gpu_session.sh OUT_DIR
# 1. benchmarks/gpu_check.py: CUDA exactness, QLoRA exactness, stock / DP / Opacus at Llama 8 x 2048, a profile;
# 2. benchmarks/llm_memory.py on CUDA at issue 30's shape (Llama 8 x 256, vocabulary 16k, T 1024, B 4) and at
#    two corners of its grid (width 1024, vocabulary 32k, T 2048, B 1; width 512, T 512, B 2): stock and DP.
# Each step has its own time limit; a step that fails leaves the others' results.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_DP_CACHE=${HF_DP_CACHE:-/tmp/hf_dp_cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.txt" 2>&1
timeout 280 python3 -u benchmarks/gpu_check.py --out "$out/gpu_check.json" --budget-s 200 > "$out/gpu_check.log" 2>&1
echo "gpu_check: exit $?"
memory() {  # NAME, then llm_memory.py's arguments
  local name=$1
  shift
  timeout 85 python3 -u benchmarks/llm_memory.py --device cuda --variants stock dp --rounds 3 \
    --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}
memory llm_memory_cuda_8x256 --hidden 256 --intermediate 704 --vocab 16000 --seq-lens 1024 --batch 4 \
  --settings '*-ckpt-T1024' 'full-fp32-nockpt-T1024'
memory llm_memory_cuda_8x1024 --hidden 1024 --intermediate 2816 --vocab 32000 --seq-lens 2048 --batch 1 \
  --settings '*-fp32-ckpt-T2048'
memory llm_memory_cuda_8x512 --seq-lens 512 --batch 2 --settings '*-fp32-ckpt-T512'
