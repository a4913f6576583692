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
    """Host memory this process may still use: MemAvailable from /proc/meminfo (else total
    physical memory), at most what its cgroup's limit leaves (:func:`cgroup_room_bytes`): in a
    container MemAvailable is the host's, and pinning past the cgroup's limit is answered by
    the OOM killer, not by an error."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_room_bytes()
    return avail if room is None else min(avail, room)


def cgroup_room_bytes(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                      ) -> int | None:
    """Bytes below this process's cgroup memory limit (limit - usage; cgroup v2 ``memory.max``
    and ``memory.current``, else v1 ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``),
    or ``None`` when no limit is set or none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                                   # v2 unified hierarchy
            files, base = ("memory.max", "memory.current"), os.path.join(root, path.lstrip("/"))
        elif "memory" in controllers.split(","):                # v1 memory controller
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            base = os.path.join(root, "memory", path.lstrip("/"))
        else:
            continue
        for where in (base, os.path.join(root, "memory") if controllers else root):
            try:
                with open(os.path.join(where, files[0])) as f:
                    limit = f.read().strip()
                with open(os.path.join(where, files[1])) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            # "max" (v2) or a v1 limit near 2^63: no limit
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            return max(0, int(limit) - usage)
    return None


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


def headroom(nbytes: int) -> int:
    """What a pool of ``nbytes`` leaves for the rest of the process:
    ``max(HEADROOM_FRACTION of it, MIN_HEADROOM)``."""
    return max(int(nbytes * HEADROOM_FRACTION), MIN_HEADROOM)


def auto_host_pool_bytes(cuda: bool) -> int:
    """The ``host_pool_gib="auto"`` size. On CUDA the probe pins at most the available memory
    less its :func:`headroom` (pinning all of it gets the process killed, not an error: a 125
    GiB H100 host, twenty-first session); a probe stopped by a failed pin is a hard limit,
    and the pool stays a headroom below it. Without CUDA, ``CPU_FRACTION`` of the available
    memory."""
    avail = available_host_memory_bytes()
    if not cuda:
        return int(avail * CPU_FRACTION)
    limit = max(0, avail - headroom(avail))
    pinnable = probe_pinnable_bytes(limit)
    if pinnable + PROBE_CHUNK > limit:      # the probe reached its limit: no pin failed
        return pinnable
    return max(0, pinnable - headroom(pinnable))
