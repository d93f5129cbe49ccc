#!/usr/bin/env bash
# benchmarks/llm_memory.py on CUDA over a sample of issue 30's grid (width 256-1024, T 512-2048, vocabulary
# 16k-32k, B 1-4, T >> width included): stock Trainer and DPTrainer, checkpointing on. A setting takes about a
# minute (a fresh process per variant); each group has its own time limit:
#   bash benchmarks/gpu_memory_grid.sh OUT_DIR [session]
# "session" (what benchmarks/gpu_session.sh runs after gpu_check, about 6 minutes): full fine-tuning in fp32 and
# bf16 at T 1024, B 4, at the issue's shape (Llama 8 x 256, vocabulary 16k) and at 8 x 1024, vocabulary 32k.
# Without it (about 9 minutes): the issue's shape with LoRA too, 8 x 1024 at T 2048, B 1, and 8 x 512 at T 2048.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_memory_grid.sh OUT_DIR [session]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
memory() {  # NAME SECONDS, then llm_memory.py's arguments
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" python3 -u benchmarks/llm_memory.py --device cuda --variants stock dp --rounds 5 \
    --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}
issue_shape=(--hidden 256 --intermediate 704 --vocab 16000 --seq-lens 1024 --batch 4)
wide_shape=(--hidden 1024 --intermediate 2816 --vocab 32000)
if [[ ${2:-} == session ]]; then
  memory llm_memory_cuda_8x256 200 "${issue_shape[@]}" --settings 'full-*-ckpt-T1024'
  memory llm_memory_cuda_8x1024 170 "${wide_shape[@]}" --seq-lens 1024 --batch 4 --settings 'full-*-ckpt-T1024'
  exit 0
fi
memory llm_memory_cuda_8x256 240 "${issue_shape[@]}" --settings '*-ckpt-T1024'
memory llm_memory_cuda_8x1024_T2048 160 "${wide_shape[@]}" --seq-lens 2048 --batch 1 --settings '*-fp32-ckpt-T2048'
memory llm_memory_cuda_8x512_T2048 160 --seq-lens 2048 --batch 4 --settings '*-fp32-ckpt-T2048'
