"""Hot-buffer hit rates (resolver LRU vs the offline optimum, Belady) for recorded and synthetic
top-k selections. CPU only.

Sources: the SmolLM2-135M trace recorded by ``benchmarks/record_trace.py`` (replayed at the
benchmark's scale by ``TraceTopk``'s tiling, and at its own scale as a cross-check of the
mapping), and ``SyntheticTopk`` at several step-to-step overlaps. Hot buffers of 1x, 2x and 3x
top-k per (layer, request), nothing resident; rates exclude the cold first step.

    python benchmarks/bench_locality.py --out out/bench_locality.json

With ``--policies`` it replays a trace through hot-buffer policies instead (the same tool as
``hisparse bench-policy``; see ``hisparse/bench/policy.py`` for the trace format):

    python benchmarks/bench_locality.py --trace T.npz --cut 128 --hot-rows 256 \
        --policies lru,score,score+prefetch,belady --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hisparse.bench.locality import SyntheticTopk, TraceTopk, replay_hit_rates

DEFAULT_TRACE = os.path.expanduser("~/.cache/hisparse/smollm2_trace.npz")


def run(name, src, layers, streams, steps, context, k, mults, rows):
    t = time.perf_counter()
    res = replay_hit_rates(src, layers, streams, steps, context, k, [m * k for m in mults])
    dt = time.perf_counter() - t
    row = {"source": name, "layers": layers, "streams": streams, "steps": steps,
           "context_len": context, "k": k, "seconds": dt, "results": res}
    rows.append(row)
    ov = res[0]["overlap_per_layer"]
    cells = "".join(f" | {r['hit_rate']:.3f} / {r['belady_hit_rate']:.3f}" for r in res)
    print(f"| {name} | {context} | {k} | {res[0]['overlap']:.3f} ({min(ov):.2f}-{max(ov):.2f})"
          f"{cells} |", flush=True)
    return row


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if any(x == "--policies" or x.startswith("--policies=") for x in argv):
        # policy replay (issue 15): the same tool as ``hisparse bench-policy``
        from hisparse.bench.policy import main as policy_main

        return policy_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="npz from benchmarks/record_trace.py")
    ap.add_argument("--out", default="bench_locality.json", help="JSON results")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--synthetic-layers", type=int, default=8)
    ap.add_argument("--overlaps", default="0.6,0.8,0.95")
    ap.add_argument("--sizes", default="1,2,3", help="hot buffer sizes in multiples of top-k")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    mults = [int(x) for x in a.sizes.split(",")]
    rows: list[dict] = []
    head = "".join(f" | H={m}x LRU / Belady" for m in mults)
    print(f"| source | context | k | overlap mean (layer min-max){head} |")
    print("|" + " --- |" * (4 + len(mults)))
    if os.path.exists(a.trace):
        tr = TraceTopk(a.trace)
        steps = min(a.steps, tr.steps)
        run(f"trace SmolLM2 x{tr.tiles(a.k)} tiles", tr, tr.num_layers, a.streams, steps,
            a.context, a.k, mults, rows)
        run("trace SmolLM2 native", tr, tr.num_layers, min(a.streams, tr.docs), steps,
            tr.ctx0, tr.k, mults, rows)
    else:
        print(f"(no trace at {a.trace}: run benchmarks/record_trace.py first)")
    for ov in [float(x) for x in a.overlaps.split(",")]:
        src = SyntheticTopk(ov, a.synthetic_layers, seed=a.seed)
        run(f"synthetic {ov}", src, a.synthetic_layers, a.streams, a.steps, a.context, a.k,
            mults, rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
