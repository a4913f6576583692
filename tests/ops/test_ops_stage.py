"""ops.stage: the device-side staging plan (no host sync) equals the reference on random data
(rows, staged bytes, host counter), on the torch path and the Triton kernel (interpreter on
CPU); overflow and unreadable rows are reported and raise, never written out of bounds; the
host-only grouping always fits."""

from __future__ import annotations

import pytest
import torch

from hisparse.ops import stage_rows_reference, staging_union_size
from hisparse.ops.stage import (
    check_stage_status,
    stage_groups_bounded,
    stage_plan,
    stage_rows_device,
)

BS = 4


def case(T=12, K=8, R=3, P=6, D=20, dtype=torch.float32, seed=0, hole=False):
    g = torch.Generator().manual_seed(seed)
    span = P * BS
    n_blocks = R * P + 3
    perm = torch.randperm(n_blocks, generator=g)[:R * P].view(R, P).int()
    resident = torch.where(torch.rand(R, P, generator=g) < 0.4, perm, -1).int()
    host = torch.randperm(R * P + 5, generator=g)[:R * P].view(R, P).int()
    if hole:                                     # a page neither resident nor on host
        resident[0, 1] = -1
        host[0, 1] = -1
    topk = torch.randint(-1, span + 3, (T, K), generator=g).int()   # -1 and past-the-end too
    token_slot = torch.randint(-1, R, (T,), generator=g).int()
    if dtype == torch.uint8:
        arena = torch.randint(0, 255, (n_blocks * BS, D), generator=g, dtype=torch.uint8)
        host_pool = torch.randint(0, 255, ((R * P + 5) * BS, D), generator=g, dtype=torch.uint8)
    else:
        arena = torch.randn(n_blocks * BS, D, generator=g).to(dtype)
        host_pool = torch.randn((R * P + 5) * BS, D, generator=g).to(dtype)
    return topk, token_slot, resident, host, arena, host_pool


def run_both(args, cap, fill=7.0):
    topk, token_slot, resident, host, arena, host_pool = args
    st_ref = torch.full((cap, arena.shape[1]), fill).to(arena.dtype)
    st_dev = st_ref.clone()
    c_ref = torch.zeros(1, dtype=torch.int64)
    c_dev = torch.zeros(1, dtype=torch.int64)
    want = stage_rows_reference(topk, token_slot, resident, host, arena, host_pool, st_ref, BS,
                                counter=c_ref)
    got = stage_rows_device(topk, token_slot, resident, host, arena, host_pool, st_dev, BS,
                            counter=c_dev)
    return want, got, st_ref, st_dev, c_ref, c_dev


@pytest.mark.parametrize("seed", range(6))
def test_device_plan_equals_reference(no_force, seed):
    args = case(seed=seed, T=4 + seed * 3, K=5 + seed)
    n = staging_union_size(args[0], args[1], args[2].shape[1], BS)
    want, got, st_ref, st_dev, c_ref, c_dev = run_both(args, cap=n + seed)
    assert torch.equal(got, want) and got.dtype == torch.int32
    assert torch.equal(st_dev, st_ref) and torch.equal(c_dev, c_ref) and c_ref.item() > 0


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 576), (torch.uint8, 656),
                                     (torch.float32, 5)])
def test_device_plan_triton_interpreter(triton_cpu, dtype, D):
    args = case(seed=3, T=9, K=6, D=D, dtype=dtype)
    n = staging_union_size(args[0], args[1], args[2].shape[1], BS)
    want, got, st_ref, st_dev, c_ref, c_dev = run_both(args, cap=n + 2, fill=3)
    assert torch.equal(got, want)
    assert torch.equal(st_dev, st_ref) and torch.equal(c_dev, c_ref)


def test_plan_count_and_members(no_force):
    topk, slot, resident, host, _, _ = case(seed=5)
    n = staging_union_size(topk, slot, resident.shape[1], BS)
    rows, res_rows, host_rows, count = stage_plan(topk, slot, resident, host, BS, n + 4)
    assert count.item() == n and count.shape == (1,)
    live = torch.arange(n + 4) < n
    # every member has exactly one source; nothing past the union
    assert (((res_rows >= 0) ^ (host_rows >= 0)) == live).all()
    assert set(rows[rows >= 0].tolist()) == set(range(n))


