"""FP8 block GEMM and fused MoE at decode shapes of one TP-8 rank of DeepSeek-V3.2.

Measures, in one run, against peaks measured in the same run:

- peaks: HBM bandwidth (device-to-device copy of 4 GiB: read + write bytes), dense FP8 rate
  (``torch._scaled_mm`` tensorwise, 8192^3; falls back to the Triton block kernel), dense bf16
  rate (``torch.mm`` 8192^3);
- GEMM: for every rank linear ``(N, K)`` and ``M`` in 1, 16, 64, 256, 512: the Triton
  block-FP8 split-K kernel (``backend="triton"``, what the model runs up to 512 rows; the
  decode-size comparison with the stream kernel it replaced is ``bench_gemm.py``), the
  tile kernel (``backend="triton_tile"``, the model's kernel before it: the baseline),
  ``torch._scaled_mm`` block scaling (1x128 / 128x128; "n/a" where cuBLAS refuses it), and
  bf16 ``torch.mm``; TFLOP/s, GB/s (weights + activations + output), and the fractions of the
  FP8 peak and of HBM bandwidth. Weights rotate through copies larger than L2 so every call
  reads HBM. ``--sweep``: the stream kernel under every candidate launch
  (``_gemm_triton.stream_configs``) and a few chunk counts per linear; prints the best per
  (linear, chunks, M) and, ready to paste, the ``STREAM_CHUNKS`` / ``STREAM_TABLE`` entries
  of the fastest (launches never change the bits; the chunk count does, so it is chosen per
  linear over all M);
- MoE: one rank's MoE layer (256 experts, top 8, expert intermediate 256, hidden 7168, FP8 and
  bf16) at batch 16..256 with uniformly random routing: the routed experts alone
  (``fused_moe``) and the whole layer (router + routed + shared expert) unfused
  (``HISPARSE_FUSED_MOE=0``, the baseline) and fused (:mod:`hisparse.ops.moe_layer`), each
  against the time to read the touched experts' bytes (plus the shared expert and router for
  the layer) at the measured HBM bandwidths (target: <= 1.25x the copy figure, >= 0.8 of the
  read figure), with the layer's kernels (name, launches, GPU time) from one profiled call.

Every timed body is captured in a CUDA graph (many calls per replay), so launch overhead is not
counted: this is what a graph-captured decode step sees. Prints short tables, writes JSON to
``--out``. ``--smoke`` runs tiny shapes on CPU (Triton interpreter) to check the code paths.

    python benchmarks/bench_moe.py --out /tmp/bench_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RANK_LINEARS = {  # name: (N, K) of one TP-8 rank of DeepSeek-V3.2
    "q_a_proj": (1536, 7168), "kv_a_proj": (576, 7168), "q_b_proj": (3072, 1536),
    "o_proj": (7168, 2048), "indexer.wq_b": (8192, 1536), "dense.gate_up": (4608, 7168),
    "dense.down": (7168, 2304), "shared.gate_up": (512, 7168), "shared.down": (7168, 256),
}
SMOKE_LINEARS = {"tiny": (64, 160)}


# ----------------------------------------------------------------------------- timing
def time_fn(fn, *, reps: int = 20, device: str = "cuda") -> float:
    """Seconds per call of ``fn`` (graph-captured ``reps`` calls per replay on CUDA)."""
    if device != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t) / 2
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / reps)
    return best


def measure_peaks(device: str) -> dict:
    if device != "cuda":
        return {"hbm_gb_s": 1.0, "fp8_tflops": 1.0, "bf16_tflops": 1.0}
    S = 8192
    a = torch.randn(S, S, device=device, dtype=torch.bfloat16)
    b = torch.randn(S, S, device=device, dtype=torch.bfloat16)
    bf16 = 2 * S ** 3 / time_fn(lambda: torch.mm(a, b), reps=5) / 1e12  # also raises the clocks
    n = 1 << 31
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)]
    t = time_fn(lambda: bufs[1].copy_(bufs[0]), reps=5)
    hbm = 2 * n / t / 1e9
    # read-only (what a weight-streaming GEMM does): a sum over the same bytes
    t_read = time_fn(lambda: bufs[0].view(torch.bfloat16).sum(dtype=torch.float32), reps=5)
    hbm_read = n / t_read / 1e9
    bufs.clear()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        t8 = time_fn(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                              out_dtype=torch.bfloat16, use_fast_accum=True),
                     reps=5)
        fp8_src = "torch._scaled_mm tensorwise, fast accum"
    except (RuntimeError, TypeError) as e:
        print(f"scaled_mm tensorwise unavailable ({e}); FP8 peak from the Triton kernel")
        from hisparse.ops.gemm import fp8_block_linear, quantize_fp8_weight
        w, s = quantize_fp8_weight(b)
        t8 = time_fn(functools.partial(fp8_block_linear, a, w, s, backend="triton"), reps=5)
        fp8_src = "hisparse triton block kernel"
    return {"hbm_gb_s": hbm, "hbm_source": "device copy, read + write bytes",
            "hbm_read_gb_s": hbm_read, "hbm_read_source": "bf16 sum, bytes read",
            "bf16_tflops": bf16, "fp8_tflops": 2 * S ** 3 / t8 / 1e12, "fp8_peak_source": fp8_src}


# ----------------------------------------------------------------------------- GEMM
def _rotating(fn, pool):
    """A no-argument call of ``fn`` on the next weight of ``pool`` (graph capture records the
    rotation: consecutive calls read different copies, so L2 does not serve them)."""
    state = {"i": 0}

    def call():
        fn(pool[state["i"] % len(pool)])
        state["i"] += 1
    return call, len(pool)


def bench_gemm(peaks: dict, device: str, batches, linears, l2_bytes: int) -> list[dict]:
    from hisparse.ops.gemm import _scaled_mm_usable, fp8_block_linear, quantize_fp8_weight

    rows = []
    for name, (N, K) in linears.items():
        w0 = torch.randn(N, K, device=device) * 0.02
        wq, ws = quantize_fp8_weight(w0)
        copies = max(1, math.ceil(4 * l2_bytes / (N * K)))
        fp8_ws = [(wq.clone(), ws.clone()) for _ in range(copies)]
        bf16_ws = [w0.to(torch.bfloat16) for _ in range(max(1, copies // 2))]
        del w0
        for M in batches:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            flops = 2 * M * N * K
            row = {"op": name, "M": M, "N": N, "K": K}

            for label, fn, pool, wbytes in (
                ("triton", lambda p, x=x: fp8_block_linear(x, p[0], p[1], backend="triton"),
                 fp8_ws, N * K),
                ("tile", lambda p, x=x: fp8_block_linear(x, p[0], p[1], backend="triton_tile"),
                 fp8_ws, N * K),
                ("scaled_mm",
                 lambda p, x=x: fp8_block_linear(x, p[0], p[1], backend="scaled_mm"),
                 fp8_ws, N * K),
                ("bf16", lambda p, x=x: torch.mm(x, p.t()), bf16_ws, 2 * N * K),
            ):
                if label == "scaled_mm" and (device != "cuda" or not _scaled_mm_usable(
                        x, wq, ws, (128, 128), torch.bfloat16)):
                    row[label] = None
                    continue
                call, n = _rotating(fn, pool)
                t = time_fn(call, reps=max(n, 8), device=device)
                byts = wbytes + M * K * 2 + M * N * 2
                row[label] = _rates(t, flops, byts, peaks)
            rows.append(row)
    return rows


def _rates(t: float, flops: int, byts: int, peaks: dict) -> dict:
    return {"us": t * 1e6, "tflops": flops / t / 1e12, "gb_s": byts / t / 1e9,
            "frac_fp8_peak": flops / t / 1e12 / peaks["fp8_tflops"],
            "frac_hbm": byts / t / 1e9 / peaks["hbm_gb_s"]}


def sweep_gemm(peaks: dict, device: str, linears, l2_bytes: int, batches) -> list[dict]:
    """The stream kernel under every candidate launch for each M, for the default chunk count
    and a few others: tuning data for ``STREAM_CHUNKS`` / ``STREAM_TABLE``."""
    from hisparse.ops import _gemm_triton as G
    from hisparse.ops.gemm import quantize_fp8_weight

    rows = []
    for name, (N, K) in linears.items():
        wq, ws = quantize_fp8_weight(torch.randn(N, K, device=device) * 0.02, (128, 128))
        pool = [(wq.clone(), ws.clone()) for _ in range(max(1, math.ceil(4 * l2_bytes / (N * K))))]
        KB = math.ceil(K / 128)
        sms = G._num_sms(wq.device)
        base = G.stream_chunks(N, K, 128, sms)
        cands = sorted({base, 1, max(1, base // 2), min(KB // 2 or 1, 2 * base)})
        for S in cands:
            for M in batches:
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                default = G.stream_config(M, N, K, S, sms)
                row = {"op": name, "M": M, "N": N, "K": K, "chunks": S,
                       "default_chunks": base, "default": _cfg_str(default), "configs": {}}
                other = dataclasses.replace(
                    default, quant="kernel" if default.quant == "gemm" else "gemm")
                cfgs = list(dict.fromkeys([default, other] + G.stream_configs(M)))
                for cfg in cfgs if device == "cuda" else cfgs[:3]:  # --smoke: code paths only
                    call, n = _rotating(lambda p, x=x, cfg=cfg, S=S: G.fp8_block_linear_stream(
                        x, p[0], p[1], (128, 128), torch.bfloat16, config=cfg, chunks=S), pool)
                    try:
                        t = time_fn(call, reps=max(n, 8), device=device)
                    except Exception as e:  # noqa: BLE001 - a launch that does not build is data
                        row["configs"][_cfg_str(cfg)] = {"error": type(e).__name__}
                        continue
                    row["configs"][_cfg_str(cfg)] = _rates(
                        t, 2 * M * N * K, N * K + M * K * 2 + M * N * 2, peaks)
                rows.append(row)
                print_sweep([row], header=len(rows) == 1)  # as it goes: it may be cut short
        del pool
    print_sweep_choice(rows)
    return rows


def _cfg_str(c) -> str:
    return (f"{c.block_t}x{c.block_n}/w{c.num_warps}/s{c.num_stages}/"
            f"{'split' if c.split else 'chain'}/{c.quant}/k{c.blocks}")


def _cfg_parse(text: str):
    from hisparse.ops._gemm_triton import StreamConfig

    tiles, w, st, mode, quant, blocks = text.split("/")
    bt, bn = tiles.split("x")
    return StreamConfig(int(bt), int(bn), int(w[1:]), int(st[1:]), mode == "split", quant,
                        int(blocks[1:]))


def _best(row: dict) -> tuple[str, float]:
    ok = {k: v["us"] for k, v in row["configs"].items() if "us" in v}
    k = min(ok, key=ok.get)
    return k, ok[k]


def print_sweep(rows: list[dict], header: bool = True) -> None:
    if header:
        print("\nStream-kernel sweep (us): default launch, best launch; * = default chunk count")
    for r in rows:
        d = r["configs"].get(r["default"], {})
        k, t = _best(r)
        mark = "*" if r["chunks"] == r["default_chunks"] else " "
        print(f"{r['op']:>15} S={r['chunks']:<3}{mark} M={r['M']:>4} | default "
              f"{d.get('us', float('nan')):7.1f} ({r['default']}) | best {t:7.1f} ({k}) "
              f"frac HBM {r['configs'][k]['frac_hbm']:.2f}", flush=True)


def print_sweep_choice(rows: list[dict]) -> None:
    """Per linear: the chunk count with the least summed best time over the swept M, then the
    table entries (one per M bucket: the largest swept M of the bucket) to paste."""
    from hisparse.ops._gemm_triton import m_bucket

    chunks, table = {}, {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        total: dict[int, float] = {}
        for r in mine:
            total[r["chunks"]] = total.get(r["chunks"], 0.0) + _best(r)[1]
        n_ms = {S: sum(r["chunks"] == S for r in mine) for S in total}
        full = max(n_ms.values())
        S = min((s for s in total if n_ms[s] == full), key=total.get)
        N, K = mine[0]["N"], mine[0]["K"]
        chunks[(N, K)] = S
        for r in sorted((r for r in mine if r["chunks"] == S), key=lambda r: r["M"]):
            table[(N, K, m_bucket(r["M"]))] = _best(r)[0]
        print(f"{op:>15}: chunks {S} (summed best us by chunks: "
              + ", ".join(f"{s}: {t:.1f}" for s, t in sorted(total.items())) + ")")
    print("\nSTREAM_CHUNKS = {" + ", ".join(f"{k}: {v}" for k, v in chunks.items()) + "}")
    print("STREAM_TABLE = {")
    for k, v in table.items():
        c = _cfg_parse(v)
        print(f"    {k}: StreamConfig({c.block_t}, {c.block_n}, {c.num_warps}, {c.num_stages}, "
              f"{c.split}, {c.quant!r}, {c.blocks}),")
    print("}")


GEMM_COLUMNS = (("triton", "split-K (triton)"), ("tile", "tile kernel (old)"),
                ("scaled_mm", "scaled_mm"), ("bf16", "bf16 mm"))


def print_gemm(rows: list[dict]) -> None:
    print("\nFP8 block GEMM: us | frac FP8 peak | frac HBM  (split-K = backend triton, tile = "
          "triton_tile)")
    print(f"{'op':>15} {'M':>4} | " + " | ".join(f"{h:>22}" for _, h in GEMM_COLUMNS)
          + " | old/new")
    for r in rows:
        cells = []
        for k, _ in GEMM_COLUMNS:
            c = r[k]
            cells.append("n/a".rjust(22) if c is None else
                         f"{c['us']:8.1f} {c['frac_fp8_peak']:6.2f} {c['frac_hbm']:6.2f}")
        speed = r["tile"]["us"] / r["triton"]["us"]
        print(f"{r['op']:>15} {r['M']:>4} | " + " | ".join(cells) + f" | {speed:10.2f}x")


# ----------------------------------------------------------------------------- MoE
def moe_config(smoke: bool, fp8: bool):
    from hisparse.bench.decode import model_shape_config
    from hisparse.models.config import DSAConfig

    raw = model_shape_config("deepseek-v3.2-tp8-rank", layers=4)
    if smoke:
        raw.update(hidden_size=128, moe_intermediate_size=32, n_routed_experts=16, n_group=4,
                   topk_group=2, num_experts_per_tok=4)
        raw["quantization_config"]["weight_block_size"] = [32, 32]
    if not fp8:
        raw.pop("quantization_config")
    return DSAConfig.from_hf(raw)


def random_moe(cfg, device: str):
    """One :class:`~hisparse.models.dsa.DSAMoE` of ``cfg`` on ``device`` with benchmark weights:
    FP8 experts ~N(0, 32) clamped to e4m3 with scales 0.02 / 32 (about N(0, 0.02)), biases 0,
    every other weight ~N(0, 0.02); the router gate stored in bf16 (bf16 values, as the
    engine keeps DeepSeek's: ``DSAForCausalLM.narrow_fp32_weights_``); frozen."""
    from hisparse.models.dsa import DSAMoE

    with torch.device(device):
        moe = DSAMoE(cfg)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith("_scale_inv"):
                p.fill_(0.02 / 32)
            elif p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, device=device, dtype=torch.bfloat16) * 32)
                        .clamp_(-448, 448))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    moe.gate.weight = torch.nn.Parameter(moe.gate.weight.detach().bfloat16())
    return moe.requires_grad_(False)


