"""Policy replay (hisparse bench-policy): the numpy model equals the resolver reference, and the
replay's LRU numbers equal the resolver's own counters on the same trace."""

import json

import numpy as np
import pytest
import torch

from hisparse.bench.policy import PolicyHotBuffer, load_trace, main, replay_policies
from hisparse.ops import prefetch_copy_reference, resolve_rows_reference

BS = 16


def small_trace(R=2, L=2, S=12, k=24, ctx=160, seed=0):
    """Rank-ordered positions with locality: a drifting score per position."""
    rng = np.random.default_rng(seed)
    out = np.zeros((R, L, S, k), dtype=np.int32)
    scores = np.zeros((R, L, S, k), dtype=np.float32)
    for r in range(R):
        for layer in range(L):
            base = rng.random(ctx)
            for t in range(S):
                base = 0.8 * base + 0.2 * rng.random(ctx)
                order = np.argsort(-base, kind="stable")[:k]
                out[r, layer, t] = order
                scores[r, layer, t] = base[order]
    return out, scores


class ResolverBuffer:
    """One request through resolve_rows_reference (nothing resident, all on host)."""

    def __init__(self, H, max_pos, policy, prefetch, split=False):
        P = -(-max_pos // BS)
        HB = -(-H // BS)
        self.res = torch.full((1, P), -1, dtype=torch.int32)
        self.host_bt = torch.arange(P, dtype=torch.int32).view(1, P)
        self.hot_bt = torch.arange(HB, dtype=torch.int32).view(1, HB)
        self.keys = torch.full((1, H), -1, dtype=torch.int32)
        self.lru = torch.arange(H, dtype=torch.int32).view(1, H)
        self.flags = torch.zeros(1, H, dtype=torch.int32)
        self.arena = torch.zeros(HB * BS, 1)
        self.host = torch.arange(P * BS, dtype=torch.float32).view(-1, 1)
        self.counters = torch.zeros(5, dtype=torch.int64)
        self.policy, self.prefetch = policy, prefetch
        # split: the worker's way (the resolver plans the prefetch, a separate copy moves it)
        self.plan = (torch.full((2, 1, prefetch), -1, dtype=torch.int64)
                     if split and prefetch else None)

    def access(self, sel, band):
        resolve_rows_reference(
            torch.from_numpy(sel.astype(np.int32)).view(1, -1), torch.zeros(1, dtype=torch.int32),
            self.res, self.host_bt, self.hot_bt, self.keys, self.lru, self.arena, self.host, BS,
            self.counters, band=None if band is None else
            torch.from_numpy(band.astype(np.int32)).view(1, -1),
            policy=self.policy, prefetch=self.prefetch, hot_flags=self.flags,
            prefetch_plan=self.plan)
        if self.plan is not None:
            prefetch_copy_reference(self.plan, self.arena, self.host)

    def check_rows(self):
        """Every keyed slot holds its position's host row (host row value = position)."""
        H = self.keys.shape[1]
        for j in range(H):
            key = int(self.keys[0, j])
            if key >= 0:
                assert float(self.arena[int(self.hot_bt[0, j // BS]) * BS + j % BS, 0]) == key


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("policy,prefetch", [("lru", 0), ("score", 0), ("score", 3), ("lru", 2)])
def test_numpy_model_equals_resolver_reference(policy, prefetch, split):
    """``split``: the worker's prefetch off the critical path (plan + separate copy) has the
    fused semantics, so the replay models it unchanged."""
    topk, _ = small_trace(R=1, L=1, S=15)
    cut, H, band = 12, 20, 12
    a = PolicyHotBuffer(H, policy, prefetch, max_pos=160)
    b = ResolverBuffer(H, 160, policy, prefetch, split=split)
    tot = np.zeros(4, dtype=np.int64)
    for t in range(topk.shape[2]):
        row = topk[0, 0, t]
        bnd = row[cut:cut + band] if (policy == "score" or prefetch) else None
        tot += a.access(row[:cut], bnd)
        b.access(row[:cut], bnd)
        assert np.array_equal(a.keys, b.keys[0].numpy())
        assert np.array_equal(a.lru_order(), b.lru[0].numpy())
        assert np.array_equal(a.state(), b.flags[0].numpy())
        b.check_rows()
    assert tot.tolist() == [int(b.counters[0]), int(b.counters[1]), int(b.counters[3]),
                            int(b.counters[4])]


def test_replay_lru_equals_resolver_counters(tmp_path):
    topk, scores = small_trace()
    path = tmp_path / "t.npz"
    np.savez(path, topk=topk, scores=scores)
    cut, H = 12, 24
    res = replay_policies(load_trace(str(path))[0], cut, H, ("lru", "score", "score+prefetch"),
                          band=12, prefetch=3)
    for name, policy, pf in (("lru", "lru", 0), ("score", "score", 0),
                             ("score+prefetch", "score", 3)):
        c = torch.zeros(5, dtype=torch.int64)
        for r in range(topk.shape[0]):
            for layer in range(topk.shape[1]):
                buf = ResolverBuffer(H, 160, policy, pf)
                for t in range(topk.shape[2]):
                    row = topk[r, layer, t]
                    buf.access(row[:cut], row[cut:] if policy == "score" else None)
                c += buf.counters
        assert res[name]["critical_misses"] == int(c[1])
        assert res[name]["prefetched"] == int(c[3])
        assert res[name]["prefetch_used"] == int(c[4])
        assert res[name]["h2d_rows"] == int(c[1] + c[3])
    assert res["belady"]["critical_misses"] if "belady" in res else True


def test_cli_json(tmp_path, capsys):
    topk, scores = small_trace()
    path = tmp_path / "t.npz"
    np.savez(path, topk=topk, scores=scores)
    assert main(["--trace", str(path), "--cut", "12", "--hot-rows", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("lru", "score", "score+prefetch", "belady"):
        for f in ("critical_misses", "prefetched", "prefetch_used", "h2d_rows"):
            assert isinstance(out[name][f], int)
        assert len(out[name]["per_layer"]["critical_misses"]) == 2
    assert out["belady"]["critical_misses"] <= out["lru"]["critical_misses"]


def test_unsorted_scores_rejected(tmp_path):
    topk, scores = small_trace()
    path = tmp_path / "t.npz"
    np.savez(path, topk=topk, scores=scores[..., ::-1])
    with pytest.raises(ValueError, match="sorted"):
        load_trace(str(path))