@pytest.mark.parametrize("triton_path", [False, True])
def test_overflow_is_reported_and_writes_nothing(kernel_switches, triton_path):
    if triton_path:
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("interpreter test")
        kernel_switches(force_triton=True)
    else:
        kernel_switches(force_triton=False)
    topk, slot, resident, host, arena, host_pool = case(seed=1, T=16, K=8)
    n = staging_union_size(topk, slot, resident.shape[1], BS)
    cap = n - 1
    staging = torch.full((cap, arena.shape[1]), 9.0)
    with pytest.raises(ValueError, match="exceeds the staging area"):
        stage_rows_reference(topk, slot, resident, host, arena, host_pool, staging.clone(), BS)
    with pytest.raises(ValueError, match=f"union of selected rows \\({n}\\) exceeds"):
        stage_rows_device(topk, slot, resident, host, arena, host_pool, staging, BS)
    status = torch.zeros(2, dtype=torch.int64)
    counter = torch.zeros(1, dtype=torch.int64)
    rows = stage_rows_device(topk, slot, resident, host, arena, host_pool, staging, BS,
                             counter=counter, status=status)   # deferred: no raise here
    assert (rows == -1).all() and (staging == 9.0).all() and counter.item() == 0
    assert status.tolist() == [1, 0]
    with pytest.raises(ValueError, match="exceeds the staging area"):
        check_stage_status(status)


def test_unreadable_member_is_reported(no_force):
    topk, slot, resident, host, arena, host_pool = case(seed=2, hole=True)
    topk[0, 0], slot[0] = BS + 1, 0                 # slot 0, page 1: the hole
    n = staging_union_size(topk, slot, resident.shape[1], BS)
    staging = torch.zeros(n, arena.shape[1])
    with pytest.raises(ValueError, match="neither resident nor on host"):
        stage_rows_reference(topk, slot, resident, host, arena, host_pool, staging.clone(), BS)
    with pytest.raises(ValueError, match="neither resident nor on host"):
        stage_rows_device(topk, slot, resident, host, arena, host_pool, staging, BS)
    status = torch.zeros(2, dtype=torch.int64)
    stage_rows_device(topk, slot, resident, host, arena, host_pool, staging, BS, status=status)
    assert status[0] == 0 and status[1] >= 1


@pytest.mark.parametrize("seed", range(5))
def test_bounded_groups_always_fit(no_force, seed):
    g = torch.Generator().manual_seed(seed)
    T, K, P = 40, 6, 12
    slot = torch.sort(torch.randint(0, 3, (T,), generator=g)).values.int()
    pos = torch.randint(0, P * BS, (T,), generator=g)
    # each token selects K positions of its history [0, pos]
    topk = (torch.rand(T, K, generator=g) * (pos[:, None] + 1)).long().int()
    cap = K * (1 + seed)
    groups = stage_groups_bounded(slot.tolist(), (pos + 1).tolist(), K, cap)
    assert groups[0][0] == 0 and groups[-1][1] == T
    assert all(a < b and b == c for (a, b), (c, _) in zip(groups, groups[1:]))
    for a, b in groups:
        assert staging_union_size(topk[a:b], slot[a:b], P, BS) <= cap
    # short histories: everything fits in one group
    assert stage_groups_bounded([0] * 50, [3] * 50, K, 4) == [(0, 50)]


@pytest.mark.gpu
def test_device_plan_gpu_pinned_host():
    args = list(case(seed=4, T=300, K=64, R=4, P=40, D=576, dtype=torch.bfloat16))
    for i in (0, 1, 2, 3, 4):
        args[i] = args[i].cuda()
    args[5] = args[5].pin_memory()
    topk, slot, resident, host, arena, host_pool = args
    n = staging_union_size(topk, slot, resident.shape[1], BS)
    st_ref = torch.zeros(n + 8, 576, dtype=torch.bfloat16, device="cuda")
    st_dev = st_ref.clone()
    c_ref = torch.zeros(1, dtype=torch.int64, device="cuda")
    c_dev = c_ref.clone()
    status = torch.zeros(2, dtype=torch.int64, device="cuda")
    want = stage_rows_reference(topk, slot, resident, host, arena, host_pool, st_ref, BS,
                                counter=c_ref)
    got = stage_rows_device(topk, slot, resident, host, arena, host_pool, st_dev, BS,
                            counter=c_dev, status=status)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(st_dev, st_ref) and torch.equal(c_dev, c_ref)
    check_stage_status(status)
