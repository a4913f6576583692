"""The ``host_pool_gib="auto"`` sizing: the cgroup's room and the probe's limit (no CUDA: the
probe is replaced by a fake that pins up to a given ceiling)."""

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

    def fake_empty(n, dtype=None, pin_memory=False):
        sizes.append(n)
        return object()

    monkeypatch.setattr(pinned.torch, "empty", fake_empty)
    assert pinned.probe_pinnable_bytes(10 * GIB) == 10 * GIB
    assert sizes == [4 * GIB, 4 * GIB, 2 * GIB]
