"""Hot-buffer policy replay: recorded top-k traces through each replacement / prefetch policy with
the resolver's exact semantics (``hisparse bench-policy``).

Trace format (npz), any source: key ``topk``, int ``[requests, layers, steps, k]``: per decode
step the positions of one (request, layer) sorted by descending score (best first), ``-1``
padding; keep more ranks than the replayed cut (e.g. ``k = 2 * cut``) so the prefetch band
(ranks ``cut .. cut + band - 1``) can be evaluated. Optional ``scores`` of the same shape (only
checked to be non-increasing along ranks: the policies use rank order). Traces written by
``benchmarks/record_trace.py`` have both; its older ``positions`` + ``below_cut`` pair is also
accepted (concatenated along ranks).

Policies (each one a configuration of :func:`hisparse.ops.resolve_rows`):

- ``lru``: the resolver's default: a miss takes the least-recently-used slot not selected now;
- ``score``: a miss first takes slots whose row is not among this step's next-ranked band (LRU
  order among them), then band rows, worst rank first: the rows with the lowest current indexer
  score go first (rows outside top-(cut + band) score below every band row); among the rows
  outside the band, those used fewer than 3 times since they were loaded go first (frequency
  protection, a segmented LRU); band rows that stay hot count as used (recency over the
  top-(cut + band), not only the top-cut);
- ``score+prefetch``: ``score``, plus up to ``prefetch`` band rows per step that miss the hot
  buffer are fetched (best rank first) into slots that hold neither a selected nor a band row
  (LRU order), off the critical path (the engine's resolver only plans them; the copies run on
  a side stream after it and land before the next step: the state after a step is the fused
  call's, so this model holds for both, tested);
- ``belady``: the offline optimum of demand paging (evict the row used farthest in the future).

Per policy, per layer and overall, summed over requests and steps (``warmup`` first steps
excluded; 0 by default, so the cold start counts): ``critical_misses`` (rows a step waits for),
``prefetched`` (rows fetched ahead), ``prefetch_used`` (prefetched rows later selected while
still hot), ``h2d_rows = critical_misses + prefetched`` and ``h2d_bytes = h2d_rows * row_bytes``.
:class:`PolicyHotBuffer` is a numpy model of one (layer, request) buffer; it matches
:func:`~hisparse.ops.resolve_rows_reference` keys, order and counters exactly (tested), so
``lru`` numbers equal the resolver's own counters on the same trace.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hisparse.bench.locality import belady_misses

__all__ = ["POLICIES", "PolicyHotBuffer", "load_trace", "replay_policies", "main"]

POLICIES = ("lru", "score", "score+prefetch", "belady")
PROTECT = 3            # = hisparse.ops.resolve.PROTECT_USES
COUNT_CAP = 1 << 20    # = hisparse.ops.resolve.USE_COUNT_CAP


def split_policy(name: str) -> tuple[str, bool]:
    """``"score+prefetch"`` -> ``("score", True)``; resolver policy name and prefetch flag."""
    base, _, extra = name.partition("+")
    if base not in ("lru", "score") or extra not in ("", "prefetch"):
        raise ValueError(f"unknown hot policy {name!r}: use lru, score, score+prefetch "
                         f"(or lru+prefetch)")
    return base, extra == "prefetch"


class PolicyHotBuffer:
    """One (layer, request) hot buffer of ``hot_size`` slots, nothing resident, every row on
    host: :func:`hisparse.ops.resolve_rows_reference` semantics for one token per step, in numpy.

    LRU order is kept as a per-slot stamp (ascending = oldest first). ``access(sel, band)``
    returns ``(hits, misses, prefetched, prefetch_used)``.
    """

    def __init__(self, hot_size: int, policy: str = "lru", prefetch: int = 0,
                 max_pos: int = 1024) -> None:
        if policy not in ("lru", "score"):
            raise ValueError(f"PolicyHotBuffer: policy must be lru or score, got {policy!r}")
        self.hot_size = H = int(hot_size)
        self.policy, self.prefetch = policy, int(prefetch)
        self.keys = np.full(H, -1, dtype=np.int64)
        self.stamp = np.arange(H, dtype=np.int64) - H
        self.flags = np.zeros(H, dtype=bool)
        self.count = np.zeros(H, dtype=np.int64)         # uses since loaded (demand load = 1)
        self.clock = 0
        self.slot_of = np.full(max(1, max_pos), -1, dtype=np.int64)

    def lru_order(self) -> np.ndarray:
        return np.argsort(self.stamp, kind="stable")

    def state(self) -> np.ndarray:
        """Per-slot policy state as the resolver's ``hot_flags``: ``count << 1 | prefetched``."""
        return self.count * 2 + self.flags

    def _grow(self, top: int) -> None:
        if top >= len(self.slot_of):
            g = np.full(max(top + 1, 2 * len(self.slot_of)), -1, dtype=np.int64)
            g[:len(self.slot_of)] = self.slot_of
            self.slot_of = g

    def access(self, sel: np.ndarray, band: np.ndarray | None = None) -> tuple[int, int, int, int]:
        H = self.hot_size
        sel = np.asarray(sel, dtype=np.int64)
        sel = sel[sel >= 0]
        band = np.zeros(0, dtype=np.int64) if band is None else np.asarray(band, dtype=np.int64)
        band = band[band >= 0]
        top = max(int(sel.max()) if len(sel) else 0, int(band.max()) if len(band) else 0)
        self._grow(top)
        slots = self.slot_of[sel]
        hit = slots >= 0
        hit_slots = slots[hit]
        miss_pos = sel[~hit]
        h, m = len(hit_slots), len(miss_pos)
        referenced = np.zeros(H, dtype=bool)
        referenced[hit_slots] = True
        # band: drop selected rows and repeats (first reference wins)
        if len(band):
            in_sel = np.zeros(top + 1, dtype=bool)
            in_sel[sel] = True
            band = band[~in_sel[band]]
            _, first = np.unique(band, return_index=True)
            band = band[np.sort(first)]
        bslots = self.slot_of[band]
        held = bslots[bslots >= 0]                       # band-held slots, band (rank) order
        band_miss = band[bslots < 0]
        in_band = np.zeros(H, dtype=bool)
        in_band[held] = True
        order = self.lru_order()
        cand = order[~referenced[order]]
        if self.policy == "score":
            nb = cand[~in_band[cand]]
            prot = self.count[nb] >= PROTECT
            cand = np.concatenate([nb[~prot], nb[prot], held[::-1]])
        if m > len(cand):
            raise ValueError(f"PolicyHotBuffer: {m} misses but only {len(cand)} unreferenced slots")
        victims = cand[:m]
        pf_v = np.zeros(0, dtype=np.int64)
        if self.prefetch and len(band_miss):
            busy = referenced | in_band
            busy[victims] = True
            pf_c = order[~busy[order]]
            n_pf = min(len(band_miss), self.prefetch, len(pf_c))
            pf_v = pf_c[:n_pf]
        pf_pos = band_miss[:len(pf_v)]
        used = int(self.flags[hit_slots].sum())
        self.flags[hit_slots] = False
        self.flags[victims] = False
        self.flags[pf_v] = True
        self.count[hit_slots] = np.minimum(self.count[hit_slots] + 1, COUNT_CAP)
        self.count[victims] = 1
        self.count[pf_v] = 0
        for pos, vs in ((miss_pos, victims), (pf_pos, pf_v)):
            if len(vs):
                old = self.keys[vs]
                self.slot_of[old[old >= 0]] = -1
                self.keys[vs] = pos
                self.slot_of[pos] = vs
        n_pf = len(pf_v)
        nbh = 0
        if self.policy == "score":
            # band rows still hot are touched: right after the untouched, worst rank first
            kept = held[~np.isin(held, victims)]
            nbh = len(kept)
            self.stamp[kept[::-1]] = self.clock + np.arange(nbh)
        c = self.clock + nbh
        self.stamp[pf_v] = c + np.arange(n_pf)
        self.stamp[victims] = c + n_pf + np.arange(m)
        if h:
            hs = hit_slots[np.argsort(self.stamp[hit_slots], kind="stable")]
            self.stamp[hs] = c + n_pf + m + np.arange(h)
        self.clock = c + n_pf + m + h
        return h, m, n_pf, used