def _with_switches(changes: dict[str, object], fn):
    """``fn`` called (also when a CUDA graph captures it) under those kernel switches
    (``hisparse.ops.switches.override``)."""
    from hisparse.ops import switches

    def call():
        with switches.override(**changes):
            return fn()
    return call


def layer_kernels(fn, device: str, calls: int = 3) -> list[tuple[str, int, float]]:
    """``(kernel, launches, GPU us)`` per eager call of ``fn`` (the mean of ``calls``), slowest
    first (CUDA)."""
    if device != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or "memcpy" in ev.name.lower() \
                or "memset" in ev.name.lower():
            continue
        a = agg.setdefault(ev.name, [0, 0.0])
        a[0] += 1
        a[1] += ev.device_time_total
    return sorted(((k[:60], round(n / calls), us / calls) for k, (n, us) in agg.items()),
                  key=lambda r: -r[2])


# the fused layer's kernels by job (the columns of the per-kernel table)
KERNEL_JOBS = (("align", ("_moe_align",)), ("router", ("_moe_router_gemm",)),
               ("route", ("_moe_route",)), ("quant", ("_moe_quant_act",)),
               ("gate_up", ("_moe_gate_up",)), ("down", ("_moe_down",)),
               ("sum", ("_moe_token_sum",)))


