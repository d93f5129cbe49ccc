#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the test suite offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu
ruff check hf_dp tests benchmarks examples
python -m pytest -q tests
