"""Keep freed CPU memory in the process for reuse, instead of returning it to the kernel (glibc only).

glibc serves every allocation above 32 MB (logits, vocabulary-sized gradients) with a fresh ``mmap``, unmaps
it on free and trims the top of its heap, so each such tensor pays a page fault per 4 KB page every time it
is allocated. DiSK's two evaluations per step allocate twice as many of them; ``mallopt(M_MMAP_MAX, 0)`` and
``mallopt(M_TRIM_THRESHOLD, ∞)`` make glibc reuse freed blocks instead (measured: docs/performance.md and the
README's optimizer cost). The process then keeps its peak heap until it exits, as PyTorch's CUDA caching
allocator does. ``HF_DP_KEEP_CPU_HEAP=0`` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int; 2 GiB of free heap top before a trim is "never" here

_kept = False


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError outside glibc, e.g. musl)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Tell glibc's malloc never to mmap, never to trim (process-wide, once). True if it is now in effect;
    False without glibc or with ``HF_DP_KEEP_CPU_HEAP=0``."""
    global _kept
    if _kept:
        return True
    if os.environ.get("HF_DP_KEEP_CPU_HEAP", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)):
        return False
    _kept = True
    logger.info(
        "hf_dp: glibc malloc keeps freed memory for reuse (no mmap, no trim); HF_DP_KEEP_CPU_HEAP=0 to opt out"
    )
    return True


def is_kept() -> bool:
    """Whether ``keep_freed_memory`` is in effect in this process."""
    return _kept
