"""Pinned host memory: the ``host_pool_gib="auto"`` sizing (the cgroup's room and the probe's
limit; no CUDA: the probe is replaced by a fake that pins up to a given ceiling), exact-size
regions and registered (huge-page) mappings (a fake CUDA runtime on the CPU; the real one in
the ``gpu`` tests)."""

from __future__ import annotations

import pytest

from hisparse.worker import pinned

GIB = 1 << 30


def _cgroup(tmp_path, proc_lines: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_lines)
    return str(root), str(proc)


def test_cgroup_v2_room_is_limit_less_the_working_set(tmp_path):
    """Page cache (inactive file pages) is not counted: the kernel reclaims it first."""
    root, proc = _cgroup(tmp_path, "0::/job\n", {
        "job/memory.max": f"{100 * GIB}\n", "job/memory.current": f"{97 * GIB}\n",
        "job/memory.stat": f"anon {7 * GIB}\ninactive_file {90 * GIB}\n"})
    assert pinned.cgroup_room_bytes(root, proc) == 93 * GIB


def test_cgroup_v2_parent_limit_binds(tmp_path):
    """A slice's (or pod's) limit above the process's own unlimited cgroup still binds."""
    root, proc = _cgroup(tmp_path, "0::/slice/job\n", {
        "slice/memory.max": f"{64 * GIB}\n", "slice/memory.current": f"{10 * GIB}\n",
        "slice/job/memory.max": "max\n", "slice/job/memory.current": f"{8 * GIB}\n"})
    assert pinned.cgroup_room_bytes(root, proc) == 54 * GIB


def test_cgroup_v1_room_falls_back_to_the_mounted_root(tmp_path):
    # inside a container the process's own path is not mounted: the controller's root is
    root, proc = _cgroup(tmp_path, "5:devices:/\n4:memory:/docker/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": f"{(1 << 63) - 4096}\n",
        "memory/memory.usage_in_bytes": f"{30 * GIB}\n",
        "memory/memory.stat": f"hierarchical_memory_limit {64 * GIB}\n"
                              f"total_inactive_file {26 * GIB}\n"})
    assert pinned.cgroup_room_bytes(root, proc) == 60 * GIB


@pytest.mark.parametrize("files", [{"memory.max": "max\n", "memory.current": "5\n"},
                                   {"memory.max": "junk\n"}, {}])
def test_cgroup_without_a_readable_limit_is_none(tmp_path, files):
    root, proc = _cgroup(tmp_path, "0::/\n", files)
    assert pinned.cgroup_room_bytes(root, proc) is None
    v1 = {"memory/memory.limit_in_bytes": f"{(1 << 63) - 4096}\n",
          "memory/memory.usage_in_bytes": "1\n"}
    root, proc = _cgroup(tmp_path / "v1", "4:memory:/\n", v1)
    assert pinned.cgroup_room_bytes(root, proc) is None


def test_available_memory_is_capped_by_the_cgroup(monkeypatch):
    monkeypatch.setattr(pinned, "cgroup_room_bytes", lambda: 3 * GIB)
    assert pinned.available_host_memory_bytes() <= 3 * GIB


@pytest.mark.parametrize("avail_gib, ceiling_gib",
                         [(125, 1000), (125, 76), (20, 1000), (5, 1000), (1, 8)])
def test_auto_probe_never_pins_the_last_of_the_memory(monkeypatch, avail_gib, ceiling_gib):
    """The probe's limit stays a headroom below the available memory (pinning all of it gets
    the process killed); a pin failure below that limit is a hard ceiling the pool keeps a
    headroom under."""
    avail, ceiling = avail_gib * GIB, ceiling_gib * GIB
    asked = []

    def fake_probe(limit, chunk=pinned.PROBE_CHUNK):
        asked.append(limit)
        return limit if limit <= ceiling else ceiling // chunk * chunk

    monkeypatch.setattr(pinned, "available_host_memory_bytes", lambda: avail)
    monkeypatch.setattr(pinned, "probe_pinnable_bytes", fake_probe)
    got = pinned.auto_host_pool_bytes(cuda=True)
    assert asked == [max(0, avail - pinned.headroom(avail))]
    assert 0 <= got <= asked[0] and got <= ceiling
    if ceiling < asked[0]:      # stopped by a failed pin: a headroom below it
        assert got <= ceiling - pinned.headroom(ceiling) + pinned.PROBE_CHUNK
    else:                       # the probe's whole limit, its last piece under a chunk too
        assert got == asked[0]
    assert got < avail and (avail_gib < 3 or got > 0)


def test_probe_pins_a_last_piece_smaller_than_a_chunk(monkeypatch):
    sizes = []

    def fake_pinned_empty(shape, dtype):
        sizes.extend(shape)
        return object()

    monkeypatch.setattr(pinned, "pinned_empty", fake_pinned_empty)
    assert pinned.probe_pinnable_bytes(10 * GIB) == 10 * GIB
    assert sizes == [4 * GIB, 4 * GIB, 2 * GIB]