def kernel_jobs(kernels: list[tuple[str, int, float]]) -> dict[str, float]:
    """GPU us per job of :data:`KERNEL_JOBS` (``other``: anything else)."""
    out = {job: 0.0 for job, _ in KERNEL_JOBS} | {"other": 0.0}
    for name, _, us in kernels:
        job = next((j for j, keys in KERNEL_JOBS if any(k in name for k in keys)), "other")
        out[job] += us
    return out


# the fused layer's glue placements (HISPARSE_MOE_ALIGN / HISPARSE_MOE_QUANT): the baseline first
LAYER_VARIANTS = {
    "old": {"moe_align": "single", "moe_quant": "kernel"},
    "new": {"moe_align": "experts", "moe_quant": "fused"},
    "new_h_kernel": {"moe_align": "experts", "moe_quant": "router"},
    "new_h_epilogue": {"moe_align": "experts", "moe_quant": "gate_up"},
}


def bench_moe(peaks: dict, device: str, batches, smoke: bool, weights=("fp8", "bf16"),
              unfused: bool = True) -> list[dict]:
    """Per T: the routed experts alone (``fused_moe``, uniform routing) and the whole layer
    (``DSAMoE``: router + routed + shared) unfused (``HISPARSE_FUSED_MOE=0``: torch router,
    sort-based alignment, the shared expert as its own MLP) and fused under each glue placement
    of :data:`LAYER_VARIANTS` (``old``: the one-program alignment and two quantization kernels;
    FP8 also with the activations quantized in every GEMM tile), each against the bytes it must
    read: touched experts (+ the shared expert and the fp32 router weight for the layer) at the
    measured HBM bandwidths (copy; read), with per-kernel GPU time from profiled eager calls.
    The router and shared weights are re-read by every call of a replay and may hit L2 there:
    at most ~13 MB of a layer's ~500 MB, within the noise of the ratio."""
    from hisparse.ops.moe import fused_moe
    from hisparse.ops.moe_layer import moe_layer

    rows = []
    for fp8 in [w == "fp8" for w in weights]:
        cfg = moe_config(smoke, fp8)
        moe = random_moe(cfg, device)
        if not fp8:
            moe = moe.to(torch.bfloat16)
            moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.float()
        moe.requires_grad_(False)
        ex = moe.experts
        E, k, I, D = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, \
            cfg.hidden_size
        wbytes = 1 if fp8 else 2
        per_expert = 3 * I * D * wbytes
        shared = 3 * I * cfg.n_shared_experts * D * wbytes
        router = E * D * moe.gate.weight.element_size()
        for T in batches:
            g = torch.Generator(device="cpu").manual_seed(T)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
            w = (torch.rand(T, k, generator=g) + 0.1).to(device)
            x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
            touched = int(torch.unique(ids).numel())
            routed_bytes = touched * per_expert
            t_routed = time_fn(functools.partial(
                fused_moe, x, ids, w, ex.gate_up_proj, ex.down_proj,
                gate_up_scale=ex.gate_up_proj_scale_inv, down_scale=ex.down_proj_scale_inv,
                block=ex.block), device=device)
            # the whole layer: its own routing, so touched experts follow the random router
            idx, _ = moe.gate(x)
            touched_layer = int(torch.unique(idx).numel())
            layer_bytes = touched_layer * per_expert + shared + router
            variants = {"unfused": _with_switches({"fused_moe": False},
                                                  functools.partial(moe, x))} if unfused else {}
            variants |= {v: _with_switches(changes | {"fused_moe": True},
                                           functools.partial(moe, x))
                         for v, changes in LAYER_VARIANTS.items()}
            if fp8:
                variants["in_tile_quant"] = functools.partial(
                    moe_layer, x, moe.gate.weight, moe.gate.e_score_correction_bias,
                    moe.gate.routing, ex.gate_up_proj, ex.down_proj,
                    gate_up_scale=ex.gate_up_proj_scale_inv, down_scale=ex.down_proj_scale_inv,
                    block=ex.block, pow2_scale=ex.pow2_scale, shared=moe._fusable_shared(),
                    prequant=False)
            hbm = peaks["hbm_gb_s"] * 1e9
            read = peaks.get("hbm_read_gb_s", peaks["hbm_gb_s"]) * 1e9
            row = {
                "weights": "fp8" if fp8 else "bf16", "T": T, "experts_touched": touched,
                "routed_us": t_routed * 1e6, "routed_ideal_us": routed_bytes / hbm * 1e6,
                "routed_ratio": t_routed / (routed_bytes / hbm),
                "routed_gb_s": routed_bytes / t_routed / 1e9,
                "layer_experts_touched": touched_layer, "layer_bytes": layer_bytes,
                "layer_ideal_us": layer_bytes / hbm * 1e6,
                "layer_ideal_read_us": layer_bytes / read * 1e6,
                "variants": list(variants),
            }
            for name, fn in variants.items():
                t = time_fn(fn, device=device)
                row[f"layer_{name}_us"] = t * 1e6
                row[f"layer_{name}_ratio"] = t / (layer_bytes / hbm)
                row[f"layer_{name}_frac_read_bw"] = (layer_bytes / read) / t
                ks = layer_kernels(fn, device) if name in ("unfused", "old", "new") else []
                row[f"layer_{name}_kernels"] = ks
                row[f"layer_{name}_jobs"] = kernel_jobs(ks)
            rows.append(row)
        moe = ex = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_moe(rows: list[dict]) -> None:
    print("\nMoE layer (one TP-8 rank): us per call (CUDA-graph replay); frac = touched bytes "
          "(experts + shared + router) at the read bandwidth / time (target >= 0.8); old = "
          "one-program align + 2 quant kernels, new = parallel align, x quant in the router "
          "GEMM, h quant in the down tiles; h-kern / h-epi = new with h quantized by its "
          "kernel / in the gate-up epilogue (N tile 128); in-tile = x and h quantized in every "
          "GEMM tile")
    print(f"{'w':>4} {'T':>4} {'exp':>4} | {'routed':>7} | {'unfused':>7} {'frac':>4} | "
          f"{'old':>7} {'frac':>4} | {'new':>7} {'frac':>4} {'n/o':>5} | {'h-kern':>7} "
          f"{'h-epi':>7} {'in-tile':>7} | kernels unf/old/new")
    for r in rows:
        def us(v, r=r):
            t = r.get(f"layer_{v}_us")
            return f"{t:7.1f}" if t is not None else f"{'-':>7}"

        def frac(v, r=r):
            f = r.get(f"layer_{v}_frac_read_bw")
            return f"{f:4.2f}" if f is not None else f"{'-':>4}"
        nk = "/".join(str(sum(n for _, n, _ in r.get(f"layer_{v}_kernels", []))) or "-"
                      for v in ("unfused", "old", "new"))
        print(f"{r['weights']:>4} {r['T']:>4} {r['layer_experts_touched']:>4} | "
              f"{r['routed_us']:7.1f} | {us('unfused')} {frac('unfused')} | {us('old')} "
              f"{frac('old')} | {us('new')} {frac('new')} "
              f"{r['layer_new_us'] / r['layer_old_us']:5.2f} | {us('new_h_kernel')} "
              f"{us('new_h_epilogue')} {us('in_tile_quant')} | {nk}")
    jobs = [j for j, _ in KERNEL_JOBS] + ["other"]
    print("\nper kernel job, GPU us per call (profiled eager calls), old -> new")
    print(f"{'w':>4} {'T':>4} | " + " | ".join(f"{j:>13}" for j in jobs) + " | glue old -> new")
    for r in rows:
        o, n = r["layer_old_jobs"], r["layer_new_jobs"]
        glue = [j for j in jobs if j not in ("gate_up", "down")]
        print(f"{r['weights']:>4} {r['T']:>4} | "
              + " | ".join(f"{o[j]:6.1f}->{n[j]:5.1f}" for j in jobs)
              + f" | {sum(o[j] for j in glue):6.1f} -> {sum(n[j] for j in glue):5.1f}")


