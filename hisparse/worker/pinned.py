"""How large a pinned host pool this machine gives (``host_pool_gib="auto"``).

On CUDA :func:`probe_pinnable_bytes` pins chunks (``torch.empty(..., pin_memory=True)``:
``cudaHostAlloc``, what the host pool itself uses) until one fails or ``limit`` is reached, then
frees them all; :func:`auto_host_pool_bytes` is that minus a headroom. Pinning costs ~0.45 s per
GiB (DESIGN section 7), so the probe doubles the pool's start-up pinning time: pass a number
where it is known (``benchmarks/probe_pinned.py`` measures it, and compares ``cudaHostAlloc``
with ``cudaHostRegister`` of an mmap'd region). Without CUDA nothing is pinned and the pool is
a fraction of the available memory.
"""

from __future__ import annotations

import gc
import os

import torch

GIB = 1 << 30
PROBE_CHUNK = 4 * GIB
HEADROOM_FRACTION = 0.1        # of the pinnable size, left for the rest of the process
MIN_HEADROOM = 2 * GIB
CPU_FRACTION = 0.5             # of MemAvailable, without CUDA


def available_host_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_pinnable_bytes(limit: int, chunk: int = PROBE_CHUNK) -> int:
    """Bytes of pinned memory obtainable now, in ``chunk`` steps, at most ``limit`` (CUDA);
    everything pinned is freed before returning."""
    held: list[torch.Tensor] = []
    total = 0
    try:
        while total + chunk <= limit:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, pin_memory=True))
            except RuntimeError:
                break
            total += chunk
    finally:
        held.clear()
        gc.collect()
    return total


def auto_host_pool_bytes(cuda: bool) -> int:
    """The ``host_pool_gib="auto"`` size: on CUDA the pinnable size (probed up to
    MemAvailable) less ``max(HEADROOM_FRACTION of it, MIN_HEADROOM)``; else ``CPU_FRACTION``
    of MemAvailable."""
    avail = available_host_memory_bytes()
    if not cuda:
        return int(avail * CPU_FRACTION)
    pinnable = probe_pinnable_bytes(avail)
    return max(0, pinnable - max(int(pinnable * HEADROOM_FRACTION), MIN_HEADROOM))
