"""Resolver: reference vs an independent LRU oracle, the issue's scenarios on both backends, and
the Triton kernel (CPU interpreter here, production shapes on the GPU) against the reference."""


import pytest
import torch

from hisparse.ops import resolve_rows, resolve_rows_reference
from hisparse.ops._common import PROTECT_USES

D = 576
BS = 16


class Batch:
    """Request slots with resident/host/hot tables over one or more layers of a packed arena."""

    def __init__(self, R, P, H, layers=1, seed=0, resident_frac=0.0, device="cpu", pin=False,
                 dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        self.R, self.P, self.H, self.L = R, P, H, layers
        HB = (H + BS - 1) // BS
        n_blocks = R * P + R * HB + 3
        perm = torch.randperm(n_blocks, generator=g).to(torch.int32)
        self.res = perm[:R * P].view(R, P).clone()
        self.res[torch.rand(R, P, generator=g) >= resident_frac] = -1
        self.hot = perm[R * P:R * P + R * HB].view(R, HB).clone()
        self.hostbt = torch.randperm(R * P, generator=g).to(torch.int32).view(R, P)
        # packed allocation, one view per layer (each view must carry its own layer offset)
        self.arena_all = torch.randn(layers, n_blocks * BS, D, generator=g).to(dtype)
        host = torch.randn(layers, R * P * BS, D, generator=g).to(dtype)
        self.host_all = host.pin_memory() if pin else host
        self.keys = [torch.full((R, H), -1, dtype=torch.int32) for _ in range(layers)]
        self.lru = [torch.stack([torch.randperm(H, generator=g) for _ in range(R)]).to(torch.int32)
                    for _ in range(layers)]
        self.counters = [torch.zeros(2, dtype=torch.int64) for _ in range(layers)]
        dev = torch.device(device)
        for name in ("res", "hot", "hostbt", "arena_all"):
            setattr(self, name, getattr(self, name).to(dev))
        self.keys = [x.to(dev) for x in self.keys]
        self.lru = [x.to(dev) for x in self.lru]
        self.counters = [x.to(dev) for x in self.counters]
        self.device = dev

    def clone(self):
        c = object.__new__(Batch)
        c.__dict__.update(self.__dict__)
        c.arena_all = self.arena_all.clone()
        c.keys = [x.clone() for x in self.keys]
        c.lru = [x.clone() for x in self.lru]
        c.counters = [x.clone() for x in self.counters]
        return c

    def hot_row(self, r, j):
        return int(self.hot[r, j // BS]) * BS + j % BS

    def host_row(self, r, p):
        return int(self.hostbt[r, p // BS]) * BS + p % BS

    def resolve(self, backend, topk, req, layer=0, monkeypatch=None, out=None):
        args = (topk.to(self.device), req.to(self.device), self.res, self.hostbt, self.hot,
                self.keys[layer], self.lru[layer], self.arena_all[layer], self.host_all[layer], BS,
                self.counters[layer])
        if backend == "reference":
            return resolve_rows_reference(*args)
        return resolve_rows(*args, out=out)


class Oracle:
    """Independent LRU model of one (layer, request) hot buffer: an ordered list of
    (slot, key), most recently used last."""

    def __init__(self, lru, keys):
        self.order = [(s, keys[s]) for s in lru]

    def step(self, union):
        present = {k: s for s, k in self.order if k >= 0}
        hits = [p for p in union if p in present]
        misses = [p for p in union if p not in present]
        hit_slots = {present[p] for p in hits}
        free = [(s, k) for s, k in self.order if s not in hit_slots]
        assert len(misses) <= len(free)
        loaded = [(free[i][0], p) for i, p in enumerate(misses)]
        loaded_slots = {s for s, _ in loaded}
        stay = [(s, k) for s, k in self.order if s not in hit_slots and s not in loaded_slots]
        hit_part = [(s, k) for s, k in self.order if s in hit_slots]
        self.order = stay + loaded + hit_part
        slot_of = {k: s for s, k in self.order if k >= 0}
        return len(hits), len(misses), slot_of

    def lru(self):
        return [s for s, _ in self.order]

    def keys(self, H):
        k = [-1] * H
        for s, key in self.order:
            k[s] = key
        return k


@pytest.fixture(params=["reference", "triton"])
def backend(request, kernel_switches):
    if request.param == "triton":
        if torch.cuda.is_available():
            pytest.skip("interpreter variant runs on CPU-only machines (GPU tests cover CUDA)")
        pytest.importorskip("triton")
        kernel_switches(force_triton=True)
    else:
        kernel_switches(force_triton=False)
    return request.param


def rand_sel(g, n, lo, hi):
    return (torch.randperm(hi - lo, generator=g)[:n] + lo).to(torch.int32)


def check_against_oracle(b, backend, topk, req, oracles, layer=0):
    """Run one step; compare outputs, hot state, counters and arena content with the oracle."""
    before = b.counters[layer].clone()
    poison = torch.full(topk.shape, -7, dtype=torch.int32, device=b.device)
    out = b.resolve(backend, topk, req, layer, out=poison if backend == "triton" else None)
    assert not (out == -7).any()
    T, K = topk.shape
    req_l = req.tolist()
    exp_hits = exp_miss = 0
    t = 0
    while t < T:
        r = req_l[t]
        if r < 0:
            assert (out[t] == -1).all()
            t += 1
            continue
        t1 = t
        while t1 < T and req_l[t1] == r:
            t1 += 1
        union = []
        seen = set()
        for tt in range(t, t1):
            for p in topk[tt].tolist():
                if p >= 0 and int(b.res[r, p // BS]) < 0 and p not in seen:
                    seen.add(p)
                    union.append(p)
        h, m, slot_of = oracles[r].step(union)
        exp_hits += h
        exp_miss += m
        for tt in range(t, t1):
            for k, p in enumerate(topk[tt].tolist()):
                if p < 0:
                    assert out[tt, k] == -1
                elif int(b.res[r, p // BS]) >= 0:
                    assert out[tt, k] == int(b.res[r, p // BS]) * BS + p % BS
                else:
                    assert out[tt, k] == b.hot_row(r, slot_of[p])
                    # the served arena row holds the host row of that position
                    assert torch.equal(b.arena_all[layer][int(out[tt, k])].cpu(),
                                       b.host_all[layer][b.host_row(r, p)].cpu())
        assert b.lru[layer][r].tolist() == oracles[r].lru()
        assert b.keys[layer][r].tolist() == oracles[r].keys(b.H)
        t = t1
    assert (b.counters[layer] - before).tolist() == [exp_hits, exp_miss]
    return out


def new_oracles(b, layer=0):
    return [Oracle(b.lru[layer][r].tolist(), b.keys[layer][r].tolist()) for r in range(b.R)]


def test_cold_start_fills_in_lru_order_then_fixed_point(backend):
    K, H = 24, 48
    b = Batch(R=2, P=8, H=H, seed=1)
    g = torch.Generator().manual_seed(5)
    sel = rand_sel(g, K, 0, 8 * BS)
    topk = torch.stack([sel, rand_sel(g, K, 0, 8 * BS)])
    req = torch.tensor([0, 1], dtype=torch.int32)
    lru0 = b.lru[0][0].tolist()
    ors = new_oracles(b)
    check_against_oracle(b, backend, topk, req, ors)
    # cold start: miss i went to the i-th oldest slot; LRU rotated
    assert [b.keys[0][0, s].item() for s in lru0[:K]] == sel.tolist()
    assert b.lru[0][0].tolist() == lru0[K:] + lru0[:K]
    assert b.counters[0].tolist() == [0, 2 * K]
    # repeated selection: fixed point, no misses
    keys1 = b.keys[0].clone()
    out1 = check_against_oracle(b, backend, topk, req, ors)
    out2 = check_against_oracle(b, backend, topk, req, ors)
    assert torch.equal(out1, out2)
    assert torch.equal(b.keys[0], keys1)
    assert b.counters[0].tolist() == [4 * K, 2 * K]


@pytest.mark.parametrize("mult", [1, 2, 5])
def test_partial_overlap_evicts_oldest_unreferenced(backend, mult):
    K = 20
    H = mult * K
    b = Batch(R=1, P=16, H=H, seed=2)
    g = torch.Generator().manual_seed(6)
    req = torch.tensor([0], dtype=torch.int32)
    ors = new_oracles(b)
    positions = torch.randperm(16 * BS, generator=g).to(torch.int32)
    sel = positions[:K]
    check_against_oracle(b, backend, sel[None], req, ors)
    for step in range(4):
        keep = sel[torch.randperm(K, generator=g)[:K - 7]]
        new = positions[K + 7 * step:K + 7 * (step + 1)]
        lru_before = b.lru[0][0].tolist()
        keys_before = b.keys[0][0].tolist()
        sel = torch.cat([new[:3], keep, new[3:]])
        check_against_oracle(b, backend, sel[None], req, ors)
        referenced = {s for s in range(H) if keys_before[s] in set(keep.tolist())}
        expected_victims = [s for s in lru_before if s not in referenced][:7]
        assert [b.keys[0][0, s].item() for s in expected_victims] == \
            new[:3].tolist() + new[3:].tolist()


# the oldest Triton runs one of each block edge (a lone entry, one short of / exactly / one past
# a 32-wide block, two 1024-wide blocks); the 64-wide repeats run with the newest only
@pytest.mark.parametrize("K", [1, 31, 32, 33] + [
    pytest.param(k, marks=pytest.mark.newest_triton_only) for k in (63, 64, 65, 128)] + [2048])
def test_topk_counts_at_lane_boundaries(backend, K):
    H = 2 * K
    P = max(4, (3 * K) // BS + 2)
    b = Batch(R=2, P=P, H=H, seed=K, resident_frac=0.3)
    g = torch.Generator().manual_seed(K)
    req = torch.tensor([0, 1, -1], dtype=torch.int32)
    ors = new_oracles(b)
    pos = [torch.randperm(P * BS, generator=g).to(torch.int32) for _ in range(2)]
    topk = torch.stack([pos[0][:K], pos[1][:K], pos[1][:K]])
    check_against_oracle(b, backend, topk, req, ors)
    shift = max(1, K // 3)
    topk2 = torch.stack([pos[0][shift:K + shift], pos[1][:K], pos[0][:K]])
    topk2[0, 0] = -1
    check_against_oracle(b, backend, topk2, req, ors)


def test_padding_rows_touch_nothing(backend):
    b = Batch(R=2, P=8, H=32, seed=3)
    before = b.clone()
    g = torch.Generator().manual_seed(7)
    topk = torch.stack([rand_sel(g, 16, 0, 8 * BS) for _ in range(3)])
    out = b.resolve(backend, topk, torch.tensor([-1, -1, -1], dtype=torch.int32))
    assert (out == -1).all()
    assert torch.equal(b.keys[0], before.keys[0]) and torch.equal(b.lru[0], before.lru[0])
    assert torch.equal(b.arena_all, before.arena_all)
    assert b.counters[0].tolist() == [0, 0]


def test_multi_token_group_resolves_union(backend):
    H = 40
    b = Batch(R=2, P=8, H=H, seed=4, resident_frac=0.25)
    g = torch.Generator().manual_seed(8)
    pos = torch.randperm(8 * BS, generator=g).to(torch.int32)
    # request 0 decodes 3 tokens with overlapping selections (union 16 + 8 + 8 = 32 <= H)
    topk = torch.stack([pos[:16], pos[8:24], pos[16:32], pos[40:56]])
    req = torch.tensor([0, 0, 0, 1], dtype=torch.int32)
    ors = new_oracles(b)
    check_against_oracle(b, backend, topk, req, ors)
    check_against_oracle(b, backend, topk.roll(1, dims=1), req, ors)


def test_independent_state_per_request_and_layer(backend):
    """Two layers as views into one packed arena: each layer's misses land in its own view."""
    K, H = 12, 24
    b = Batch(R=2, P=6, H=H, layers=2, seed=9)
    g = torch.Generator().manual_seed(9)
    req = torch.tensor([0, 1], dtype=torch.int32)
    ors = [new_oracles(b, 0), new_oracles(b, 1)]
    arena1_before = b.arena_all[1].clone()
    topk_a = torch.stack([rand_sel(g, K, 0, 6 * BS) for _ in range(2)])
    check_against_oracle(b, backend, topk_a, req, ors[0], layer=0)
    assert torch.equal(b.arena_all[1], arena1_before)          # layer 1 untouched
    assert (b.keys[1] == -1).all() and b.counters[1].tolist() == [0, 0]
    topk_b = torch.stack([rand_sel(g, K, 0, 6 * BS) for _ in range(2)])
    check_against_oracle(b, backend, topk_b, req, ors[1], layer=1)
    check_against_oracle(b, backend, topk_a, req, ors[0], layer=0)
    assert b.counters[0].tolist() == [2 * K, 2 * K]


def test_unservable_positions_output_minus_one(backend):
    b = Batch(R=1, P=4, H=16, seed=10)
    b.hostbt[0, 1] = -1                      # page 1 has no host copy
    topk = torch.tensor([[0, 17, 18, 40]], dtype=torch.int32)
    out = b.resolve(backend, topk, torch.tensor([0], dtype=torch.int32))
    assert out[0, 1] == -1 and out[0, 2] == -1 and (out[0, [0, 3]] >= 0).all()
    assert b.counters[0].tolist() == [0, 2]
    b2 = Batch(R=1, P=4, H=16, seed=10)
    b2.hot[0] = -1                           # no hot buffer leased
    out = b2.resolve(backend, topk, torch.tensor([0], dtype=torch.int32))
    assert (out == -1).all() and b2.counters[0].tolist() == [0, 0]


def test_reference_raises_when_union_exceeds_hot_buffer():
    b = Batch(R=1, P=4, H=16, seed=11)
    topk = torch.arange(20, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match="hot"):
        resolve_rows_reference(topk, torch.tensor([0], dtype=torch.int32), b.res, b.hostbt, b.hot,
                               b.keys[0], b.lru[0], b.arena_all[0], b.host_all[0], BS,
                               b.counters[0])


def test_triton_interpreter_matches_reference_random_steps(backend):
    if backend != "triton":
        pytest.skip("compares the Triton kernel with the reference")
    b = Batch(R=3, P=10, H=64, seed=12, resident_frac=0.4)
    ref = b.clone()
    g = torch.Generator().manual_seed(12)
    for _ in range(4):
        T = 6
        req = torch.tensor([0, 0, 2, -1, 1, 1], dtype=torch.int32)
        topk = torch.stack([rand_sel(g, 20, 0, 10 * BS) for _ in range(T)])
        topk[torch.rand(T, 20, generator=g) < 0.1] = -1
        o1 = b.resolve("triton", topk, req)
        o2 = ref.resolve("reference", topk, req)
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])


@pytest.mark.gpu
@pytest.mark.parametrize("mult,mixed", [(1, False), (2, False), (5, False), (2, True)])
def test_gpu_production_shape_matches_reference(mult, mixed):
    """``mixed``: a quarter of the requests lease no hot block and a quarter hold hot blocks
    (with stale keys) but have every page resident: the resolver's two short paths."""
    R, K = 64, 2048
    H = mult * K
    P = (4 * K) // BS + 4
    b = Batch(R=R, P=P, H=H, seed=13, resident_frac=0.3, device="cuda", pin=True)
    if mixed:
        b.hot[0::4] = -1
        n_blocks = b.arena_all.shape[1] // BS
        b.res[1::4] = torch.randint(0, n_blocks, (len(range(1, R, 4)), P), dtype=torch.int32,
                                    device="cuda")
        b.keys[0][1::4] = torch.randint(0, P * BS, (len(range(1, R, 4)), H), dtype=torch.int32,
                                        device="cuda")
    ref = b.clone()
    ref.host_all = b.host_all                    # same pinned host rows
    g = torch.Generator().manual_seed(13)
    req = torch.arange(R, dtype=torch.int32)
    req[7] = -1
    prev = None
    for _ in range(3):
        rows = []
        for r in range(R):
            perm = torch.randperm(P * BS, generator=g).to(torch.int32)
            if prev is None:
                rows.append(perm[:K])
            else:                                 # 75% overlap, positions unique within a row
                keep = prev[r, K // 4:]
                fresh = perm[~torch.isin(perm, keep)][:K // 4]
                rows.append(torch.cat([keep, fresh]))
        topk = torch.stack(rows)
        prev = topk
        tk = topk.cuda()
        out = torch.full((R, K), -7, dtype=torch.int32, device="cuda")
        o1 = resolve_rows(tk, req.cuda(), b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                          b.arena_all[0], b.host_all[0], BS, b.counters[0], out=out)
        o2 = resolve_rows_reference(tk, req.cuda(), ref.res, ref.hostbt, ref.hot, ref.keys[0],
                                    ref.lru[0], ref.arena_all[0], ref.host_all[0], BS,
                                    ref.counters[0])
        torch.cuda.synchronize()
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_replay():
    """Fixed shapes, no host sync: capture once, replay with new selections, match the reference."""
    R, K, H = 8, 256, 512
    P = 64
    b = Batch(R=R, P=P, H=H, seed=14, resident_frac=0.2, device="cuda", pin=True)
    ref = b.clone()
    g = torch.Generator().manual_seed(14)
    req = torch.arange(R, dtype=torch.int32, device="cuda")
    sels = [torch.stack([torch.randperm(P * BS, generator=g)[:K]
                         for _ in range(R)]).to(torch.int32).cuda()
            for _ in range(4)]
    static = sels[0].clone()
    args = lambda x: (static, req, x.res, x.hostbt, x.hot, x.keys[0], x.lru[0], x.arena_all[0],
                      x.host_all[0], BS, x.counters[0])
    o = resolve_rows(*args(b))                                  # warm-up: scratch allocation
    o_ref = resolve_rows_reference(*args(ref))
    assert torch.equal(o, o_ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = resolve_rows(*args(b))
    for s in sels[1:]:
        static.copy_(s)
        graph.replay()
        o_ref = resolve_rows_reference(*args(ref))
        torch.cuda.synchronize()
        assert torch.equal(out, o_ref)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])


def guarded(x, guard=8, fill=-7):
    """``x`` as a view into a wider buffer: reads/writes past its last column land in a guard."""
    big = torch.full((x.shape[0], x.shape[1] + guard), fill, dtype=x.dtype, device=x.device)
    big[:, :x.shape[1]] = x
    return big, big[:, :x.shape[1]]


def test_corrupt_lru_entries_are_skipped_and_counted(backend):
    """An LRU entry outside [0, H) is never read or written through (the old kernel indexed keys
    and the arena with it; the old reference raised IndexError) and is counted in counters[2]."""
    H = 32
    b = Batch(R=2, P=8, H=H, seed=21)
    keys_big, b.keys[0] = guarded(b.keys[0])
    lru_big, b.lru[0] = guarded(b.lru[0])
    b.counters[0] = torch.zeros(3, dtype=torch.int64)
    # corrupt two entries of request 0 and one of request 1 (their slots then hold no key)
    b.lru[0][0, 3] = H + 3
    b.lru[0][0, 10] = -1
    b.lru[0][1, 0] = 10 ** 6
    bad = [(0, 3, H + 3), (0, 10, -1), (1, 0, 10 ** 6)]
    ref = b.clone()
    ref.counters[0] = b.counters[0].clone()
    arena_before = b.arena_all.clone()
    g = torch.Generator().manual_seed(21)
    req = torch.tensor([0, 1], dtype=torch.int32)
    steps = 3
    for _ in range(steps):
        topk = torch.stack([rand_sel(g, 12, 0, 8 * BS) for _ in range(2)])
        o = b.resolve(backend, topk, req)
        o_ref = ref.resolve("reference", topk, req)
        assert torch.equal(o, o_ref)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.counters[0], ref.counters[0])
    assert b.counters[0][2] == steps * len(bad)
    for r in range(2):                             # corrupt entries stay, in their order
        assert [v for v in b.lru[0][r].tolist() if not 0 <= v < H] == [
            v for rr, _, v in bad if rr == r]
    assert (keys_big[:, H:] == -7).all() and (lru_big[:, H:] == -7).all()
    # only hot rows were written
    hot_rows = {b.hot_row(r, j) for r in range(2) for j in range(H)}
    changed = (b.arena_all[0] != arena_before[0]).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= hot_rows


def test_workspace_is_never_reallocated(triton_cpu):
    """One caller-owned workspace serves every batch size with the same addresses (a CUDA graph
    captured at a small batch keeps them); a call that does not fit raises instead of growing."""
    from hisparse.ops import ResolveWorkspace
    R, P, H = 4, 6, 32
    ws = ResolveWorkspace(R, P * BS, H, "cpu")
    ptrs = (ws.position_map.data_ptr(), ws.scratch.data_ptr(), ws.copy_rows.data_ptr(),
            ws.copy_count.data_ptr())
    b = Batch(R=R, P=P, H=H, seed=22)
    ref = b.clone()
    g = torch.Generator().manual_seed(22)
    for T in (1, 2, 4, 3, 1):                      # ascending, then smaller again
        req = torch.randperm(R, generator=g)[:T].to(torch.int32)
        topk = torch.stack([rand_sel(g, 10, 0, P * BS) for _ in range(T)])
        args = (topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0], b.arena_all[0],
                b.host_all[0], BS, b.counters[0])
        o = resolve_rows(*args, workspace=ws)
        o_ref = ref.resolve("reference", topk, req)
        assert torch.equal(o, o_ref)
        assert (ws.position_map.data_ptr(), ws.scratch.data_ptr(), ws.copy_rows.data_ptr(),
                ws.copy_count.data_ptr()) == ptrs
        assert ws.map_is_clean()       # left clean for the next call
        assert (ws.copy_count == 0).all()          # every copy list consumed by the gather
    assert int(b.counters[0][1]) > 0               # misses went through the gather
    small = ResolveWorkspace(1, P * BS, H, "cpu")
    with pytest.raises(ValueError, match="workspace"):          # 2 groups do not fit in 1
        resolve_rows(torch.zeros(2, 10, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                     *args[2:], workspace=small)
    import hisparse.ops._resolve_triton as kernel_module
    assert not any(isinstance(v, dict) for k, v in vars(kernel_module).items()
                   if k.isupper() or k.startswith("_S")), "no module-global scratch"


def test_position_map_epoch_wrap_clears_the_row(triton_cpu):
    """The position map is never reset: entries carry the epoch of the call that wrote them.
    A row whose epoch wraps is cleared first, so an entry written long ago with epoch 1 is
    not read as mapped by the call that reuses epoch 1; before the wrap, entries of older
    epochs are not read either. Every call equals the reference, workspace left clean."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops._common import position_map_max_epoch, position_map_shift
    R, P, H = 3, 8, 48
    b = Batch(R=R, P=P, H=H, seed=51, resident_frac=0.25)
    ref = b.clone()
    ws = ResolveWorkspace(R, P * BS, H, "cpu")
    g = torch.Generator().manual_seed(51)
    shift, top = position_map_shift(H), position_map_max_epoch(H)
    # stale entries of every kind (slots, hits, misses, band marks) tagged epoch 1
    stale = torch.randint(0, 5 * H + 2, ws.position_map.shape, generator=g, dtype=torch.int32)
    ws.position_map.copy_((1 << shift) | stale)
    ws.map_epoch.fill_(top - 1)
    epochs = []
    for step in range(4):                      # epochs top, then 1 (cleared), 2, 3
        req = torch.tensor([2, 0, 1], dtype=torch.int32)
        topk = torch.stack([rand_sel(g, 12, 0, P * BS) for _ in range(3)])
        o1 = resolve_rows(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                          b.arena_all[0], b.host_all[0], BS, b.counters[0], workspace=ws)
        o2 = ref.resolve("reference", topk, req)
        assert torch.equal(o1, o2), step
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.counters[0], ref.counters[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        epochs.append(ws.map_epoch.tolist())
        assert ws.map_is_clean()
    assert epochs == [[top] * 3, [1] * 3, [2] * 3, [3] * 3]
    assert int(b.counters[0][1]) > 0 and int(b.counters[0][0]) > 0      # misses, then hits


def test_position_map_layout_follows_the_workspace_not_the_call(triton_cpu):
    """One workspace serves calls with a smaller hot buffer than it was sized for: the map's
    epoch field sits where the workspace's size puts it, so an entry a large-H call wrote is
    never read as the current epoch by a small-H call (a review's counterexample: H = 200,
    then calls elsewhere, then H = 16 served nothing)."""
    from hisparse.ops import ResolveWorkspace
    R, P = 1, 8
    ws = ResolveWorkspace(R, P * BS, 200, "cpu")
    g = torch.Generator().manual_seed(71)
    for step, H in enumerate((200, 16, 16, 16, 16, 16, 16, 16, 16, 200, 16)):
        b = Batch(R=R, P=P, H=H, seed=71 + step)
        ref = b.clone()
        topk = rand_sel(g, 10, 0, P * BS)[None]
        req = torch.zeros(1, dtype=torch.int32)
        o1 = resolve_rows(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                          b.arena_all[0], b.host_all[0], BS, b.counters[0], workspace=ws)
        o2 = ref.resolve("reference", topk, req)
        assert torch.equal(o1, o2), (step, H)
        assert torch.equal(b.counters[0], ref.counters[0]) and int(b.counters[0][1]) == 10
        assert ws.map_is_clean()


# (policy, prefetch, H, block_h, band misses): one pass or three passes over the hot buffer
# (the packed counts carried from pass to pass), the count pass (C0) of the score policy and
# of lru with prefetch, whose prefetch targets are bound by the candidates left after the
# victims when the band offers more misses than that
@pytest.mark.parametrize("policy,prefetch,H,block_h,band_misses", [
    ("score", 0, 32, None, 6), ("score", 0, 96, 32, 6), ("score", 4, 96, 32, 6),
    ("lru", 4, 96, 32, 6), ("lru", 40, 96, 32, 36)])
def test_victims_run_past_the_rarely_used_rows(triton_cpu, policy, prefetch, H, block_h,
                                               band_misses):
    """More misses than rarely used unreferenced rows outside the band: under the score
    policy the victims are every rarely used row, then the often used ones in LRU order,
    never a band row; the Triton kernel (``block_h`` slots a pass) equals the reference in
    every state (the phase-C ordinals of the often used class start after the rarely used
    count; with prefetch, the targets follow the victims)."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops._resolve_triton import resolve_rows_triton
    R, P = 2, 16
    n_hit, n_band, n_miss = H // 4, H // 8, H // 2 - 1
    b = Batch(R=R, P=P, H=H, seed=61 + H)           # nothing resident: every lookup is hot
    for x in b.counters:
        x.resize_(5).zero_()
    g = torch.Generator().manual_seed(61 + H)
    hot_pos = [torch.randperm(H, generator=g).to(torch.int32) for _ in range(R)]
    for r in range(R):
        b.keys[0][r] = hot_pos[r]                   # warm: slot j holds position hot_pos[r][j]
    flags = torch.zeros(R, H, dtype=torch.int32)
    flags[torch.rand(R, H, generator=g) < 0.5] = (PROTECT_USES + 1) << 1
    ref = b.clone()
    flags_r = flags.clone()
    flags_before = flags.clone()
    topk, band = [], []
    for r in range(R):
        perm = hot_pos[r][torch.randperm(H, generator=g)]
        new = H + torch.randperm(P * BS - H, generator=g)[:n_miss + band_misses].to(torch.int32)
        topk.append(torch.cat([perm[:n_hit], new[:n_miss]]))
        band.append(torch.cat([perm[n_hit:n_hit + n_band], new[n_miss:]]))  # held + misses
    topk, band = torch.stack(topk), torch.stack(band)
    req = torch.tensor([0, 1], dtype=torch.int32)
    ws = ResolveWorkspace(R, P * BS, H, "cpu")
    o1 = resolve_rows_triton(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                             b.arena_all[0], b.host_all[0], BS, b.counters[0], ws, band=band,
                             policy=policy, prefetch=prefetch, hot_flags=flags,
                             block_h=block_h)
    o2 = policy_resolve(ref, "reference", topk, band, req, flags_r, policy, prefetch)
    assert torch.equal(o1, o2)
    assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
    assert torch.equal(flags, flags_r) and torch.equal(b.counters[0], ref.counters[0])
    assert torch.equal(b.arena_all, ref.arena_all)
    if prefetch:
        n_pf = int(ref.counters[0][3])
        assert n_pf > 0                             # prefetch targets were chosen
        if band_misses > 30:                        # bound by the candidates left
            assert n_pf < R * min(prefetch, band_misses), n_pf
    # rarely used slots outside the hits and the band (slot j holds position hot_pos[r][j])
    taken = [set(topk[r, :n_hit].tolist()) | set(band[r, :n_band].tolist()) for r in range(R)]
    low = [sum(1 for j in range(H) if int(hot_pos[r][j]) not in taken[r]
               and int(flags_before[r, j]) >> 1 < PROTECT_USES) for r in range(R)]
    assert all(0 < n < n_miss for n in low), (low, n_miss)   # victims ran into often used rows


@pytest.mark.parametrize("prefetch", [0, 3])
def test_mixed_batch_groups_without_hot_slots(triton_cpu, prefetch):
    """A batch mixing host-read requests with requests that lease no hot block (their slots'
    stale keys and corrupt LRU entries included) and a host-read request whose selections are
    all resident (no hot lookup: what it mapped must expire with the call): the Triton path
    equals the reference in outputs, keys, LRU, flags, counters (corrupt entries counted), arena and
    prefetch plan (the groups without hot lookups have plan rows of -1), with misses larger than
    the gather's split, and leaves the workspace clean."""
    from hisparse.ops import ResolveWorkspace
    R, P, H, PF = 4, 10, 40, prefetch
    b = Batch(R=R, P=P, H=H, seed=41, resident_frac=0.3)
    b.hot[1] = -1
    b.hot[3] = -1
    g = torch.Generator().manual_seed(41)
    b.keys[0][1] = rand_sel(g, H, 0, P * BS)          # stale keys must never be served
    b.res[2] = Batch(R=R, P=P, H=H, seed=41, resident_frac=1.0).res[2]   # all resident
    b.keys[0][2] = rand_sel(g, H, 0, P * BS)
    b.lru[0][2, 3] = H
    b.lru[0][3, 5] = H + 7                            # corrupt entries: skipped, counted
    b.lru[0][1, 0] = -3
    b.counters[0] = torch.zeros(5, dtype=torch.int64)
    ref = b.clone()
    flags_b = torch.zeros(R, H, dtype=torch.int32)
    flags_r = flags_b.clone()
    ws = ResolveWorkspace(R, P * BS, H, "cpu")
    for _ in range(3):
        req = torch.tensor([1, 0, 0, 3, -1, 2], dtype=torch.int32)
        topk, band = ranked_rows(g, 6, 16, 8, P * BS)
        kw = dict(band=band, policy="score", prefetch=PF, hot_flags=flags_b)
        plan = torch.full((2, R, PF), 55, dtype=torch.int64) if PF else None
        ref_plan = plan.clone() if PF else None
        poison = torch.full(topk.shape, -7, dtype=torch.int32)
        o1 = resolve_rows(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                          b.arena_all[0], b.host_all[0], BS, b.counters[0], out=poison,
                          workspace=ws, prefetch_plan=plan, **kw)
        kw["hot_flags"] = flags_r
        o2 = resolve_rows_reference(topk, req, ref.res, ref.hostbt, ref.hot, ref.keys[0],
                                    ref.lru[0], ref.arena_all[0], ref.host_all[0], BS,
                                    ref.counters[0], prefetch_plan=ref_plan, **kw)
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(flags_b, flags_r) and torch.equal(b.counters[0], ref.counters[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        if PF:
            assert torch.equal(plan, ref_plan)
            assert (plan[:, [0, 2, 3]] == -1).all()   # groups of slots 1, 3 and 2
        assert (ws.copy_count == 0).all() and ws.map_is_clean()
    c = b.counters[0].tolist()
    assert c[1] > 16 and c[2] == 3 * 3               # misses beyond the split; corrupt x steps


@pytest.mark.parametrize("split,block_h", [(1, None), (4, 32)])
def test_speed_knobs_do_not_change_results(triton_cpu, split, block_h):
    """The miss gather's programs per group and the resolver's slots per pass are speed knobs:
    any setting gives the reference's state and arena (cold buffers: every miss of a group
    spread over the split; 32 slots per pass: two passes over 48 slots)."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops._resolve_triton import resolve_rows_triton
    R, P, H = 3, 10, 48
    b = Batch(R=R, P=P, H=H, seed=51, resident_frac=0.2)
    ref = b.clone()
    ws = ResolveWorkspace(R, P * BS, H, "cpu")
    g = torch.Generator().manual_seed(51)
    for _ in range(2):
        req = torch.tensor([2, 0, 1], dtype=torch.int32)
        topk = torch.stack([rand_sel(g, 30, 0, P * BS) for _ in range(3)])
        o1 = resolve_rows_triton(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                                 b.arena_all[0], b.host_all[0], BS, b.counters[0], ws,
                                 split=split, block_h=block_h)
        o2 = ref.resolve("reference", topk, req)
        assert torch.equal(o1, o2) and torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert (ws.copy_count == 0).all()
    for bad, match in (({"split": 3}, "split"), ({"block_h": 48}, "block_h")):
        with pytest.raises(ValueError, match=match):
            resolve_rows_triton(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                                b.arena_all[0], b.host_all[0], BS, b.counters[0], ws, **bad)


@pytest.mark.gpu
def test_gpu_graphs_captured_ascending_replay_in_any_order():
    """Regression (issue 10): capture one graph per batch size in ascending order, all sharing
    one workspace, then replay them in random order against the reference. The map starts
    full of stale entries of epoch 1 with every row's epoch two calls from its wrap, so the
    replays clear rows on the device (the clear's barrier before phase A included)."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops._common import position_map_max_epoch, position_map_shift
    R, K, H, P = 16, 256, 512, 64
    b = Batch(R=R, P=P, H=H, seed=23, resident_frac=0.2, device="cuda", pin=True)
    ref = b.clone()
    ws = ResolveWorkspace(R, P * BS, H, "cuda")
    stale = torch.randint(0, 5 * H + 2, ws.position_map.shape, dtype=torch.int32, device="cuda")
    ws.position_map.copy_((1 << position_map_shift(H)) | stale)
    ws.map_epoch.fill_(position_map_max_epoch(H) - 2)
    g = torch.Generator().manual_seed(23)
    graphs = {}
    for T in (1, 2, 4, 8, 16):
        static_topk = torch.full((T, K), -1, dtype=torch.int32, device="cuda")
        static_req = torch.full((T,), -1, dtype=torch.int32, device="cuda")
        args = (static_topk, static_req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                b.arena_all[0], b.host_all[0], BS, b.counters[0])
        resolve_rows(*args, workspace=ws)           # warm-up (padding only: touches nothing)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = resolve_rows(*args, workspace=ws)
        graphs[T] = (graph, static_topk, static_req, out)
    order = [16, 1, 8, 2, 16, 4, 1, 8, 16, 2]
    for T in order:
        graph, static_topk, static_req, out = graphs[T]
        req = torch.randperm(R, generator=g)[:T].to(torch.int32)
        topk = torch.stack([torch.randperm(P * BS, generator=g)[:K] for _ in range(T)]).int()
        static_topk.copy_(topk.cuda())
        static_req.copy_(req.cuda())
        graph.replay()
        o_ref = resolve_rows_reference(topk.cuda(), req.cuda(), ref.res, ref.hostbt, ref.hot,
                                       ref.keys[0], ref.lru[0], ref.arena_all[0],
                                       ref.host_all[0], BS, ref.counters[0])
        torch.cuda.synchronize()
        assert torch.equal(out, o_ref)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])
        assert ws.map_is_clean()


# ---------------------------------------------------------------- policies (issue 15)

def ranked_rows(g, T, K, NB, hi):
    """Per token K selected + NB next-ranked positions, unique within the token."""
    sel = torch.stack([rand_sel(g, K + NB, 0, hi) for _ in range(T)])
    return sel[:, :K].contiguous(), sel[:, K:].contiguous()


def policy_resolve(b, backend, topk, band, req, flags, policy, prefetch, out=None):
    args = (topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0], b.arena_all[0],
            b.host_all[0], BS, b.counters[0])
    kw = dict(band=band, policy=policy, prefetch=prefetch, hot_flags=flags)
    if backend == "reference":
        return resolve_rows_reference(*args, **kw)
    return resolve_rows(*args, out=out, **kw)


# H = 22: band rows get evicted under pressure, every policy; H = 48 (no pressure): the
# heaviest policy only. The oldest Triton (.ci/triton_matrix.sh) runs the two cases that take
# both sides of each of the kernel's policy switches (score / LRU, prefetch / none); the
# prefetch-plan and never-evicts tests below run the other pairings there (CI time: each case
# is ~5 s interpreted)
@pytest.mark.parametrize("policy,prefetch,H", [
    ("lru", 0, 22),
    pytest.param("score", 0, 22, marks=pytest.mark.newest_triton_only),
    pytest.param("score", 5, 22, marks=pytest.mark.newest_triton_only),
    pytest.param("lru", 3, 22, marks=pytest.mark.newest_triton_only),
    ("score", 64, 22),
    pytest.param("score", 64, 48, marks=pytest.mark.newest_triton_only)])
def test_policy_kernel_matches_reference(triton_cpu, policy, prefetch, H):
    b = Batch(R=3, P=10, H=H, seed=21, resident_frac=0.3)
    for x in b.counters:
        x.resize_(5).zero_()
    ref = b.clone()
    flags_b = torch.zeros(3, H, dtype=torch.int32)
    flags_r = flags_b.clone()
    g = torch.Generator().manual_seed(21)
    protected_steps = 0
    for step in range(7):                   # rows reach PROTECT_USES by step 4 (counted below)
        req = torch.tensor([0, 0, 2, -1, 1, 1] if step % 2 else [1, 2, 0, 0, -1, -1],
                           dtype=torch.int32)
        topk, band = ranked_rows(g, 6, 10, 12, 10 * BS)
        topk[torch.rand(6, 10, generator=g) < 0.1] = -1
        band[torch.rand(6, 12, generator=g) < 0.1] = -1
        o1 = policy_resolve(b, "triton", topk, band, req, flags_b, policy, prefetch,
                            out=torch.full_like(topk, -7))
        o2 = policy_resolve(ref, "reference", topk, band, req, flags_r, policy, prefetch)
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(flags_b, flags_r)
        assert torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])
        protected_steps += bool(((flags_r >> 1) >= PROTECT_USES).any())
    # the later steps choose victims while some rows are protected (the score policy's order)
    assert protected_steps >= 2
    if prefetch:
        assert int(ref.counters[0][3]) > 0 and int(ref.counters[0][4]) > 0


def test_policy_without_band_is_lru(backend):
    """``policy="score"`` with no band (nothing ranked below the cut) is exactly LRU."""
    b = Batch(R=2, P=8, H=40, seed=5)
    ref = b.clone()
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        topk = torch.stack([rand_sel(g, 16, 0, 8 * BS) for _ in range(2)])
        req = torch.tensor([0, 1], dtype=torch.int32)
        o1 = policy_resolve(b, backend, topk, None, req, None, "score", 0)
        o2 = policy_resolve(ref, "reference", topk, None, req, None, "lru", 0)
        assert torch.equal(o1, o2) and torch.equal(b.lru[0], ref.lru[0])


# the oldest Triton runs LRU here and score in the plan test below (inline prefetch copy / plan,
# each with one policy; the policy test runs both without a plan)
@pytest.mark.parametrize("policy", ["lru", pytest.param("score",
                                                        marks=pytest.mark.newest_triton_only)])
def test_prefetch_never_evicts_a_row_selected_in_the_same_step(backend, policy):
    """Every selected row still holds its host row after the call (prefetch writes only slots
    nobody selected), every selected position stays hot, and band rows that missed are fetched
    (up to the budget) into slots holding neither a selected nor a band row."""
    H, K, NB = 32, 12, 24
    b = Batch(R=1, P=12, H=H, seed=8)
    b.counters[0] = torch.zeros(5, dtype=torch.int64)
    flags = torch.zeros(1, H, dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    for _ in range(8):
        topk, band = ranked_rows(g, 2, K, NB, 12 * BS)
        req = torch.zeros(2, dtype=torch.int32)
        keys_before = b.keys[0][0].tolist()
        n_before = int(b.counters[0][3])
        out = policy_resolve(b, backend, topk, band, req, flags, policy, prefetch=H)
        host = b.host_all[0]
        sel = topk.flatten()
        rows = out.flatten().long()
        src = torch.tensor([b.host_row(0, int(p)) for p in sel])
        assert (rows >= 0).all()
        assert torch.equal(b.arena_all[0][rows], host[src])
        keys = b.keys[0][0].tolist()
        assert set(sel.tolist()) <= set(keys)
        union = set(sel.tolist())
        band_set = set(band.flatten().tolist()) - union
        prefetched = [p for p in keys if p in band_set and p not in keys_before]
        for p in prefetched:                      # prefetched rows hold their host row too
            s = keys.index(p)
            assert torch.equal(b.arena_all[0][b.hot_row(0, s)], host[b.host_row(0, p)])
        assert int(b.counters[0][3]) - n_before == len(prefetched)
        assert all(flags[0, keys.index(p)] == 1 for p in prefetched)
    assert int(b.counters[0][3]) > 0


def test_policy_argument_checks():
    b = Batch(R=1, P=4, H=16, seed=0)
    topk = torch.zeros(1, 4, dtype=torch.int32)
    req = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="policy"):
        policy_resolve(b, "reference", topk, None, req, None, "belady", 0)
    with pytest.raises(ValueError, match="band"):
        policy_resolve(b, "reference", topk, None, req, None, "score", 2)
    with pytest.raises(ValueError, match="hot_flags"):
        policy_resolve(b, "reference", topk, topk, req, None, "score", 2)


@pytest.mark.gpu
@pytest.mark.parametrize("policy,prefetch", [("score", 0), ("score", 32), ("lru", 32)])
def test_gpu_policy_production_shape_matches_reference(policy, prefetch):
    R, K, NB = 16, 2048, 2048
    H = 2 * K
    P = (8 * K) // BS + 4
    b = Batch(R=R, P=P, H=H, seed=17, resident_frac=0.3, device="cuda", pin=True)
    b.counters[0] = torch.zeros(5, dtype=torch.int64, device="cuda")
    ref = b.clone()
    ref.host_all = b.host_all
    flags_b = torch.zeros(R, H, dtype=torch.int32, device="cuda")
    flags_r = flags_b.clone()
    g = torch.Generator().manual_seed(17)
    req = torch.arange(R, dtype=torch.int32, device="cuda")
    for _ in range(3):
        topk, band = ranked_rows(g, R, K, NB, P * BS)
        topk, band = topk.cuda(), band.cuda()
        o1 = policy_resolve(b, "triton", topk, band, req, flags_b, policy, prefetch,
                            out=torch.full_like(topk, -7))
        o2 = policy_resolve(ref, "reference", topk, band, req, flags_r, policy, prefetch)
        torch.cuda.synchronize()
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(flags_b, flags_r) and torch.equal(b.arena_all, ref.arena_all)
        assert torch.equal(b.counters[0], ref.counters[0])


def _groups(req):
    """Request groups of a call, in token order: ``[(first token, request)]``."""
    out, prev = [], -1
    for t, r in enumerate(req.tolist()):
        if r >= 0 and r != prev:
            out.append((t, r))
        prev = r
    return out


@pytest.mark.parametrize("policy", [pytest.param("lru", marks=pytest.mark.newest_triton_only),
                                    "score"])
def test_prefetch_plan_then_copy_equals_inline_prefetch(backend, policy):
    """Demand on the critical path, prefetch copies from the plan afterwards (a side stream on
    GPU): same outputs, state and arena as the one-call prefetch. The plan is indexed by request
    group (row ``g`` whole: targets then ``-1``), rows of no group are left alone, and the copy
    consumes it (all ``-1`` after)."""
    from hisparse.ops.resolve import prefetch_copy

    PF = 4
    b = Batch(R=3, P=10, H=40, seed=33, resident_frac=0.2)
    b.counters[0] = torch.zeros(5, dtype=torch.int64)
    ref = b.clone()
    flags_b = torch.zeros(3, 40, dtype=torch.int32)
    flags_r = flags_b.clone()
    plan = torch.full((2, 3, PF), 123, dtype=torch.int64)   # G = min(T, R) = 3
    total = 0
    g = torch.Generator().manual_seed(33)
    for step in range(6):
        req = torch.tensor([0, 0, 2, -1, 1, 1] if step % 2 else [1, 2, 0, 0, -1, -1],
                           dtype=torch.int32)
        if step == 5:                         # one group: rows 1, 2 of the plan stay as they are
            req = torch.tensor([2, 2, -1, -1, -1, -1], dtype=torch.int32)
            plan[:, 1:] = 77
        topk, band = ranked_rows(g, 6, 8, 12, 10 * BS)
        args = (topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0], b.arena_all[0],
                b.host_all[0], BS, b.counters[0])
        kw = dict(band=band, policy=policy, prefetch=PF, hot_flags=flags_b, prefetch_plan=plan)
        pf_before = int(b.counters[0][3])
        keys_before = b.keys[0].clone()
        o1 = (resolve_rows_reference(*args, **kw) if backend == "reference"
              else resolve_rows(*args, **kw))
        n_groups = len(_groups(req))
        if step == 5:
            assert (plan[:, n_groups:] == 77).all()
            plan[:, n_groups:] = -1
        # row g lists group g's prefetches: arena rows of slots whose key changed to a band row
        for gi, (_t0, r) in enumerate(_groups(req)):
            row_src, row_dst = plan[0, gi].tolist(), plan[1, gi].tolist()
            n = sum(x >= 0 for x in row_src)
            assert all(x >= 0 for x in row_src[:n]) and all(x == -1 for x in row_src[n:])
            assert all(x >= 0 for x in row_dst[:n]) and all(x == -1 for x in row_dst[n:])
            band_r = set(band[[t for t in range(6) if int(req[t]) == r]].flatten().tolist())
            for dst in row_dst[:n]:
                slot = next(j for j in range(40) if b.hot_row(r, j) == dst)
                key = int(b.keys[0][r, slot])
                assert key in band_r and key != int(keys_before[r, slot])
        n_plan = int((plan[0] >= 0).sum())
        assert n_plan == int(b.counters[0][3]) - pf_before
        prefetch_copy(plan, b.arena_all[0], b.host_all[0])
        assert (plan == -1).all()
        o2 = policy_resolve(ref, "reference", topk, band, req, flags_r, policy, PF)
        assert torch.equal(o1, o2)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(flags_b, flags_r) and torch.equal(b.counters[0], ref.counters[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        total += n_plan
    assert total == int(ref.counters[0][3]) > 0


def test_prefetch_plan_shape_is_checked(backend):
    b = Batch(R=3, P=4, H=16, seed=0)
    topk = torch.zeros(4, 4, dtype=torch.int32)
    band = torch.zeros(4, 4, dtype=torch.int32)
    req = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    flags = torch.zeros(3, 16, dtype=torch.int32)
    args = (topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0], b.arena_all[0],
            b.host_all[0], BS, b.counters[0])
    fn = resolve_rows_reference if backend == "reference" else resolve_rows
    for bad in (torch.full((2, 2, 2), -1, dtype=torch.int64),       # fewer rows than min(T, R)
                torch.full((2, 3, 3), -1, dtype=torch.int64),       # width != prefetch
                torch.full((2, 3, 2), -1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="prefetch_plan"):
            fn(*args, band=band, policy="score", prefetch=2, hot_flags=flags, prefetch_plan=bad)


def test_prefetch_copy_consumes_plan(backend):
    """Entries ``>= 0`` copy host -> arena rows (either ``-1`` skips), then the plan is all -1;
    entries past a program's block (more than 16) are covered."""
    from hisparse.ops.resolve import prefetch_copy

    g = torch.Generator().manual_seed(4)
    arena = torch.randn(64, D, generator=g).to(torch.bfloat16)
    host = torch.randn(80, D, generator=g).to(torch.bfloat16)
    plan = torch.full((2, 5, 7), -1, dtype=torch.int64)
    src = torch.randperm(80, generator=g)[:35]
    dst = torch.randperm(64, generator=g)[:35]
    plan[0].view(-1)[:] = src
    plan[1].view(-1)[:] = dst
    plan[0, 1, 3] = -1           # skipped: no source
    plan[1, 4, 6] = -1           # skipped: no target
    want = arena.clone()
    keep = (plan[0] >= 0) & (plan[1] >= 0)
    want[plan[1][keep]] = host[plan[0][keep]]
    prefetch_copy(plan, arena, host)
    assert torch.equal(arena, want)
    assert (plan == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("policy", ["score", "lru"])
def test_gpu_prefetch_on_side_stream_matches_fused_reference(mode, policy):
    """The worker's split at production shape on the H200: resolver (plan) on the main stream,
    the prefetch copy forked onto a side stream and joined (HotPrefetcher), eager or captured
    in a CUDA graph (fork/join inside the capture) and replayed with new selections: rows, hot
    state, flags, counters and arena bytes equal the fused reference every step, the plan is
    consumed, and rows prefetched at step t and selected at t + 1 count as prefetch hits."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops.resolve import hot_policy_params
    from hisparse.worker.model_runner import HotPrefetcher

    R, K, NB = 16, 2048, 2048
    H = 2 * K
    PF = 32
    P = (8 * K) // BS + 4
    _, _, default_pf = hot_policy_params("score+prefetch", K)
    assert default_pf == 32
    b = Batch(R=R, P=P, H=H, seed=29, resident_frac=0.3, device="cuda", pin=True)
    b.counters[0] = torch.zeros(5, dtype=torch.int64, device="cuda")
    ref = b.clone()
    ref.host_all = b.host_all
    flags_b = torch.zeros(R, H, dtype=torch.int32, device="cuda")
    flags_r = flags_b.clone()
    ws = ResolveWorkspace(R, P * BS, H, "cuda")
    plan = torch.full((2, R, PF), -1, dtype=torch.int64, device="cuda")
    topk_s = torch.full((R, K), -1, dtype=torch.int32, device="cuda")
    band_s = torch.full((R, NB), -1, dtype=torch.int32, device="cuda")
    req_s = torch.full((R,), -1, dtype=torch.int32, device="cuda")   # padding: touches nothing
    out_s = torch.empty((R, K), dtype=torch.int32, device="cuda")
    pf = HotPrefetcher(torch.device("cuda"))

    def body():
        resolve_rows(topk_s, req_s, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0], b.arena_all[0],
                     b.host_all[0], BS, b.counters[0], out=out_s, workspace=ws, band=band_s,
                     policy=policy, prefetch=PF, hot_flags=flags_b, prefetch_plan=plan)
        pf.launch(plan, b.arena_all[0], b.host_all[0])
        pf.join()

    graph = None
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()                                   # warm-up (compiles), on padding
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        torch.cuda.synchronize()
    g = torch.Generator().manual_seed(29)
    prev_band = None
    for _ in range(4):
        topk, band = ranked_rows(g, R, K, NB, P * BS)
        if prev_band is not None:                    # last step's best band rows move up
            top = prev_band[:, :PF].tolist()
            rest = torch.cat([topk, band], 1).tolist()
            rows = []
            for i in range(R):
                head = set(top[i])
                rows.append(top[i] + [p for p in rest[i] if p not in head][:K + NB - PF])
            sel = torch.tensor(rows, dtype=torch.int32)
            topk, band = sel[:, :K].contiguous(), sel[:, K:].contiguous()
        topk_s.copy_(topk)
        band_s.copy_(band)
        req_s.copy_(torch.arange(R, dtype=torch.int32))
        if graph is not None:
            graph.replay()
        else:
            body()
        o_ref = policy_resolve(ref, "reference", topk.cuda(), band.cuda(),
                               torch.arange(R, dtype=torch.int32, device="cuda"), flags_r,
                               policy, PF)
        torch.cuda.synchronize()
        assert torch.equal(out_s, o_ref)
        assert torch.equal(b.keys[0], ref.keys[0]) and torch.equal(b.lru[0], ref.lru[0])
        assert torch.equal(flags_b, flags_r)
        assert torch.equal(b.counters[0], ref.counters[0])
        assert torch.equal(b.arena_all, ref.arena_all)
        assert (plan == -1).all()
        prev_band = band
    assert int(b.counters[0][3]) > 0 and int(b.counters[0][4]) > 0


# ------------------------------------------------------------------ MTP verify groups (issue 14)
def test_verify_group_shared_rows_load_once(backend):
    """k + 1 tokens of one request selecting the same rows: one miss per row, one hot slot per
    row, every token served the same (correct) row."""
    b = Batch(R=1, P=4, H=32, seed=21)
    g = torch.Generator().manual_seed(21)
    sel = rand_sel(g, 16, 0, 4 * BS)
    topk = torch.stack([sel, sel.roll(3), sel.roll(7)])       # same set, different orders
    req = torch.tensor([0, 0, 0], dtype=torch.int32)
    out = check_against_oracle(b, backend, topk, req, new_oracles(b))
    assert b.counters[0].tolist() == [0, 16]
    assert sorted(out[0].tolist()) == sorted(out[1].tolist()) == sorted(out[2].tolist())


def test_verify_group_disjoint_rows_fill_without_evicting_each_other(backend):
    """A full hot buffer: token 0 re-selects the 16 rows loaded last step (hits), token 1
    selects 16 new ones (misses): the misses take only the slots no token of the group
    references, so token 0's rows still hold their data when attention reads them."""
    b = Batch(R=1, P=4, H=32, seed=22)
    g = torch.Generator().manual_seed(22)
    pos = rand_sel(g, 48, 0, 4 * BS)
    ors = new_oracles(b)
    req1 = torch.tensor([0], dtype=torch.int32)
    check_against_oracle(b, backend, pos[:16][None], req1, ors)           # A loaded
    check_against_oracle(b, backend, pos[16:32][None], req1, ors)         # B loaded: full
    # verify group: token 0 = A (hits), token 1 = C (16 misses; the LRU victims would be A's
    # slots, the oldest, if the group's own hits were not protected)
    topk = torch.stack([pos[:16], pos[32:48]])
    req = torch.tensor([0, 0], dtype=torch.int32)
    before = b.counters[0].clone()
    check_against_oracle(b, backend, topk, req, ors)
    assert (b.counters[0] - before).tolist() == [16, 16]


def test_verify_group_union_larger_than_hot_buffer_fails_and_changes_nothing():
    """Union 17 + 16 = 33 > H = 32: a clear ValueError, and no hot key, LRU entry, arena row or
    counter of that request changed."""
    b = Batch(R=1, P=4, H=32, seed=23)
    g = torch.Generator().manual_seed(23)
    pos = rand_sel(g, 33, 0, 4 * BS)
    topk = torch.stack([pos[:16], pos[16:32], pos[17:33]])       # union: 33 rows
    req = torch.tensor([0, 0, 0], dtype=torch.int32)
    keys, lru = b.keys[0].clone(), b.lru[0].clone()
    arena, counters = b.arena_all.clone(), b.counters[0].clone()
    with pytest.raises(ValueError, match="union of its tokens' selections"):
        resolve_rows_reference(topk, req, b.res, b.hostbt, b.hot, b.keys[0], b.lru[0],
                               b.arena_all[0], b.host_all[0], BS, b.counters[0])
    assert torch.equal(b.keys[0], keys) and torch.equal(b.lru[0], lru)
    assert torch.equal(b.arena_all, arena) and torch.equal(b.counters[0], counters)


def test_corrupt_lru_with_more_misses_than_listed_slots_loads_nothing(triton_cpu):
    """Corrupt LRU (slot 7 replaced by 99) and 10 misses for 8 slots: the kernel sizes its
    victims from the usable slots (8) but the walk lists 7, so an eighth victim would come from
    unwritten scratch (poisoned here, far out of range). The step loads nothing instead: every
    miss gets -1, no key changes, the LRU order stays, nothing is copied."""
    from hisparse.ops import ResolveWorkspace
    from hisparse.ops._resolve_triton import resolve_rows_triton

    bs, H, P = 4, 8, 8
    res = torch.full((1, P), -1, dtype=torch.int32)
    host_bt = torch.arange(P, dtype=torch.int32).view(1, P)
    hot_bt = torch.tensor([[100, 101]], dtype=torch.int32)            # 2 blocks x 4 slots
    keys = torch.full((1, H), -1, dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 99]], dtype=torch.int32)
    arena = torch.zeros(102 * bs, 4)
    host = torch.arange(P * bs, dtype=torch.float32)[:, None].repeat(1, 4)
    topk = torch.arange(10, dtype=torch.int32).view(1, 10)
    counters = torch.zeros(3, dtype=torch.int64)
    ws = ResolveWorkspace(1, P * bs, H, "cpu")
    ws.scratch.fill_(10 ** 6)
    out = resolve_rows_triton(topk, torch.zeros(1, dtype=torch.int32), res, host_bt, hot_bt, keys,
                              lru, arena, host, bs, counters, ws)
    assert out[0].tolist() == [-1] * 10
    assert keys[0].tolist() == [-1] * H
    assert lru[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 99]
    assert not arena.any()
    assert counters[2] == 1 and counters[1] == 10
    # the same state without the corrupt entry loads every slot
    lru[0, 7] = 7
    out = resolve_rows_triton(topk, torch.zeros(1, dtype=torch.int32), res, host_bt, hot_bt, keys,
                              lru, arena, host, bs, counters, ws)
    assert sum(r >= 0 for r in out[0].tolist()) == H and sorted(lru[0].tolist()) == list(range(H))