def bench_align(device: str, batches, configs) -> list[dict]:
    """The alignment alone (one rank's routing: 256 experts, top 8, + the shared one) per T:
    the one-program kernel and the parallel one under each candidate launch, us per call."""
    from hisparse.ops.moe_layer import FUSED_BLOCK_M, align

    E, k = 256, 8
    rows = []
    for T in batches:
        g = torch.Generator(device="cpu").manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids = torch.cat([ids, torch.full((T, 1), E)], 1).to(torch.int32).to(device)
        row = {"T": T, "single": time_fn(functools.partial(
            align, ids, E + 1, FUSED_BLOCK_M, True, "single"), device=device) * 1e6}
        for c in configs:
            row[_align_str(c)] = time_fn(functools.partial(
                align, ids, E + 1, FUSED_BLOCK_M, True, "experts", c), device=device) * 1e6
        rows.append(row)
    return rows


def bench_router(device: str, batches, configs, smoke: bool = False,
                 gates=("fp32", "bf16")) -> list[dict]:
    """The router GEMM (with the FP8 quantization of ``x``) + routing alone (one rank: 256
    experts of 7168, top 8 of 8 groups, + the shared expert) per T under each candidate
    launch and gate dtype (the same bf16 values: fp32 multiplies in 3xTF32, bf16 in one
    pass, ``_gemm_splitk_triton.fp32_precision``), us per call."""
    from hisparse.ops.moe_layer import RoutingConfig, route_quantized

    E, D, k, G = (16, 128, 4, 4) if smoke else (256, 7168, 8, 8)
    rc = RoutingConfig(top_k=k, n_group=G, topk_group=G // 2, norm_topk_prob=True,
                       routed_scaling_factor=2.5)
    w = (torch.randn(E, D, device=device) * D ** -0.5).bfloat16().float()
    b = torch.randn(E, device=device) * 0.05
    rows = []
    for T in batches:
        x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
        row = {"T": T}
        for gate in gates:
            wg = w.bfloat16() if gate == "bf16" else w
            for c in configs:
                row[f"{_router_str(c)}/{gate}"] = time_fn(functools.partial(
                    route_quantized, x, wg, b, rc, 1, 32 if smoke else 128, False, c),
                    device=device) * 1e6
        rows.append(row)
    return rows