# ------------------------------------------------------------------ exact-size pinned tensors
class _CountingAllocator:
    """libc malloc / free with a ledger (stands in for cudaHostAlloc / cudaFreeHost)."""

    def __init__(self, fail_above: int | None = None) -> None:
        import ctypes

        self.libc = ctypes.CDLL(None)
        self.libc.malloc.restype = ctypes.c_void_p
        self.libc.malloc.argtypes = [ctypes.c_size_t]
        self.libc.free.argtypes = [ctypes.c_void_p]
        self.fail_above, self.sizes, self.live = fail_above, [], set()

    def alloc(self, nbytes: int) -> int:
        if self.fail_above is not None and nbytes > self.fail_above:
            raise RuntimeError(f"cannot pin {nbytes} bytes")
        address = self.libc.malloc(nbytes)
        self.sizes.append(nbytes)
        self.live.add(address)
        return address

    def free(self, address: int) -> None:
        assert address in self.live, "freed twice or never allocated"
        self.live.remove(address)
        self.libc.free(address)

    def allocator(self) -> pinned.HostAllocator:
        return pinned.HostAllocator(self.alloc, self.free)


def test_pinned_empty_asks_for_the_exact_size_and_frees_after_the_last_view():
    """Not a power of two (torch's pinned allocator would round 3 x 5 x 7 x 4 B up to 512),
    and the region outlives the tensor while a view of it is alive."""
    import gc

    import torch

    led = _CountingAllocator()
    t = pinned.pinned_empty((3, 5, 7), torch.float32, led.allocator())
    assert led.sizes == [3 * 5 * 7 * 4]
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()
    src = torch.randn(3, 5, 7)
    t.copy_(src)
    view = t[1:, 2]
    del t
    gc.collect()
    assert len(led.live) == 1, "freed while a view was alive"
    assert torch.equal(view, src[1:, 2])
    del view
    gc.collect()
    assert not led.live


def test_pinned_empty_failure_names_the_size_and_keeps_nothing():
    import torch

    led = _CountingAllocator(fail_above=1024)
    with pytest.raises(RuntimeError, match="2048"):
        pinned.pinned_empty((2048,), torch.uint8, led.allocator())
    assert not led.live
    assert pinned.pinned_empty((0, 4), torch.uint8, led.allocator()).shape == (0, 4)
    assert led.sizes == []                  # an empty shape allocates nothing


