"""``keep_freed_memory``: glibc stops serving large tensors with fresh mmaps and keeps freed blocks for
reuse (what DiSK's two evaluations per step need on CPU), unless HF_DP_KEEP_CPU_HEAP=0. Each case runs in
its own interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_dp.cpu_heap import _glibc

PROBE = """
import ctypes, json, torch
from hf_dp.cpu_heap import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_freed_memory()
before = libc.mallinfo2().hblks
x = torch.empty(16 << 20)  # 64 MB, above glibc's largest mmap threshold
mapped = libc.mallinfo2().hblks - before
del x
print(json.dumps({"kept": kept, "mapped": mapped, "free_heap": libc.mallinfo2().fordblks}))
"""


def _probe(keep: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("HF_DP_KEEP_CPU_HEAP", None)
    if keep is not None:
        env["HF_DP_KEEP_CPU_HEAP"] = keep
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc only; elsewhere keep_freed_memory is a no-op")
def test_large_tensors_come_from_the_kept_heap_and_stay_there():
    kept = _probe(None)
    assert kept["kept"] and kept["mapped"] == 0 and kept["free_heap"] >= 64 << 20


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_opting_out_leaves_glibc_mapping_large_tensors():
    default = _probe("0")
    assert not default["kept"] and default["mapped"] == 1