def load_trace(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(topk [R, L, S, k] int64, scores or None)`` from a trace npz (see the module doc)."""
    with np.load(path, allow_pickle=False) as z:
        if "topk" in z.files:
            topk = z["topk"]
        elif "positions" in z.files:
            parts = [z["positions"]] + ([z["below_cut"]] if "below_cut" in z.files else [])
            topk = np.concatenate(parts, axis=-1)
        else:
            raise ValueError(f"{path}: no 'topk' (or 'positions') array")
        scores = z["scores"] if "scores" in z.files else None
    topk = np.asarray(topk).astype(np.int64)
    if topk.ndim != 4:
        raise ValueError(f"{path}: topk must be [requests, layers, steps, k], got {topk.shape}")
    if scores is not None:
        if scores.shape != topk.shape:
            raise ValueError(f"{path}: scores shape {scores.shape} != topk shape {topk.shape}")
        s = np.where(topk >= 0, scores, -np.inf)
        if (np.diff(s, axis=-1) > 1e-6 * np.abs(s[..., :-1]).clip(min=1e-30)).any():
            raise ValueError(f"{path}: topk must be sorted by descending score")
    return topk, scores


def replay_policies(topk: np.ndarray, cut: int, hot_rows: int,
                    policies=("lru", "score", "score+prefetch", "belady"), band: int | None = None,
                    prefetch: int | None = None, row_bytes: int = 656, warmup: int = 0) -> dict:
    """Replays ``topk [R, L, S, k]`` (rank order) at top-``cut`` through each policy with
    ``hot_rows`` slots per (layer, request). ``band`` next-ranked positions per step (default
    all ranks kept beyond the cut, at most ``cut``); ``prefetch`` rows per step at most (default
    ``max(1, cut // 64)``, as the engine). Returns ``{policy: {totals..., "per_layer":
    {name: [L]}}}`` plus ``"config"``."""
    R, L, S, k = topk.shape
    if not 1 <= cut <= k:
        raise ValueError(f"cut must be in [1, {k}], got {cut}")
    if hot_rows < cut:
        raise ValueError(f"hot_rows ({hot_rows}) must be >= cut ({cut})")
    band = min(k - cut, cut) if band is None else min(int(band), k - cut)
    prefetch = max(1, cut // 64) if prefetch is None else int(prefetch)
    warmup = min(max(0, int(warmup)), S)
    max_pos = int(topk.max()) + 1
    fields = ("lookups", "critical_misses", "prefetched", "prefetch_used", "h2d_rows")
    out: dict = {"config": {"requests": R, "layers": L, "steps": S, "ranks": k, "cut": cut,
                            "hot_rows": hot_rows, "band": band, "prefetch": prefetch,
                            "row_bytes": row_bytes, "warmup": warmup}}
    for name in policies:
        acc = {f: np.zeros(L, dtype=np.int64) for f in fields}
        for r in range(R):
            for layer in range(L):
                sels = [topk[r, layer, t, :cut] for t in range(S)]
                sels = [s_[s_ >= 0] for s_ in sels]
                for t in range(warmup, S):
                    acc["lookups"][layer] += len(sels[t])
                if name == "belady":
                    miss = belady_misses(sels, hot_rows)[warmup:].sum()
                    acc["critical_misses"][layer] += miss
                    acc["h2d_rows"][layer] += miss
                    continue
                base, pf = split_policy(name)
                buf = PolicyHotBuffer(hot_rows, base, prefetch if pf else 0, max_pos)
                for t in range(S):
                    b = topk[r, layer, t, cut:cut + band] if (pf or base == "score") else None
                    _, m, n_pf, used = buf.access(sels[t], b)
                    if t >= warmup:
                        acc["critical_misses"][layer] += m
                        acc["prefetched"][layer] += n_pf
                        acc["prefetch_used"][layer] += used
                        acc["h2d_rows"][layer] += m + n_pf
        res = {f: int(acc[f].sum()) for f in fields}
        res["h2d_bytes"] = res["h2d_rows"] * row_bytes
        res["miss_rate"] = res["critical_misses"] / max(1, res["lookups"])
        res["per_layer"] = {f: acc[f].tolist() for f in fields}
        res["per_layer"]["miss_rate"] = [float(a / max(1, b)) for a, b in
                                         zip(acc["critical_misses"], acc["lookups"])]
        out[name] = res
    if "lru" in out:
        base = out["lru"]
        for name in policies:
            r = out[name]
            r["misses_vs_lru"] = r["critical_misses"] / max(1, base["critical_misses"])
            r["h2d_vs_lru"] = r["h2d_rows"] / max(1, base["h2d_rows"])
    return out


def format_table(res: dict) -> str:
    c = res["config"]
    lines = [f"cut {c['cut']}, hot rows {c['hot_rows']}, band {c['band']}, prefetch <= "
             f"{c['prefetch']}/step, {c['requests']} req x {c['layers']} layers x {c['steps']} "
             f"steps (warmup {c['warmup']} excluded)",
             "| policy | critical misses | miss rate | vs LRU | prefetched | prefetch used | "
             "H2D rows | H2D vs LRU | layer miss rate min-max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        if name == "config":
            continue
        lm = r["per_layer"]["miss_rate"]
        lines.append(f"| {name} | {r['critical_misses']} | {r['miss_rate']:.4f} | "
                     f"{r.get('misses_vs_lru', float('nan')):.3f} | {r['prefetched']} | "
                     f"{r['prefetch_used']} | {r['h2d_rows']} | "
                     f"{r.get('h2d_vs_lru', float('nan')):.3f} | {min(lm):.3f}-{max(lm):.3f} |")
    return "\n".join(lines)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from hisparse.engine.arg_utils import ArgParser

    ap = ap or ArgParser(prog="hisparse bench-policy",
                                       description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="npz with 'topk' [requests, layers, steps, k]")
    ap.add_argument("--cut", type=int, default=None, help="replayed top-k (default k / 2)")
    ap.add_argument("--hot-rows", type=int, default=None, help="slots per buffer (default 2 x cut)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--band", type=int, default=None, help="next-ranked band width (default cut)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="max prefetched rows per (layer, request) step (default cut / 64)")
    ap.add_argument("--row-bytes", type=int, default=656, help="bytes per row (656 FP8, 1152 bf16)")
    ap.add_argument("--warmup", type=int, default=0, help="first steps left out of the counts")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N")
    ap.add_argument("--json", action="store_true", help="print JSON (per policy totals + layers)")
    return ap


def run_args(a: argparse.Namespace) -> int:
    topk, _ = load_trace(a.trace)
    if a.requests:
        topk = topk[:a.requests]
    cut = a.cut or topk.shape[-1] // 2
    hot = a.hot_rows or 2 * cut
    res = replay_policies(topk, cut, hot, [p.strip() for p in a.policies.split(",") if p.strip()],
                          band=a.band, prefetch=a.prefetch, row_bytes=a.row_bytes,
                          warmup=a.warmup)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(format_table(res))
    return 0


def main(argv=None) -> int:
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
