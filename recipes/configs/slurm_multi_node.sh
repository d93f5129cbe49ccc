#!/usr/bin/env bash
# Private fine-tuning on several machines under Slurm: one `accelerate launch` per machine, all meeting at the
# first machine of the allocation. Submit from the repository root:
#   sbatch --nodes 2 recipes/configs/slurm_multi_node.sh recipes/sft.py --output_dir /shared/run ...
# Every argument after the script is passed to it. A job that is pre-empted or loses a machine is resubmitted
# as it is: --resume_from_checkpoint true continues from the newest checkpoint complete on every machine (with
# the same privacy ledger, secret and noise streams), and starts from scratch when there is none yet.
#SBATCH --job-name=hf-dp
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --output=%x-%j.out
set -euo pipefail

SCRIPT=${1:?usage: sbatch --nodes N recipes/configs/slurm_multi_node.sh SCRIPT [ARGS...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
RESUME=()
if compgen -G "${OUTPUT_DIR:-/nonexistent}/checkpoint-*" > /dev/null; then
  RESUME=(--resume_from_checkpoint true)  # OUTPUT_DIR: set it to the script's --output_dir to resume
fi

# --kill-on-bad-exit: when one machine's processes fail, Slurm stops the others at once (DPTrainer also stops
# them itself, with ProcessLostError, within ddp_timeout).
srun --kill-on-bad-exit=1 bash -c '
  exec accelerate launch --config_file recipes/configs/multi_node.yaml \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * '"$GPUS_PER_NODE"')) \
    --machine_rank "$SLURM_NODEID" --main_process_ip '"$MAIN_IP"' --main_process_port '"$MAIN_PORT"' \
    "$@"' _ "$SCRIPT" "$@" "${RESUME[@]}"
