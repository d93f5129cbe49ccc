#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the main job: a short private fine-tuning of MiniLM on SST-2
# (epsilon = 8) on CPU that prints loss and epsilon as it goes, then dev accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python examples/sst2_quickstart.py "$@"
