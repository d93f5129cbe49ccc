"""Shared test set-up: offline Hugging Face, tiny models built from configs, brute-force references."""

from __future__ import annotations

import gc
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_dp_tests_hf_home_"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DP_CACHE", tempfile.mkdtemp(prefix="hf_dp_tests_cache_"))  # BandMF strategies

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n 2 (the README's command): one core per worker
    os.environ["OMP_NUM_THREADS"] = "1"  # and per process it launches
    torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*bos_token_id.*")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# The longest files first, longest to shortest (seconds under pytest -n 2, 2026-11-27): pytest -n 2 --dist loadfile
# then hands out whole files longest first, so neither worker is left with a long file at the end.
LONGEST_FIRST = (
    "test_distributed.py",  # 342
    "test_audit.py",  # 339
    "test_crash_safety.py",  # 174
    "test_families.py",  # ~90 (45 families and LoRA variants, two steps each against brute force)
    "test_recipe_smollm2_defaults.py",  # 80 (converts SmolLM2 once; SFT and table2text from it)
    "test_benchmark_optimizers_smoke.py",  # 45
    "test_stp_study_smoke.py",  # 45
    "test_recipe_qlora.py",  # 44
    "test_smollm2.py",  # 40 (one-thread run: converts SmolLM2's GGUF once, ~20 s)
    "test_groupwise.py",  # 40
    "test_flattened_rows.py",  # ~40
    "test_recipe_glue.py",  # 38
    "test_example_run_clm.py",  # 34
    "test_recipe_table2text.py",  # 31
    "test_cpu_heap.py",  # 28
    "test_real_data.py",  # 24
    "test_recipe_sft_dpo.py",  # 23
    "test_checkpointing.py",  # 22
    "test_checkpointed_families.py",  # ~25 (21 families + 5 kept float64, one process and ZeRO-2, 3 steps each)
    "test_notebook.py",  # 21
    "test_trainer_optimizers.py",  # 18
    "test_trainer.py",  # 17
    "test_accounting.py",  # 17
    "test_benchmark_smoke.py",  # 15
    "test_bandmf_strategy.py",  # 14
    "test_privacy_units.py",  # 12
    "test_bandmf.py",  # 12
    "test_gpu_check_smoke.py",  # 11
)


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first; tests that read ../shared/data are marked ``requires_shared_data``: without the
    folder they skip (CI has it)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.requires_shared_data)


def pytest_collection_finish(session) -> None:
    """What the imports and the collection made lives for the whole run: freeze it out of the garbage collector's
    sweeps. Every ``Trainer.train`` (accelerate's ``free_memory``) and every full automatic collection would
    otherwise walk its ~570k objects, 0.6 s a time."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is missing: this test reads real data from ../shared/data")
    return SHARED_DATA
