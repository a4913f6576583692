"""Pinned host memory: exact-size page-locked tensors (:func:`pinned_empty`) and how large a
pinned host pool this machine gives (``host_pool_gib="auto"``).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
every request up to a power of two (torch 2.11-2.13: ``PowerOf2Ceil``): a 66 GiB pool asks the
driver for 128 GiB (on a 125 GiB H100 host one such 66 GiB request failed, an exact one
pinned). That rounding accounts for the "72-80 GiB ceiling" measured on the H200 VM (a 72 GiB
pool is 60 GiB of rows and 12 of keys, 64 + 16 GiB pinned; 80 GiB asks for 128 + 16).
:func:`pinned_empty` calls ``cudaHostAlloc`` for the exact size instead (the libcudart torch
loaded, through ``ctypes``) and frees it with ``cudaFreeHost`` when the last view dies.

:func:`registered_host_allocator` page-locks an anonymous ``mmap`` instead (``cudaHostRegister``;
on huge pages if asked): ``pinned_empty(..., allocator)`` takes it (``hisparse bench
--host-pin huge``); the engine's pool keeps ``cudaHostAlloc``.

On CUDA :func:`probe_pinnable_bytes` pins chunks (:func:`pinned_empty`) until one fails or
``limit`` is reached, then frees them all; :func:`auto_host_pool_bytes` is that minus a
headroom. Pinning costs ~0.45 s per GiB (DESIGN section 7), so the probe doubles the pool's
start-up pinning time: pass a number where it is known (``benchmarks/probe_pinned.py``
measures it, and compares the methods). Without CUDA nothing is pinned and the pool is a
fraction of the available memory.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GIB = 1 << 30
PROBE_CHUNK = 4 * GIB
HEADROOM_FRACTION = 0.1        # of the pinnable size, left for the rest of the process
MIN_HEADROOM = 2 * GIB
CPU_FRACTION = 0.5             # of MemAvailable, without CUDA


@dataclass(frozen=True)
class HostAllocator:
    """Raw page-locked host memory: ``alloc(nbytes)`` returns an address (raises
    ``RuntimeError`` naming the size when it cannot), ``free(address)`` releases it."""

    alloc: Callable[[int], int]
    free: Callable[[int], None]


@functools.cache
def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process (torch) loaded, else one the loader finds."""
    torch.cuda.init()
    names = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)     # address perms offset dev inode path
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith("libcudart.so") and path not in names:
                    names.append(path)
    except OSError:
        pass
    if torch.version.cuda:      # torch's major version before a toolkit's unversioned name
        names.append(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    names.append("libcudart.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                          ctypes.c_uint]
            lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaGetLastError.argtypes = []
            return lib
        except (OSError, AttributeError):
            continue
    return None


def cuda_host_allocator() -> HostAllocator | None:
    """``cudaHostAlloc`` (default flags: portable, device-addressable under unified
    addressing, as torch's own pinned memory) and ``cudaFreeHost``; ``None`` if no CUDA
    runtime library can be opened."""
    lib = _libcudart()
    if lib is None:
        return None

    def alloc(nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        rc = lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0)
        if rc != 0 or not ptr.value:
            # read (clear) the runtime's sticky last error, as torch's allocator does: left
            # pending, torch's next kernel-launch check would raise it as its own
            lib.cudaGetLastError()
            raise RuntimeError(f"cudaHostAlloc of {nbytes / GIB:.2f} GiB failed (cudaError "
                               f"{rc})")
        return ptr.value

    def free(address: int) -> None:
        if lib.cudaFreeHost(ctypes.c_void_p(address)) != 0:
            lib.cudaGetLastError()

    return HostAllocator(alloc, free)


_MAP_FAILED = ctypes.c_void_p(-1).value
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def registered_host_allocator(huge_pages: bool) -> HostAllocator:
    """Anonymous ``mmap`` regions page-locked by ``cudaHostRegister`` (portable, mapped),
    unregistered and unmapped on free. ``huge_pages``: the region is 2 MiB aligned and advised
    ``MADV_HUGEPAGE`` before it is touched, so transparent huge pages back it where the kernel
    allows (a warning where the kernel refuses the advice); else advised ``MADV_NOHUGEPAGE``
    (4 KiB pages whatever the kernel's default). Measured on an H100 host (docs/BENCHMARKS.md,
    twenty-third session): the GPU's scattered reads of such a region are no faster than of a
    ``cudaHostAlloc`` one, but it pins ~1.8x faster. Raises ``RuntimeError`` if no CUDA runtime
    library can be opened."""
    lib = _libcudart()
    if lib is None:
        raise RuntimeError("registered_host_allocator: no CUDA runtime library to call")
    libc = _libc()
    prot, flags = 0x1 | 0x2, 0x02 | 0x20        # PROT_READ | PROT_WRITE, MAP_PRIVATE | ANON
    spans: dict[int, tuple[int, int]] = {}      # address -> (mapping start, mapping length)

    def alloc(nbytes: int) -> int:
        pad = HUGE_PAGE if huge_pages else 0
        length = nbytes + pad
        base = libc.mmap(None, length, prot, flags, -1, 0)
        if base is None or base == _MAP_FAILED:
            raise RuntimeError(f"mmap of {nbytes / GIB:.2f} GiB failed (errno "
                               f"{ctypes.get_errno()})")
        address = -(-base // HUGE_PAGE) * HUGE_PAGE if huge_pages else base
        advice = _MADV_HUGEPAGE if huge_pages else _MADV_NOHUGEPAGE
        if libc.madvise(ctypes.c_void_p(address), nbytes, advice) != 0 and huge_pages:
            warnings.warn(f"registered_host_allocator: madvise(MADV_HUGEPAGE) refused (errno "
                          f"{ctypes.get_errno()}): the region has 4 KiB pages", stacklevel=2)
        rc = lib.cudaHostRegister(ctypes.c_void_p(address), nbytes, 0x1 | 0x2)
        if rc != 0:
            lib.cudaGetLastError()      # not left for torch's next launch check
            libc.munmap(ctypes.c_void_p(base), length)
            raise RuntimeError(f"cudaHostRegister of {nbytes / GIB:.2f} GiB failed "
                               f"(cudaError {rc})")
        spans[address] = (base, length)
        return address

    def free(address: int) -> None:
        base, length = spans.pop(address)
        if lib.cudaHostUnregister(ctypes.c_void_p(address)) != 0:
            lib.cudaGetLastError()
        libc.munmap(ctypes.c_void_p(base), length)

    return HostAllocator(alloc, free)


class _Allocation:
    """Owns one region of an allocator; frees it when garbage (the tensor's buffer holds it)."""

    def __init__(self, allocator: HostAllocator, nbytes: int) -> None:
        self.allocator, self.address = allocator, None
        self.address = allocator.alloc(nbytes)

    def __del__(self) -> None:
        if self.address is not None:        # None: the allocation raised
            self.allocator.free(self.address)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype,
                 allocator: HostAllocator | None = None) -> torch.Tensor:
    """An uninitialised contiguous host tensor of exactly ``shape`` and ``dtype``, page-locked
    without torch's power-of-two rounding (module docstring): one ``allocator`` region
    (default :func:`cuda_host_allocator`), freed when the last view of the tensor dies.
    Without CUDA (and no ``allocator``): an ordinary ``torch.empty``. An empty shape, or no
    CUDA runtime library to call, falls back to ``torch.empty(..., pin_memory=True)`` (the
    latter with a warning: its rounding may refuse a pool that fits). Raises ``RuntimeError``
    naming the size when the memory cannot be pinned."""
    shape = tuple(int(n) for n in shape)
    if allocator is None:
        if not torch.cuda.is_available():
            return torch.empty(shape, dtype=dtype)
        allocator = cuda_host_allocator()
        if allocator is None:
            warnings.warn("pinned_empty: no CUDA runtime library to call; torch's pinned "
                          "allocator rounds the size up to a power of two", stacklevel=2)
            return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
    owner = _Allocation(allocator, nbytes)
    buf = (ctypes.c_uint8 * nbytes).from_address(owner.address)
    buf._owner = owner      # the tensor's storage keeps ``buf`` alive, ``buf`` the region
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def meminfo_bytes(key: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemAvailable``, ``AnonHugePages``, ...) in bytes, or
    ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_memory_bytes() -> int:
    """Host memory this process may still use: MemAvailable from /proc/meminfo (else total
    physical memory), at most what its cgroup's limit leaves (:func:`cgroup_room_bytes`): in a
    container MemAvailable is the host's, and pinning past the cgroup's limit is answered by
    the OOM killer, not by an error."""
    avail = meminfo_bytes("MemAvailable")
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_room_bytes()
    return avail if room is None else min(avail, room)


def cgroup_room_bytes(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                      ) -> int | None:
    """Bytes this process's cgroup memory limits still leave, or ``None`` when no limit is set
    or none can be read. Usage counts page cache, which the kernel reclaims before it kills
    anyone, so the working set is usage less inactive file pages. cgroup v2: the smallest
    ``memory.max - (memory.current - inactive_file)`` over the process's cgroup and its
    ancestors (a slice or pod limit binds too); v1: ``memory.limit_in_bytes`` (and
    ``hierarchical_memory_limit``, the ancestors') less ``memory.usage_in_bytes -
    total_inactive_file``. A cgroup directory not mounted in this namespace falls back to the
    controller's mounted root."""
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
        if "memory" in controllers.split(","):
            return _cgroup_v1_room(os.path.join(root, "memory"), path)
    for line in lines:
        if line.startswith("0::"):
            return _cgroup_v2_room(root, line[3:])
    return None


def _memory_stat(where: str) -> dict[str, int]:
    try:
        with open(os.path.join(where, "memory.stat")) as f:
            return {k: int(v) for k, v in (ln.split() for ln in f if len(ln.split()) == 2)}
    except (OSError, ValueError):
        return {}


def _read_int(where: str, name: str) -> int | None:
    """An integer file of a cgroup directory; ``None`` if absent, unreadable or ``max``."""
    try:
        with open(os.path.join(where, name)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _cgroup_v2_room(root: str, path: str) -> int | None:
    rel = path.strip("/")
    if not os.path.isdir(os.path.join(root, rel)):
        rel = ""                        # not mounted in this namespace: the mount root
    parts = rel.split("/") if rel else []
    # the cgroup, then each ancestor up to the mount root
    dirs = [os.path.join(root, *parts[:k]) for k in range(len(parts), -1, -1)]
    rooms = []
    for d in dirs:
        limit, usage = _read_int(d, "memory.max"), _read_int(d, "memory.current")
        if limit is None or usage is None:
            continue
        usage -= _memory_stat(d).get("inactive_file", 0)
        rooms.append(max(0, limit - max(usage, 0)))
    return min(rooms) if rooms else None


def _cgroup_v1_room(base: str, path: str) -> int | None:
    own = os.path.join(base, path.strip("/"))
    for d in (own, base) if own != base else (base,):
        limit, usage = (_read_int(d, "memory.limit_in_bytes"),
                        _read_int(d, "memory.usage_in_bytes"))
        if limit is None or usage is None:
            continue
        stat = _memory_stat(d)
        limit = min(limit, stat.get("hierarchical_memory_limit", limit))
        if limit >= 1 << 60:            # v1's "no limit" is a page-rounded 2^63 - 1
            return None
        usage -= stat.get("total_inactive_file", 0)
        return max(0, limit - max(usage, 0))
    return None


def probe_pinnable_bytes(limit: int, chunk: int = PROBE_CHUNK) -> int:
    """Bytes of pinned memory obtainable now, pinned ``chunk`` at a time (the last piece
    smaller), at most ``limit`` (CUDA); everything pinned is freed before returning."""
    held: list[torch.Tensor] = []
    total = 0
    try:
        while total < limit:
            n = min(chunk, limit - total)       # the last piece may be smaller
            try:
                held.append(pinned_empty((n,), torch.uint8))
            except RuntimeError:
                break
            total += n
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
    if pinnable >= limit:                   # the probe reached its limit: no pin failed
        return pinnable
    return max(0, pinnable - headroom(pinnable))
