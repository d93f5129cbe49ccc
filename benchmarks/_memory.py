"""A process's peak resident memory on Linux, for the memory benchmarks (step_speed.py, llm_memory.py).

VmHWM in ``/proc/self/status`` is the peak RSS; writing 5 to ``/proc/self/clear_refs`` resets it, so the peak
of a stretch of steps is read as VmHWM after a reset. Linux carries a process's peak RSS across fork + exec:
a child started directly from a (large) process reports that process's peak as its own ru_maxrss, so
benchmarks start their measuring child through ``LAUNCHER``, a tiny process in between that gives the child
a fresh count.
"""

from __future__ import annotations

import re
from pathlib import Path

LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def vm_hwm_kb() -> int | None:
    """The peak RSS (kB) since the start or the last ``reset_peak_rss``; None where /proc cannot tell."""
    try:
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
