"""Where one resolver program's time goes, phase by phase (H200; issue 24 item 3).

    PYTHONPATH=. python benchmarks/probe_resolver_phases.py [--requests 8,42] [--out F.json]

The resolver is one program per request group walking phases A-E one after another
(``hisparse/ops/_resolve_triton.py``); its kernel time is one program's latency, whatever the
request count. This probe times each phase inside the program: it loads the kernel module's
source, inserts a read of the SM cycle counter (``%clock64``) before every phase marker
comment (``# ---- X``) and after the last counter update, stores the stamps past the counters
(``counters[16 + 2 * SLOTS * t + 2 * i]``, then the ``%globaltimer`` stamp), and runs the
bench's scenarios (``bench_resolver.build`` and ``scenario_step``) in a CUDA graph as the
engine does. It reports, per phase, the median over group leaders of the
cycles from that stamp to the next, and the program's whole span, in cycles and in us (the
span in ``%globaltimer`` ns over its span in cycles gives the clock). The instrumented kernel is
a copy made at run time: the package's kernel is not changed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_resolver as br  # noqa: E402
from kernel_copy import load_ops_module  # noqa: E402

from hisparse.bench.decode import topk_table  # noqa: E402
from hisparse.ops import ResolveWorkspace  # noqa: E402

SLOTS = 16          # stamps per program
SRC = Path(__file__).resolve().parents[1] / "hisparse" / "ops" / "_resolve_triton.py"


def _stamp(i: int, indent: str) -> list[str]:
    return [f"{indent}_c{i} = tl.inline_asm_elementwise('mov.u64 $0, %clock64;', '=l,r', [t], "
            f"dtype=tl.int64, is_pure=False, pack=1)\n",
            f"{indent}_g{i} = tl.inline_asm_elementwise('mov.u64 $0, %globaltimer;', '=l,r', "
            f"[t], dtype=tl.int64, is_pure=False, pack=1)\n",
            f"{indent}tl.store(cnt_ptr + 16 + t * {2 * SLOTS} + {2 * i}, _c{i})\n",
            f"{indent}tl.store(cnt_ptr + 16 + t * {2 * SLOTS} + {2 * i + 1}, _g{i})\n"]


def instrumented_source(src: Path = SRC) -> tuple[str, list[str]]:
    """The kernel module's text with stamps; the phase names in stamp order."""
    lines = src.read_text().splitlines(keepends=True)
    out, names = [], []
    in_kernel = False
    for line in lines:
        if line.startswith("def _resolve_kernel"):
            in_kernel = True
        elif in_kernel and line.startswith("def "):
            in_kernel = False
        m = re.match(r"^(\s+)# ---- (\S+?)[:( ]", line)
        if in_kernel and m:
            out += _stamp(len(names), m.group(1))
            names.append(m.group(2))
        out.append(line)
        if in_kernel and line.strip() == "t = tl.program_id(0)":
            indent = re.match(r"^(\s*)", line).group(1)
            out += _stamp(len(names), indent)
            names.append("entry")
        if in_kernel and line.strip().startswith("tl.atomic_add(cnt_ptr + 1, n_miss"):
            indent = re.match(r"^(\s*)", line).group(1)
            out += _stamp(len(names), indent)
            names.append("end")
    assert len(names) <= SLOTS and names[-1] == "end", names
    return "".join(out), names


def load_instrumented(src: Path = SRC):
    text, names = instrumented_source(src)
    mod = load_ops_module("_resolve_phases", text=text)
    return mod.resolve_rows_triton, names, "ep_ptr" not in text


def run(R: int, ctx: int, scenario: str, resolve, names, table, host, legacy: bool,
        policy: br.Policy) -> dict:
    gen = torch.Generator().manual_seed(0)
    b = br.build(R, ctx, scenario, gen, host)
    b["counters"] = torch.zeros(16 + R * 2 * SLOTS, dtype=torch.int64, device="cuda")
    ws = ResolveWorkspace(R, b["P"] * br.BS, br.H, "cuda")
    if legacy:
        br.legacy_map(ws)
    replay = br.Replay(R, b, ws, resolve, {}, table, policy)
    per_phase: dict[str, list[float]] = {n: [] for n in names[:-1]}
    spans, span_us, kernel_us = [], [], []
    for i in range(br.WARM + br.TIMED):
        replay.feed(i)
        br.scenario_step(b, scenario, i)
        b["counters"][16:] = 0
        us = replay.timed()
        if i < br.WARM:
            continue
        kernel_us.append(us)
        st = b["counters"][16:].view(R, SLOTS, 2)[:, :len(names)].cpu()
        for r in range(R):
            c, g = st[r, :, 0], st[r, :, 1]
            if c[0] == 0 or c[-1] == 0:       # not a leader, or left through an early exit
                continue
            spans.append(int(c[-1] - c[0]))
            span_us.append((int(g[-1] - g[0])) / 1e3)
            seen = [j for j in range(len(names)) if c[j] != 0]
            for a, z in zip(seen, seen[1:]):
                per_phase[names[a]].append(int(c[z] - c[a]))
    replay.check()
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    span_c, span_t = med(spans), med(span_us)
    ghz = span_c / (span_t * 1e3) if span_c and span_t else None
    phases = {n: med(v) for n, v in per_phase.items() if v}
    return dict(scenario=scenario, requests=R, kernel_us=med(kernel_us),
                program_span_cycles=span_c, program_span_us=span_t, ghz=ghz,
                phase_cycles=phases,
                phase_us={n: (c / ghz / 1e3 if ghz else None) for n, c in phases.items()})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", default="8,42")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--scenarios", default="steady,leased")
    p.add_argument("--source", default=str(SRC),
                   help="another version of _resolve_triton.py to instrument (a baseline)")
    p.add_argument("--policy", default="lru", help="lru or score+prefetch (bench_resolver.Policy)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    resolve, names, legacy = load_instrumented(Path(a.source))
    table = topk_table("synthetic:0.8", 1, a.context, br.WARM + br.TIMED, br.K)
    policy = br.Policy(a.policy, table)
    reqs = [int(x) for x in a.requests.split(",")]
    host = torch.empty((max(reqs) * br.pages(a.context) * br.BS, br.ROW), dtype=torch.uint8,
                       pin_memory=True)
    rows = []
    for scenario in a.scenarios.split(","):
        for R in reqs:
            r = run(R, a.context, scenario, resolve, names, table, host, legacy, policy)
            r["source"], r["policy"] = a.source, a.policy
            rows.append(r)
            ph = "  ".join(f"{n} {u:.1f}" for n, u in r["phase_us"].items() if u is not None)
            print(f"{scenario:<8} R={R:<3} graph {r['kernel_us']:7.1f} us (resolver + gather), "
                  f"program {r['program_span_us']:.1f} us at {r['ghz'] or 0:.2f} GHz | {ph}",
                  flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