def test_pinned_empty_without_cuda_is_an_ordinary_tensor(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = pinned.pinned_empty((4, 6), torch.bfloat16)
    assert t.shape == (4, 6) and t.dtype == torch.bfloat16 and not t.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_pinned_empty_on_cuda_is_page_locked_and_device_readable():
    """cudaHostAlloc of a size torch would round (1 GiB + 4 KiB + 656 B rows): pinned, read by a
    zero-copy Triton kernel (the miss gather) and by an async copy, bit for bit."""
    import torch

    from hisparse.ops import gather_rows

    rows, width = (GIB + 4096) // 656 + 1, 656
    host = pinned.pinned_empty((rows, width), torch.uint8)
    assert host.is_pinned() and host.shape == (rows, width)
    g = torch.Generator().manual_seed(7)
    pick = torch.randint(0, rows, (4096,), generator=g)
    data = torch.randint(0, 256, (4096, width), dtype=torch.uint8, generator=g)
    host[pick] = data
    want = host[pick].clone()
    dst = torch.full((4096, width), 0xA5, dtype=torch.uint8, device="cuda")   # poisoned
    gather_rows(host, pick.cuda(), dst)
    assert torch.equal(dst.cpu(), want)
    tail = torch.empty((1024, width), dtype=torch.uint8, device="cuda")
    tail.copy_(host[-1024:], non_blocking=True)
    assert torch.equal(tail.cpu(), host[-1024:])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_failed_pin_leaves_no_cuda_error_behind():
    """A pin past the machine's memory raises naming its size, and torch's next kernel launch
    does not inherit the runtime's sticky error (the probe of ``host_pool_gib="auto"`` ends
    on such a failure)."""
    import os

    import torch

    too_big = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(RuntimeError, match="cudaHostAlloc of"):
        pinned.pinned_empty((too_big,), torch.uint8)
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 999000.0


class _FakeCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` that record what they were given (the
    mapping itself is the real ``mmap``); ``fail``: register answers error 2."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.registered, self.errors_read = fail, {}, 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        assert flags == 3, "portable | mapped"
        if self.fail:
            return 2
        self.registered[ptr.value] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr.value]
        return 0

    def cudaGetLastError(self):
        self.errors_read += 1
        return 0


class _RecordingLibc:
    """The real libc's ``mmap`` / ``munmap`` / ``madvise``, each call recorded."""

    def __init__(self) -> None:
        self.real, self.maps, self.unmaps, self.advice = pinned._libc(), [], [], []

    def mmap(self, addr, length, prot, flags, fd, off):
        base = self.real.mmap(addr, length, prot, flags, fd, off)
        self.maps.append((base, length))
        return base

    def munmap(self, addr, length):
        self.unmaps.append((addr.value, length))
        return self.real.munmap(addr, length)

    def madvise(self, addr, length, advice):
        self.advice.append((addr.value, length, advice))
        return self.real.madvise(addr, length, advice)


@pytest.fixture
def fake_runtime(monkeypatch):
    def install(fail: bool = False):
        fake, libc = _FakeCudart(fail), _RecordingLibc()
        monkeypatch.setattr(pinned, "_libcudart", lambda: fake)
        monkeypatch.setattr(pinned, "_libc", lambda: libc)
        return fake, libc
    return install


@pytest.mark.parametrize("huge", [False, True])
def test_registered_allocator_maps_registers_and_releases(fake_runtime, huge):
    """A region of a size that is no multiple of a page: registered at the address the
    tensor uses (2 MiB aligned and advised huge pages with ``huge``, else advised none),
    writable, unregistered and its whole mapping unmapped when the last view dies."""
    import gc

    import torch

    fake, libc = fake_runtime()
    n = 3 * pinned.HUGE_PAGE + 656
    t = pinned.pinned_empty((n,), torch.uint8, pinned.registered_host_allocator(huge_pages=huge))
    (address, size), = fake.registered.items()
    assert size == n and address == t.data_ptr()
    (base, length), = libc.maps
    pad = pinned.HUGE_PAGE if huge else 0
    assert length == n + pad and base <= address and address + n <= base + length
    assert address % (pinned.HUGE_PAGE if huge else 4096) == 0
    assert libc.advice == [(address, n, 14 if huge else 15)]
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    t.copy_(data)
    view = t[-1000:]
    del t
    gc.collect()
    assert fake.registered and not libc.unmaps, "released while a view was alive"
    assert torch.equal(view, data[-1000:])
    del view
    gc.collect()
    assert not fake.registered and libc.unmaps == [(base, length)]


def test_registered_allocator_failure_unmaps_names_the_size_and_clears_the_error(fake_runtime):
    import torch

    fake, libc = fake_runtime(fail=True)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.06 GiB failed"):
        pinned.pinned_empty((64 << 20,), torch.uint8, pinned.registered_host_allocator(True))
    assert fake.errors_read == 1
    assert libc.unmaps == libc.maps and len(libc.maps) == 1


def test_registered_allocator_without_a_runtime_refuses(monkeypatch):
    monkeypatch.setattr(pinned, "_libcudart", lambda: None)
    with pytest.raises(RuntimeError, match="no CUDA runtime"):
        pinned.registered_host_allocator(huge_pages=True)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("huge", [False, True])
def test_registered_region_is_page_locked_and_device_readable(huge):
    """``cudaHostRegister`` of an mmap (huge pages advised or not): pinned, and the miss
    gather's zero-copy kernel reads it bit for bit."""
    import torch

    from hisparse.ops import gather_rows

    rows, width = (64 << 20) // 656 + 3, 656
    host = pinned.pinned_empty((rows, width), torch.uint8,
                               pinned.registered_host_allocator(huge_pages=huge))
    assert host.is_pinned()
    g = torch.Generator().manual_seed(11)
    pick = torch.randint(0, rows, (2048,), generator=g)
    host[pick] = torch.randint(0, 256, (2048, width), dtype=torch.uint8, generator=g)
    want = host[pick].clone()
    dst = torch.full((2048, width), 0xA5, dtype=torch.uint8, device="cuda")
    gather_rows(host, pick.cuda(), dst)
    assert torch.equal(dst.cpu(), want)


def test_bench_pins_its_pool_on_huge_pages_when_asked(fake_runtime):
    """``hisparse bench --host-pin huge``: both pool tensors (FP8 rows, key pages) come from
    registered 2 MiB-aligned mappings of their exact sizes."""
    import gc

    from hisparse.bench.decode import kv_bytes, pin_host_pool

    fake, libc = fake_runtime()
    rows, keys = pin_host_pool(3, 256, "fp8", 64, "huge")
    row_b, key_b = kv_bytes("fp8")
    assert rows.shape == (3, 256, row_b) and keys.shape == (3, 4, 64 * key_b)
    assert sorted(fake.registered.values()) == sorted([3 * 256 * row_b, 3 * 256 * key_b])
    assert all(a % pinned.HUGE_PAGE == 0 for a in fake.registered)
    assert {rows.data_ptr(), keys.data_ptr()} == set(fake.registered)
    del rows, keys
    gc.collect()
    assert not fake.registered and sorted(libc.unmaps) == sorted(libc.maps)
