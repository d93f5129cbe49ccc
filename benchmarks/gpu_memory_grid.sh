#!/usr/bin/env bash
# benchmarks/llm_memory.py on CUDA over a sample of issue 30's grid (width 256-1024, T 512-2048, vocabulary
# 16k-32k, B 1-4, T >> width included): stock Trainer and DPTrainer, checkpointing on, full and LoRA, fp32 and
# bf16 at the issue's shape. At most about 9 minutes on an H100 (a setting takes about a minute):
#   bash benchmarks/gpu_memory_grid.sh OUT_DIR [issue]
# With "issue": only the issue's shape (Llama 8 x 256, vocabulary 16k, T 1024, B 4), fp32, full and LoRA.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_memory_grid.sh OUT_DIR [issue]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
memory() {  # NAME SECONDS, then llm_memory.py's arguments
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" python3 -u benchmarks/llm_memory.py --device cuda --variants stock dp --rounds 3 \
    --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}
issue_shape=(--hidden 256 --intermediate 704 --vocab 16000 --seq-lens 1024 --batch 4)
if [[ ${2:-} == issue ]]; then
  memory llm_memory_cuda_8x256 220 "${issue_shape[@]}" --settings '*-fp32-ckpt-T1024'
  exit 0
fi
memory llm_memory_h100_8x256 240 "${issue_shape[@]}" --settings '*-ckpt-T1024'
memory llm_memory_h100_8x1024 160 --hidden 1024 --intermediate 2816 --vocab 32000 --seq-lens 2048 --batch 1 \
  --settings '*-fp32-ckpt-T2048'
memory llm_memory_h100_8x512_T2048 160 --seq-lens 2048 --batch 4 --settings '*-fp32-ckpt-T2048'
