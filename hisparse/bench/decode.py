"""Capacity-bound long-context decode: GPU-only vs HiSparse vs always-host in one run.

Model: DeepSeek-V3.2 geometry as one tensor-parallel rank of eight sees it (16 query heads,
kv_lora_rank 512, rope 64, indexer 64 x 128, index_topk 2048, block 64), random weights (dummy
load), bf16, dense MLP layers. Prompts get random KV rows instead of a prefill forward (decode
speed is what is measured; see :mod:`hisparse.bench.synthetic`, plugged in through
``LLM(runner_cls=...)``); decode runs the full model. Only the public engine API is used.

Top-k sources: ``indexer`` (the model's own indexer: random weights, unrealistic locality),
``synthetic:<overlap>`` and ``trace:<npz>`` (selections replayed in place of the indexer output;
the indexer still runs so its cost is counted). The hot policies ``score`` and
``score+prefetch`` read the next-ranked band (ranks k..2k-1): a trace replays its recorded band
(``below_cut``, tiled like its top-k), the indexer has its own; a synthetic source has none (no
rank structure), so ``--topk synthetic:<p>`` takes ``lru`` only and ``--locality`` sources without
a band run ``lru`` only (``synthetic:1.0`` is the all-hit baseline: the only row entering per step
is the newest token, which is resident). When ``synthetic:1.0`` points ran, a last table gives
every point's step time as a ratio to the all-hit point of its mode, context and concurrency.

Profiles (``--profile``): ``default`` is the 8-layer model above. ``tp8-rank`` has the per-step
cost shape of one TP-8 rank of DeepSeek-V3.2 at high batch (DESIGN section 7): 4 layers whose
dense MLP has intermediate 32768 (~1.4 GB of bf16 weights read per layer per step, standing in
for a real rank's MoE expert traffic until real MoE/FP8 weights run), a GPU KV budget of 690k
tokens (what a real rank keeps after its weights), 32k and 64k prompts, synthetic top-k with 0.8
step-to-step overlap, concurrency swept up to the host-pool and hot-buffer limits.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict

import torch

from hisparse.bench import scratch_dir
from hisparse.bench.replay import replay_rows
from hisparse.bench.report import (
    Point,
    plot,
    print_efficiency_table,
    print_kernel_table,
    print_ratio_table,
    print_table,
)
from hisparse.config import Mode, cdiv
from hisparse.engine.arg_utils import host_pool_gib_arg
from hisparse.models.shapes import MODEL_SHAPES, TP8_GEOMETRY, model_shape_config  # noqa: F401
from hisparse.ops import switches


def touched_weight_bytes(cfg, batch: int) -> int:
    """Expected weight bytes one decode step of ``batch`` tokens reads: every non-routed weight
    plus, per MoE layer, the experts hit (uniform routing: ``E * (1 - (1 - k/E) ** batch)``)."""
    from hisparse.engine.capacity import geometry_from_config

    total = geometry_from_config(cfg).weight_bytes
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    if not n_moe:
        return int(total)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * (
        1 if cfg.fp8_block else cfg.dtype.itemsize)
    hit = E * (1.0 - (1.0 - k / E) ** max(batch, 1))
    return int(total - n_moe * (E - hit) * per_expert)


PROFILES = {
    "default": dict(layers=8, contexts="65536", concurrency="8,32,64,max", outputs=64,
                    gpu_kv_gib=16.0, gpu_kv_tokens=None, intermediate_size=None,
                    topk="indexer"),
    "tp8-rank": dict(layers=4, contexts="32768,65536", concurrency="8,21,64,128,max",
                     outputs=64, gpu_kv_gib=None, gpu_kv_tokens=690_000,
                     intermediate_size=32768, topk="synthetic:0.8"),
}


def write_config(layers: int | None, intermediate_size: int | None = None,
                 shape: str = "tp8-stand-in") -> str:
    cfg = model_shape_config(shape, layers)
    if intermediate_size is not None:
        cfg["intermediate_size"] = intermediate_size
    path = scratch_dir("hisparse-bench-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


TABLE_LIMIT_BYTES = 1 << 30   # bound on one top-k table (it lives on the GPU during a point)


def needs_band(policy: str) -> bool:
    """Whether hot policy ``policy`` reads the next-ranked band (``score``, ``score+prefetch``)."""
    from hisparse.ops.resolve import hot_policy_params

    return hot_policy_params(policy, 1)[1] > 0


def make_source(spec: str, layers: int):
    """The :class:`~hisparse.bench.locality.TopkSource` of ``synthetic:<overlap>`` or
    ``trace:<npz>``; ``None`` for ``indexer`` (the model's own)."""
    if spec == "indexer":
        return None
    from hisparse.bench import locality

    kind, _, arg = spec.partition(":")
    if kind == "synthetic":
        return locality.SyntheticTopk(overlap=float(arg), num_layers=layers, seed=0)
    if kind == "trace":
        return locality.TraceTopk(arg)
    raise ValueError(f"topk source must be indexer, synthetic:<overlap> or trace:<npz>, "
                     f"got {spec!r}")


def check_band_policies(spec: str, policies: list[str], source=None) -> None:
    """``ValueError`` naming ``--hot-policies`` if a policy that reads the next-ranked band is
    asked for with a replayed source that has none (``source``: the loaded source of ``spec``;
    without it only what ``spec`` alone tells is checked: synthetic sources have no band)."""
    band_policies = [p for p in policies if needs_band(p)]
    if not band_policies or spec == "indexer":
        return
    if spec.startswith("synthetic:"):
        raise ValueError(
            f"--hot-policies {','.join(band_policies)} read the next-ranked band (ranks k..2k-1), "
            f"which --topk {spec} does not have (SyntheticTopk has no rank structure, see "
            f"has_band); use --topk trace:<npz> (a trace with below_cut) or --hot-policies lru")
    if source is not None and not source.has_band:
        raise ValueError(
            f"--hot-policies {','.join(band_policies)} read the next-ranked band, which --topk "
            f"{spec} does not have: the trace holds no below_cut (re-record it with "
            f"benchmarks/record_trace.py) or use --hot-policies lru")


def topk_table(source, layers: int, context: int, outputs: int, k: int, streams: int = 4,
               band: int = 0, limit_bytes: int = TABLE_LIMIT_BYTES,
               ascending: bool = False) -> torch.Tensor | None:
    """``[streams, layers, outputs, k + band]`` int32 (CPU): at decode step ``s`` of a request
    in stream ``d``, layer ``l`` selects ``table[d, l, s, :k]`` and has the next-ranked band
    ``table[d, l, s, k:]`` (best rank first); ``-1`` pads rows the source has fewer of.
    ``source``: a spec (``indexer`` gives ``None``) or a loaded source; ``band > 0`` needs a
    source with a band (``ValueError`` otherwise). Size ``streams * layers * outputs *
    (k + band) * 4`` bytes (16 MiB for 4 x 4 x 64 x 4096); more than ``limit_bytes`` raises
    ``ValueError`` (fewer ``--outputs``: steps past the table replay its last one).
    ``ascending``: each step's selection in ascending position order (``-1`` last), its band
    kept in rank order, as the engine's indexer gives them under
    ``HISPARSE_TOPK_ORDER=positions``; else the source's order (a synthetic source's is
    random, standing in for score order)."""
    import numpy as np

    src = make_source(source, layers) if isinstance(source, str) else source
    if src is None:
        return None
    if band and not src.has_band:
        raise ValueError(f"topk_table: band={band} asked of a source without a band ({src!r})")
    shape = (streams, layers, outputs, k + band)
    nbytes = int(np.prod(shape)) * 4
    if nbytes > limit_bytes:
        raise ValueError(f"topk_table: {shape} int32 is {nbytes / (1 << 20):.0f} MiB, over the "
                         f"{limit_bytes / (1 << 20):.0f} MiB bound: run fewer --outputs")
    table = np.full(shape, -1, dtype=np.int32)
    for d in range(streams):
        for layer in range(layers):
            for s in range(outputs):
                sel = src.select(layer, d, s, context + s + 1, k)
                table[d, layer, s, :len(sel)] = np.sort(sel) if ascending else sel
                if band:
                    table[d, layer, s, k:] = src.select_band(layer, d, s, context + s + 1, k,
                                                             band)
    return torch.from_numpy(table)


def make_topk_override(table: torch.Tensor, context: int, k: int | None = None):
    """The ``topk_override`` replaying ``table`` (:func:`topk_table`, on the engine's device):
    returns ``(topk [T, k], band [T, NB] or None)``, ``k`` = the table's width when not given
    (no band). A request's stream is its slot modulo the table's streams; decode step =
    position - ``context`` (clamped to the table). Padding tokens (slot ``-1``) select nothing
    and have no band. CUDA-graph safe: one gather kernel (:func:`hisparse.bench.replay.
    replay_rows`, its own kernel class in a profile), fixed shapes."""
    streams, layers, steps, width = table.shape
    k = width if k is None else k

    def override(layer: int, token_slot: torch.Tensor, positions: torch.Tensor,
                 computed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        selected = replay_rows(table, layer, token_slot, positions, context)
        return selected[:, :k], (selected[:, k:] if width > k else None)

    return override


def kv_bytes(kv_cache_dtype: str) -> tuple[int, int]:
    """(row, key) bytes per token and layer of the benchmark model (576-d rows, 128-d keys)."""
    if kv_cache_dtype == "fp8":
        from hisparse.ops import index_key_bytes, mla_row_bytes
        return mla_row_bytes(512, 64), index_key_bytes(128)
    return 576 * 2, 128 * 2


def pin_host_pool(layers: int, host_rows: int, kv_cache_dtype: str, block_size: int,
                  method: str = "alloc") -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark's host pool, pinned (``host_buffers`` of ``LLM``, held for the whole
    run): rows and indexer keys of ``host_rows`` tokens (FP8 keys as pages); a RuntimeError if
    it cannot be pinned. ``method``: ``alloc`` (``cudaHostAlloc`` of the exact size,
    :func:`hisparse.worker.pinned.pinned_empty`, as the engine pins) or ``register`` (ordinary
    memory, then ``cudaHostRegister``, as the TP pool is pinned: ``benchmarks/probe_pinned.py``
    says which gives more) or ``huge`` (an mmap advised transparent huge pages, registered:
    :func:`hisparse.worker.pinned.registered_host_allocator`)."""
    row_b, key_b = kv_bytes(kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        shapes = (((layers, host_rows, row_b), torch.uint8),
                  ((layers, host_rows // block_size, block_size * key_b), torch.uint8))
    else:
        shapes = (((layers, host_rows, 576), torch.bfloat16),
                  ((layers, host_rows, 128), torch.bfloat16))
    if method in ("alloc", "huge"):
        from hisparse.worker.pinned import pinned_empty, registered_host_allocator

        allocator = registered_host_allocator(huge_pages=True) if method == "huge" else None
        return tuple(pinned_empty(s, d, allocator) for s, d in shapes)
    from hisparse.worker.tp import cuda_host_register

    out = tuple(torch.empty(s, dtype=d) for s, d in shapes)
    for t in out:
        cuda_host_register(t)
    return out


def hisparse_plan(path: str, max_len: int, gpu_kv_bytes: int, num_host_blocks: int,
                  block_size: int, kv_cache_dtype: str):
    """The planner's ``hisparse`` :class:`~hisparse.engine.capacity.ModePlan` for requests of
    ``max_len`` tokens of the checkpoint at ``path``: ``gpu_kv_bytes`` split as an engine with
    any ``max_num_seqs`` would split it, beside ``num_host_blocks`` host blocks (host-backed
    requests, then GPU-held ones)."""
    from hisparse.engine.capacity import CapacityInputs, load_geometry, plan_capacity

    return plan_capacity(load_geometry(path), CapacityInputs(
        context=max_len, gpu_kv_bytes=gpu_kv_bytes, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, num_host_blocks=num_host_blocks,
        max_num_seqs=4096))["hisparse"]


# Share of the warm-up's GPU KV budget `--concurrency max` leaves unplanned: the free memory of
# later engines drifts down by ~1% over a run's points (the H100's 36-layer cut, twentieth
# session: 29.03 then 28.76 GB at 40 then 58 requests), and a larger max_num_seqs reserves
# more (logits state)
MAX_BUDGET_MARGIN = 0.01


def max_budget(warm_up_budget: int, kept_bytes: int) -> int:
    """The GPU KV budget `--concurrency max` plans on: the warm-up engine's, less what the
    process kept after the warm-up (``kept_bytes``) and :data:`MAX_BUDGET_MARGIN` of it."""
    return max(0, int((warm_up_budget - kept_bytes) * (1 - MAX_BUDGET_MARGIN)))


def prefill_budget(context: int) -> int:
    """``max_num_batched_tokens`` of a run at ``context``: prompts are synthetic (random rows),
    so a large budget admits them quickly."""
    return max(16384, min(262144, 4 * context))


def warm_up_requests(context: int, cap: int) -> int:
    """Requests of the warm-up run of each mode (at the largest measured context): one whole
    prefill chunk, then one request more, whose prefill shares a step with the others' decode
    tokens (a token count off the chunk's multiples), as in the measured runs; at most ``cap``
    (the measured points' bound), at least one. So the first measured mode does not compile
    the kernels of those shapes inside its timed run while the modes after it find them
    compiled (the whole-run figures would favour the later modes)."""
    return max(1, min(prefill_budget(context) // context + 1, cap))


def run_point(path: str, mode, topk_source: str, table, context: int, concurrency: int,
              outputs: int, num_gpu_blocks: int | None, host_buffers, host_pool_gib: float,
              max_seqs: int, block_size: int = 64, enforce_eager: bool = False,
              kv_cache_dtype: str = "bf16", hot_policy: str = "lru", k: int = 2048,
              hot_prefetch_rows: int | None = None, profile_steps: int = 0) -> Point:
    """One engine run (``table``: :func:`topk_table` of ``topk_source`` with top-``k``, or
    ``None``); the engine is shut down before returning, also on failure. ``profile_steps``:
    that many decode steps, once every request decodes, run under the kernel profiler
    (:mod:`hisparse.bench.kernels`; excluded from the steady-state figures)."""
    from hisparse import LLM
    from hisparse.bench.synthetic import TokenClock, synthetic_runner

    max_len = context + outputs
    torch.cuda.reset_peak_memory_stats()
    clock = TokenClock()
    override = None if table is None else make_topk_override(table.to("cuda"), context, k)
    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", block_size=block_size,
              num_gpu_blocks=num_gpu_blocks, host_pool_gib=host_pool_gib, mode=mode,
              max_model_len=max_len, max_num_seqs=max_seqs,
              # an explicit arena keeps the indexer cache at max_seqs requests; otherwise the
              # engine splits the free memory for the mode (engine.capacity.split_gpu_budget)
              num_indexer_blocks=(None if num_gpu_blocks is None
                                  else max_seqs * cdiv(max_len, block_size)),
              max_num_batched_tokens=prefill_budget(context),
              host_buffers=host_buffers if mode != "gpu-only" else None,
              enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype, hot_policy=hot_policy,
              hot_prefetch_rows=hot_prefetch_rows,
              runner_cls=synthetic_runner(clock=clock, topk_override=override))
    try:
        return _measure(llm, clock, mode, topk_source, context, concurrency, outputs,
                        host_pool_gib, hot_policy, profile_steps)
    finally:
        llm.shutdown()   # frees the model, caches and graphs (frozen with the engine's requests)


def _measure(llm, clock, mode, topk_source: str, context: int, concurrency: int, outputs: int,
             host_pool_gib: float, hot_policy: str, profile_steps: int = 0) -> Point:
    from hisparse import SamplingParams
    from hisparse.bench.kernels import profile_kernels

    llm.capture_cuda_graphs()
    plan = llm.capacity(context=context + outputs, weight_bytes=touched_weight_bytes(
        llm.model_config, concurrency))
    planned = plan[str(mode)]
    if str(mode) == "hisparse" and concurrency > planned.max_running:
        print(f"note: {concurrency} requests, this hisparse engine plans {planned.max_running}: "
              "the rest wait for the first to finish (a tail in the whole-run figures)",
              flush=True)
    g = torch.Generator().manual_seed(0)
    req_ids = []
    vocab = min(120000, llm.model_config.vocab_size)   # a rank's shape holds one vocab shard
    for _ in range(concurrency):
        ids = torch.randint(2, vocab, (context,), generator=g).tolist()
        req_ids.append(llm.add_request(
            {"prompt_token_ids": ids},
            SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)))
    done_at: dict[str, float] = {}
    n_out: dict[str, int] = {}
    t0 = time.perf_counter()
    kernels = None
    decoding_steps = 0
    # The profile waits for three pure decode steps at the most requests the engine can run
    # (a capacity-bound mode never has all ``concurrency`` decoding at once).
    full_batch = min(concurrency, planned.max_running)
    while llm.has_unfinished_requests():
        decoding_steps += all(r in clock.times for r in req_ids)
        recent = clock.steps[-3:]
        at_full_batch = len(recent) == 3 and all(dec and n >= full_batch
                                                 for _, n, dec, *_ in recent)
        if profile_steps and kernels is None and (at_full_batch or decoding_steps > 3):
            outs, first = [], len(clock.steps)
            kernels = profile_kernels(lambda got=outs: got.extend(llm.step()), profile_steps)
            for i in range(first, len(clock.steps)):    # not steady-state steps
                clock.steps[i] = (*clock.steps[i][:2], False, *clock.steps[i][3:])
        else:
            outs = llm.step()
        finished = [out for out in outs if out.finished]
        now = time.perf_counter()
        for out in finished:
            done_at[out.request_id] = now
            n_out[out.request_id] = len(out.outputs[0].token_ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    first_token = {r: clock.times[r][0] for r in req_ids}
    start = min(first_token.values())
    decode_tokens = sum(n_out[r] - 1 for r in req_ids)
    tpots = sorted((done_at[r] - first_token[r]) / max(1, outputs - 1) * 1e3 for r in req_ids)
    s = llm.stats()
    # Steady state: decode steps with (nearly) every running request in them.
    steps = clock.decode_step_stats(min_running=max(1, int(0.9 * s["peak_running"])))
    lookups = s["hot_hits"] + s["hot_misses"]
    return Point(
        mode=s["mode"], topk_source=topk_source, context=context, concurrency=concurrency,
        outputs=outputs, decode_tok_s=decode_tokens / (time.perf_counter() - start),
        tpot_p50_ms=statistics.median(tpots), tpot_p99_ms=tpots[int(0.99 * (len(tpots) - 1))],
        running_reached=s["peak_running"],
        hot_hit_rate=s["hot_hits"] / lookups if lookups else float("nan"),
        h2d_gb_s=s["h2d_bytes"] / wall / 1e9,
        gpu_mem_gib=torch.cuda.max_memory_allocated() / (1 << 30),
        host_pool_gib=host_pool_gib if mode != "gpu-only" else 0.0,
        num_preempted=s["num_preempted"], spilled_pages=s["spilled_pages"], wall_s=wall,
        steady_tok_s=steps["steady_tok_s"], wall_ms_per_step=steps["wall_ms_per_step"],
        gpu_ms_per_step=steps["gpu_ms_per_step"],
        planned_max_running=planned.max_running, planned_bound_by=planned.bound_by,
        planned_gpu_held=planned.gpu_held, gpu_kv_bytes=plan.inputs.gpu_kv_bytes or 0,
        kernel_ms=None if kernels is None else kernels.ms_per_step,
        kernels_per_layer=(float("nan") if kernels is None
                           else kernels.per_layer(llm.model_config.num_layers)),
        top_kernels=None if kernels is None else kernels.top,
        by_kernel=None if kernels is None else [list(k) for k in kernels.by_kernel],
        planned_tok_s=planned.decode_tok_s, hot_policy=hot_policy,
        hot_demand_misses=s["hot_demand_misses"], hot_prefetched=s["hot_prefetched"],
        hot_prefetch_hits=s["hot_prefetch_hits"])


def main(argv: list[str] | None = None) -> int:
    import argparse

    from hisparse.engine.arg_utils import ArgParser

    p = ArgParser(prog="hisparse bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="default",
                   help="workload shape; the options below override its values")
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default="tp8-stand-in",
                   help="tp8-stand-in: the profile's dense layers; a real rank: all its layers, "
                        "MoE, FP8 weights, GPU KV sized from free memory unless given")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None, help="dense MLP width")
    p.add_argument("--contexts", default=None)
    p.add_argument("--concurrency", default=None,
                   help="comma list; 'max' = hisparse's planned maximum (host-backed plus "
                        "GPU-held requests, on the GPU budget the warm-up engine split) when "
                        "hisparse runs, else what the host pool allows")
    p.add_argument("--outputs", type=int, default=None)
    p.add_argument("--gpu-kv-gib", type=float, default=None, help="GPU arena of MLA rows")
    p.add_argument("--gpu-kv-tokens", type=int, default=None,
                   help="GPU arena size in tokens (instead of --gpu-kv-gib)")
    p.add_argument("--host-pool-gib", type=host_pool_gib_arg, default=64.0,
                   help="pinned host pool of the host modes, GiB, or 'auto' (the largest that "
                   "pins, less a headroom)")
    p.add_argument("--host-pin", choices=["alloc", "register", "huge"], default="alloc",
                   help="how the host pool is pinned: cudaHostAlloc, cudaHostRegister of "
                   "ordinary memory (benchmarks/probe_pinned.py measures which pins more), or "
                   "of a 2 MiB-aligned mmap advised huge pages (benchmarks/probe_host_gather.py "
                   "times the miss gather over each)")
    p.add_argument("--modes", default="gpu-only,hisparse,always-host")
    p.add_argument("--topk", default=None,
                   help="top-k source of the sweep: indexer, synthetic:<p> or trace:<npz>")
    p.add_argument("--locality", default="",
                   help="extra points at the first context, in the HiSparse modes of --modes "
                        "(hisparse and always-host if it has none): comma list of "
                        "synthetic:<p> / trace:<npz>; sources without a band (synthetic, a "
                        "trace without below_cut) run lru only")
    p.add_argument("--locality-concurrency", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--hot-policies", default="lru",
                   help="comma list of hot-buffer policies (lru, score, score+prefetch) run at "
                        "every HiSparse / always-host point. score and score+prefetch read the "
                        "next-ranked band: the indexer's own, or a trace's recorded ranks k.. "
                        "(below_cut); a synthetic --topk has none (an error)")
    p.add_argument("--hot-prefetch-rows", type=int, default=None,
                   help="score+prefetch: band rows prefetched per layer and request step "
                        "(LLM(hot_prefetch_rows=); default: the engine's, index_topk // 64)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="KV format: bf16 rows (1152 B) or FlashMLA FP8 rows (656 B) + FP8 keys")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="profile N decode steps of every point (once every request decodes) "
                        "and print device ms per step by kernel class and kernels per layer "
                        "(the JSON keeps every kernel's ms and launches per step: by_kernel)")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    real_rank = a.model_shape != "tp8-stand-in"
    for key, value in PROFILES[a.profile].items():
        if real_rank and key in ("layers", "intermediate_size", "gpu_kv_gib", "gpu_kv_tokens"):
            continue   # the real rank's own depth and widths; KV from free memory
        if getattr(a, key) is None:
            setattr(a, key, value)
    policies = a.hot_policies.split(",")
    try:
        for pol in policies:
            needs_band(pol)              # validates the name
        check_band_policies(a.topk, policies)
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("hisparse bench needs a CUDA device")
    modes = {m.value: m.value for m in Mode}
    path = write_config(a.layers, a.intermediate_size, a.model_shape)
    with open(os.path.join(path, "config.json")) as f:
        model_cfg = json.load(f)
    a.layers, topk_k = model_cfg["num_hidden_layers"], model_cfg["index_topk"]
    contexts = [int(c) for c in a.contexts.split(",")]
    extra = list(filter(None, a.locality.split(",")))
    # every replayed source loaded once, before anything is pinned or compiled
    sources = {spec: make_source(spec, a.layers) for spec in dict.fromkeys([a.topk, *extra])}
    try:
        check_band_policies(a.topk, policies, sources[a.topk])
    except ValueError as e:
        p.error(str(e))

    def policies_of(mode_name: str, spec: str) -> list[str]:
        src = sources[spec]
        if mode_name == "gpu-only" or (src is not None and not src.has_band):
            return ["lru"]
        return policies

    def table_of(spec: str, context: int) -> torch.Tensor | None:
        """The top-k table of ``spec``, with the band when a policy run on it reads one."""
        src = sources[spec]
        band = topk_k if any(needs_band(x) for x in policies_of("hisparse", spec)) else 0
        # the order every engine of the run selects in (the switch's, whatever the policy):
        # positions ascending, a band kept in rank order, or the source's order under
        # HISPARSE_TOPK_ORDER=ranked
        ascending = switches.current().topk_order == "positions"
        table = topk_table(src, a.layers, context, a.outputs, topk_k, band=band,
                           ascending=ascending)
        if table is not None:
            print(f"top-k table {spec}: {tuple(table.shape)} int32 (top-{topk_k}"
                  f"{f' + band {band}' if band else ''}, "
                  f"{'positions ascending' if ascending else 'the source order'}), "
                  f"{table.numel() * 4 / (1 << 20):.1f} MiB on the GPU per point", flush=True)
        return table

    locality_modes = [m for m in a.modes.split(",") if m != "gpu-only"] or ["hisparse",
                                                                          "always-host"]
    try:    # every table before anything is pinned or compiled (a trace may not fit a context)
        tables = {(spec, c): table_of(spec, c)
                  for c in contexts for spec in [a.topk] + (extra if c == contexts[0] else [])}
    except ValueError as e:
        p.error(str(e))

    block_size = 64
    row_b, key_b = kv_bytes(a.kv_cache_dtype)
    if a.gpu_kv_tokens is not None:
        num_gpu_blocks = a.gpu_kv_tokens // block_size
    elif a.gpu_kv_gib is not None:
        num_gpu_blocks = int(a.gpu_kv_gib * (1 << 30)) // (block_size * row_b * a.layers)
    else:
        num_gpu_blocks = None   # the engine sizes it from free memory after the weights
    arena = "auto" if num_gpu_blocks is None else (
        f"{num_gpu_blocks} blocks ({num_gpu_blocks * block_size} tokens)")
    print(f"profile {a.profile}, model {a.model_shape}: {a.layers} layers, GPU arena {arena}, "
          f"KV {a.kv_cache_dtype}", flush=True)
    geo_bytes_per_token = a.layers * (row_b + key_b)
    t = time.perf_counter()
    if a.host_pool_gib == "auto":
        from hisparse.worker.pinned import auto_host_pool_bytes
        a.host_pool_gib = round(auto_host_pool_bytes(cuda=True) / (1 << 30), 1)
        print(f"--host-pool-gib auto: {a.host_pool_gib} GiB pins", flush=True)
    host_rows = int(a.host_pool_gib * (1 << 30)) // (geo_bytes_per_token * 64) * 64
    try:
        host_buffers = pin_host_pool(a.layers, host_rows, a.kv_cache_dtype, block_size,
                                     a.host_pin)
    except RuntimeError as e:
        p.error(f"--host-pool-gib {a.host_pool_gib}: could not pin the host pool ({e}); lower "
                "--host-pool-gib or pass auto (benchmarks/probe_pinned.py measures the largest "
                "pinnable size)")
    print(f"pinned {a.host_pool_gib} GiB host pool in {time.perf_counter() - t:.1f} s", flush=True)
    points: list[Point] = []
    os.makedirs(a.out, exist_ok=True)
    t = time.perf_counter()
    host_modes = [m for m in a.modes.split(",") if m != "gpu-only"]

    def host_cap(context: int) -> int:
        """Requests of ``context`` tokens the host pool holds (always-host's ``max``)."""
        cap = host_rows // (context + a.outputs + 64)
        if cap < 1:
            p.error(f"--host-pool-gib {a.host_pool_gib}: holds no {context}-token request of "
                    f"modes {','.join(host_modes)}")
        return cap

    def cap_of(context: int) -> int:
        """The most requests of ``context`` tokens a point runs: with always-host, the host
        pool's bound (hisparse runs GPU-held requests past it); with an explicit arena, its hot
        buffers' and tail pages'."""
        cap = host_cap(context) if "always-host" in host_modes else 1 << 20
        # Host-read requests each hold a hot buffer (2 x top-k rows) and 2 tail pages in GPU
        # blocks, and 10% of the blocks stay free (the watermark).
        if num_gpu_blocks is not None:
            cap = min(cap, max(int(num_gpu_blocks * 0.9) // (2 * topk_k // block_size + 2), 1))
        return cap

    # compile every kernel before timing anything, the top-k source's and the profiler's
    # first use (CUPTI's start-up) included: else the first measured mode pays for them
    warm_context = max(contexts)
    warm_requests = warm_up_requests(warm_context, cap_of(warm_context))
    budget = 0
    free_before_warm_up = torch.cuda.mem_get_info()[0]
    for name in a.modes.split(","):
        for policy in policies_of(name, a.topk):
            warm = run_point(path, modes[name], a.topk,
                             tables[a.topk, warm_context],
                             warm_context, warm_requests, 8, num_gpu_blocks, host_buffers,
                             a.host_pool_gib, warm_requests, enforce_eager=a.eager,
                             kv_cache_dtype=a.kv_cache_dtype, hot_policy=policy, k=topk_k,
                             hot_prefetch_rows=a.hot_prefetch_rows,
                             profile_steps=1 if a.profile_kernels else 0)
            if name == "hisparse" or "hisparse" not in host_modes:
                budget = max(budget, warm.gpu_kv_bytes)
    # What the process keeps after the warm-up (the profiler's buffers, ...) is not free for
    # the measured engines: a `max` planned on the warm-up's budget would be one request over
    # theirs, and that request would run alone after the others (a tail in the whole run).
    # Counted from before the first warm-up: part of it was already gone when hisparse's
    # warm-up measured its budget, so this errs low (by ~1 request on the H100's cut, where the
    # measured engines still drifted 0.54 GB below hisparse's warm-up budget), never over
    kept = max(0, free_before_warm_up - torch.cuda.mem_get_info()[0])
    budget = max_budget(budget, kept)
    print(f"warm-up ({warm_requests} x {warm_context} tokens a mode) "
          f"{time.perf_counter() - t:.1f} s; {kept / (1 << 20):.0f} MiB kept after it", flush=True)

    def max_of(context: int) -> int:
        """``--concurrency max``: hisparse's planned maximum on the GPU KV budget the engine
        split (host-backed plus GPU-held requests) when hisparse runs; else the host pool's."""
        if "hisparse" in host_modes and budget:
            plan = hisparse_plan(path, context + a.outputs, budget, host_rows // block_size,
                                 block_size, a.kv_cache_dtype)
            print(f"--concurrency max at {context}: hisparse's plan, {plan.max_running} "
                  f"requests ({plan.gpu_held} GPU-held; {budget / (1 << 30):.1f} GiB GPU KV "
                  f"budget)", flush=True)
            return plan.max_running
        return host_cap(context)

    def record(pt: Point) -> None:
        points.append(pt)
        print(json.dumps(asdict(pt)), flush=True)
        with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
            json.dump([asdict(x) for x in points], f, indent=1)

    for context in contexts:
        if not host_modes and "max" in a.concurrency.split(","):
            p.error("--concurrency max is the host pool's limit: give numbers for gpu-only")
        cap = cap_of(context)
        levels = sorted({min(max_of(context), cap) if c == "max" else min(int(c), cap)
                         for c in a.concurrency.split(",")})
        for conc in levels:
            for name in a.modes.split(","):
                for policy in policies_of(name, a.topk):
                    table = tables[a.topk, context]
                    record(run_point(path, modes[name], a.topk, table, context, conc, a.outputs,
                                     num_gpu_blocks, host_buffers, a.host_pool_gib, max(levels),
                                     enforce_eager=a.eager, kv_cache_dtype=a.kv_cache_dtype,
                                     hot_policy=policy, k=topk_k,
                                     hot_prefetch_rows=a.hot_prefetch_rows,
                                     profile_steps=a.profile_kernels))
        for spec in extra if context == contexts[0] else ():
            conc = min(a.locality_concurrency, cap)
            for name in locality_modes:
                for policy in policies_of(name, spec):
                    table = tables[spec, context]
                    record(run_point(path, modes[name], spec, table, context, conc, a.outputs,
                                     num_gpu_blocks, host_buffers, a.host_pool_gib, conc,
                                     enforce_eager=a.eager, kv_cache_dtype=a.kv_cache_dtype,
                                     hot_policy=policy, k=topk_k,
                                     hot_prefetch_rows=a.hot_prefetch_rows,
                                     profile_steps=a.profile_kernels))
    print_table(points)
    if a.profile_kernels:
        print_kernel_table(points)
    print_ratio_table(points)
    print_efficiency_table(points)
    plot(points, os.path.join(a.out, "bench_decode.png"))
    return 0