def _router_str(c) -> str:
    return (f"s{c.k_split}/bt{c.block_t}/e{c.block_e}/k{c.block_k}/w{c.gemm_warps}"
            f"/t{c.route_tokens}w{c.route_warps}")


TILE_N_CANDIDATES = ((64, 128), (32, 128), (128, 128), (64, 64), (32, 64))


def bench_tiles(device: str, batches, smoke: bool) -> list[dict]:
    """The fused FP8 layer (default glue) per T under each grouped-GEMM N tile pair of
    :data:`TILE_N_CANDIDATES` (gate-up, down; bit-neutral), us per call."""
    from hisparse.ops.moe_layer import moe_layer

    cfg = moe_config(smoke, True)
    moe = random_moe(cfg, device)
    ex = moe.experts
    rows = []
    for T in batches:
        x = torch.randn(T, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        row = {"T": T}
        for tn in TILE_N_CANDIDATES[:2] if smoke else TILE_N_CANDIDATES:
            row[f"{tn[0]}/{tn[1]}"] = time_fn(functools.partial(
                moe_layer, x, moe.gate.weight, moe.gate.e_score_correction_bias,
                moe.gate.routing, ex.gate_up_proj, ex.down_proj,
                gate_up_scale=ex.gate_up_proj_scale_inv, down_scale=ex.down_proj_scale_inv,
                block=ex.block, pow2_scale=ex.pow2_scale, shared=moe._fusable_shared(),
                tile_n=tn), device=device) * 1e6
        rows.append(row)
    return rows


def print_tiles(rows: list[dict]) -> None:
    names = [k for k in rows[0] if k != "T"]
    print("\nfused FP8 layer under grouped-GEMM N tiles (gate-up/down), us per call "
          f"(default {names[0]})")
    print(f"{'T':>4} | " + " ".join(f"{n:>8}" for n in names) + " | best")
    for r in rows:
        best = min(names, key=lambda n: r[n])
        print(f"{r['T']:>4} | " + " ".join(f"{r[n]:8.1f}" for n in names) + f" | {best}")


def _align_str(c) -> str:
    return f"e{c.experts}/c{c.chunk}/w{c.num_warps}"


def print_router(rows: list[dict]) -> None:
    from hisparse.ops.moe_layer import ROUTER_CONFIG

    names = [k for k in rows[0] if k != "T"]
    print(f"\nrouter GEMM (+ x quant) + routing alone, us per call; launch = K split / tokens / "
          f"experts per program / K step / GEMM warps / routing tokens + warps per program / "
          f"gate dtype (default: {_router_str(ROUTER_CONFIG)})")
    for i, n in enumerate(names):
        print(f"  [{i}] {n}")
    print(f"{'T':>4} | " + " ".join(f"{f'[{i}]':>7}" for i in range(len(names))) + " | best")
    for r in rows:
        best = min(range(len(names)), key=lambda i: r[names[i]])
        print(f"{r['T']:>4} | " + " ".join(f"{r[n]:7.1f}" for n in names)
              + f" | [{best}] {names[best]}")


def print_align(rows: list[dict], configs) -> None:
    from hisparse.ops.moe_layer import ALIGN_CONFIG

    names = ["single"] + [_align_str(c) for c in configs]
    print(f"\nalign alone, us per call (default: {_align_str(ALIGN_CONFIG)})")
    print(f"{'T':>4} | " + " ".join(f"{n:>13}" for n in names) + " | best")
    for r in rows:
        best = min(names[1:], key=lambda n: r[n])
        print(f"{r['T']:>4} | " + " ".join(f"{r[n]:13.1f}" for n in names) + f" | {best}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64,256,512", help="GEMM rows M")
    p.add_argument("--moe-batches", default="8,16,24,48,64,128,256", help="MoE tokens T")
    p.add_argument("--skip-unfused", action="store_true",
                   help="MoE: without the unfused layer (HISPARSE_FUSED_MOE=0)")
    p.add_argument("--align-sweep", action="store_true",
                   help="the alignment alone, one-program vs parallel under candidate launches")
    p.add_argument("--tile-sweep", action="store_true",
                   help="the fused FP8 layer under the grouped GEMMs' N tile candidates")
    p.add_argument("--router-sweep", action="store_true",
                   help="the router GEMM + routing alone under candidate launches")
    p.add_argument("--moe-weights", default="fp8,bf16", help="MoE expert weights: fp8, bf16")
    p.add_argument("--sweep", action="store_true",
                   help="stream-kernel launch / chunk sweep (with --skip-gemm --skip-moe alone)")
    p.add_argument("--sweep-ops", default="", help="comma-separated linears to sweep (all)")
    p.add_argument("--sweep-batches", default="16,64,256,512", help="M for the sweep")
    p.add_argument("--out", default="bench_moe.json")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter (code-path check)")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["HISPARSE_FORCE_TRITON"] = "1"
        from hisparse.ops import switches
        switches.reload()
        device, batches, moe_batches, linears = "cpu", [1, 16], [16], SMOKE_LINEARS
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_moe needs a CUDA device (or --smoke)")
        device, linears = "cuda", RANK_LINEARS
        batches = [int(b) for b in a.batches.split(",")]
        moe_batches = [int(b) for b in a.moe_batches.split(",")]
    l2 = (torch.cuda.get_device_properties(0).L2_cache_size
          if device == "cuda" and hasattr(torch.cuda.get_device_properties(0), "L2_cache_size")
          else 64 << 20)
    peaks = measure_peaks(device)
    print(json.dumps(peaks))
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "peaks": peaks}
    if not a.skip_gemm:
        out["gemm"] = bench_gemm(peaks, device, batches, linears, l2)
        print_gemm(out["gemm"])
    if not a.skip_moe:
        weights = [w for w in a.moe_weights.split(",") if w]
        if not weights or set(weights) - {"fp8", "bf16"}:
            raise SystemExit(f"--moe-weights: fp8 and/or bf16, got {a.moe_weights!r}")
        out["moe"] = bench_moe(peaks, device, moe_batches, a.smoke, weights,
                               unfused=not a.skip_unfused)
        print_moe(out["moe"])
    if a.align_sweep:
        from hisparse.ops.moe_layer import AlignConfig

        configs = [AlignConfig(8, 1024), AlignConfig(4, 512), AlignConfig(8, 512),
                   AlignConfig(16, 1024), AlignConfig(8, 1024, 8)]
        if a.smoke:
            configs = configs[:2]
        out["align"] = bench_align(device, moe_batches, configs)
        print_align(out["align"], configs)
    if a.tile_sweep:
        out["tiles"] = bench_tiles(device, moe_batches, a.smoke)
        print_tiles(out["tiles"])
    if a.router_sweep:
        from hisparse.ops.moe_layer import ROUTER_CONFIG, RouterConfig

        four = dict(route_tokens=4, route_warps=4)   # the former default's routing launch
        configs = [ROUTER_CONFIG, RouterConfig(block_e=32, **four), RouterConfig(block_e=32),
                   RouterConfig(route_tokens=2, route_warps=2), RouterConfig(block_e=16),
                   RouterConfig(k_split=256), RouterConfig(block_t=32),
                   RouterConfig(block_t=64, block_e=32), RouterConfig(block_t=64, gemm_warps=8)]
        if a.smoke:
            configs = [RouterConfig(k_split=64, block_k=32, block_e=8),
                       RouterConfig(block_e=32, **four)]
        out["router"] = bench_router(device, moe_batches, configs, a.smoke)
        print_router(out["router"])
    if a.sweep:
        ops = [o for o in a.sweep_ops.split(",") if o]
        bad = [o for o in ops if o not in linears]
        if bad:
            raise SystemExit(f"--sweep-ops: unknown {bad}; known: {list(linears)}")
        sweep_linears = {o: linears[o] for o in ops} if ops else linears
        out["sweep"] = sweep_gemm(peaks, device, sweep_linears, l2, [16] if a.smoke else
                                  [int(b) for b in a.sweep_batches.split(",")])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
