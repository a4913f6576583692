"""Capacity planner: how many long requests each design keeps running, and what stops it.

For each mode (``gpu-only``, ``hisparse``, ``always-host``) the planner reports the maximum number
of running requests of a given length (``context`` = prompt + output tokens, what the engine
reserves at admission), which resource bounds it, the bytes a token costs in every tier, and a
roofline step time at that concurrency. It reads only ``config.json`` (no weights) and needs no
GPU; this module imports no torch (loading ``config.json`` goes through
:class:`hisparse.models.config.DSAConfig`, which does).

Usage::

    from hisparse.engine.capacity import CapacityInputs, load_geometry, plan_capacity
    geo = load_geometry("path/to/checkpoint")            # or a DSAConfig, or ModelGeometry(...)
    plan = plan_capacity(geo, CapacityInputs(context=65536, gpu_kv_bytes=33 << 30,
                                             host_pool_bytes=64 << 30, kv_cache_dtype="fp8"))
    plan["hisparse"].max_running, plan["hisparse"].bound_by, plan.to_dict()
    print(format_plan(plan))

    # the same from the command line, and for a running engine's real pools:
    #   hisparse plan --model PATH --gpu-kv-gib 33 --host-pool-gib 64 --context 65536 [--json]
    #   LLM(...).capacity()        (context defaults to max_model_len)

Memory model (``L`` layers, ``Li`` of them with an indexer, ``P = ceil(context / block_size)``
pages per request, ``hot = ceil(hot_buffer_size / block_size)`` blocks, ``tail`` = 2 pages, DESIGN
§3-§4):

- bytes per token: MLA row ``kv_lora_rank + qk_rope_head_dim`` values per layer (576: 1152 B bf16,
  656 B in the FP8 format = e4m3 latent + one fp32 scale per 128 + bf16 rope); indexer key
  ``index_head_dim`` values per indexer layer (128: 256 B bf16, 132 B FP8 = e4m3 + one fp32 scale
  per 128). The host pool stores both for every computed token.
- GPU indexer cache: ``P`` blocks per request in every mode (every live token, never tiered).
- GPU KV arena per request: ``gpu-only`` ``P`` pages; ``always-host`` its hot blocks plus its tail
  pages; ``hisparse`` the same once it switches to host-read mode (requests whose
  ``context // block_size <= hot + tail`` never switch and keep ``P`` pages), and the arena keeps
  the watermark ``max(hot, num_gpu_blocks // 10)`` (or ``watermark_blocks``) free.
- host pool: ``P`` blocks per request (host modes).
- ``hisparse`` only: once the host pool binds, the GPU budget left over holds *GPU-held*
  requests (the engine admits them with all ``P`` pages on GPU and no host blocks, above the
  watermark): ``max_running`` = host-backed requests + ``gpu_held``; each costs ``P`` arena and
  ``P`` indexer blocks and reads no host row.
- ``gpu_kv_bytes`` is the GPU budget for arena + indexer cache. Unless the pools are given
  (``num_gpu_blocks`` / ``num_indexer_blocks``, as ``LLM.capacity()`` does), the planner splits it
  per mode so both pools fill together; ``bound_by`` then names the pool with the larger
  per-request share (``gpu pages`` / ``hot buffers`` vs ``indexer cache``), and ``num_gpu_blocks``
  / ``num_indexer_blocks`` in the plan are the split to configure. With an explicit pool the
  arena also keeps room for one max-length prompt (``num_gpu_blocks >= P``, KVCacheConfig's rule).
- ``bound_by`` is the smallest of the bounds; ties go to the first of ``gpu pages`` /
  ``hot buffers``, ``host pool``, ``max_num_seqs``, and to ``indexer cache`` only when nothing
  else ties (the engine's own split, :func:`split_gpu_budget`, sizes the indexer cache to
  exactly the requests another bound allows).

How this matches the engine (``tests/engine/test_capacity.py`` runs it on CPU): in ``gpu-only``
the peak running count equals the plan. In the host modes the engine admits a request whenever
its first prefill chunk fits, ignoring the watermark, so its peak can reach
``num_gpu_blocks // (hot + tail)`` (the always-host figure) in ``hisparse`` too, at the cost of
preemptions while newcomers prefill; the ``hisparse`` figure is the concurrency that leaves the
watermark free for arrivals (the planner is conservative there by up to ``watermark / (hot +
tail)`` requests).

Roofline step time (one decode token per running request, memory-bound, at ``n = max_running``):

- HBM bytes per step = weights read per step (parameter count x bytes per parameter, embedding
  excluded, every routed expert read: a high-batch MoE step touches them all; override with
  ``weight_bytes``) + ``n`` x (indexer keys of the whole context in every indexer layer + the
  selected rows, ``min(index_topk, context)`` per layer + the new token's row and key writes +
  in host-read modes the hot-buffer writes of the misses, ``(1 - hit_rate)`` of the selected rows);
  HBM time = bytes / ``hbm_gb_s`` (H200: 4800).
- PCIe bytes per step (host-read modes) = ``n`` x ``L`` x selected rows x ``(1 - hit_rate)`` x
  row bytes host->GPU (the new rows' write-through mirrors go the other way and are counted
  separately, the link is full duplex); PCIe time = max(H2D, D2H) / ``pcie_gb_s`` (55).
- step time = max(HBM time, PCIe time) (copies overlap the forward); decode tok/s = n / step.
  Compute, launch overheads and the host-side scheduler are not modelled: these are upper bounds.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

from hisparse.config import (
    ACTIVE_TAIL_PAGES,
    MODES,
    cdiv,
    hot_buffer_rows,
    require_positive,
    watermark_for,
)

# Bytes per element of a KV cache dtype; "fp8" is special-cased (scales) in row/key bytes.
DTYPE_BYTES: dict[str, int] = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp32": 4, "float32": 4, "float": 4, "fp8": 1,
}
KV_CACHE_DTYPES: tuple[str, ...] = ("bf16", "fp8", "fp16", "fp32")
FP8_GROUP = 128          # one fp32 scale per 128 e4m3 values
H200_HBM_GB_S = 4800.0
PCIE_GB_S = 55.0
GIB = 1 << 30

GPU_PAGES = "gpu pages"
HOT_BUFFERS = "hot buffers"
INDEXER_CACHE = "indexer cache"
HOST_POOL = "host pool"
MAX_NUM_SEQS = "max_num_seqs"


@dataclass(frozen=True)
class ModelGeometry:
    """What the planner needs of a model (from ``config.json``: :func:`geometry_from_config`)."""

    num_layers: int
    num_indexer_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_topk: int
    weight_bytes: int = 0        # estimated bytes of weights read per decode step
    num_params: int = 0          # parameters counted in ``weight_bytes``

    @property
    def kv_row_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def row_bytes(self, kv_cache_dtype: str) -> int:
        """Bytes of one cached MLA row (one token, one layer)."""
        if _dtype_key(kv_cache_dtype) == "fp8":
            return (self.kv_lora_rank + 4 * cdiv(self.kv_lora_rank, FP8_GROUP)
                    + 2 * self.qk_rope_head_dim)
        return DTYPE_BYTES[_dtype_key(kv_cache_dtype)] * self.kv_row_dim

    def key_bytes(self, kv_cache_dtype: str) -> int:
        """Bytes of one indexer key (one token, one indexer layer)."""
        if _dtype_key(kv_cache_dtype) == "fp8":
            return self.index_head_dim + 4 * cdiv(self.index_head_dim, FP8_GROUP)
        return DTYPE_BYTES[_dtype_key(kv_cache_dtype)] * self.index_head_dim


def _dtype_key(kv_cache_dtype: str) -> str:
    key = str(kv_cache_dtype).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return key


def count_weight_params(cfg) -> int:
    """Parameters read per decode step at high batch: everything but the embedding table (a
    gather), every routed expert of every MoE layer. ``cfg``: a ``DSAConfig``."""
    h, nh = cfg.hidden_size, cfg.num_heads
    q_in = cfg.q_lora_rank or h
    attn = (h * cfg.q_lora_rank + cfg.q_lora_rank if cfg.q_lora_rank else 0)
    attn += q_in * nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    attn += h * cfg.kv_row_dim + cfg.kv_lora_rank
    attn += cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn += nh * cfg.v_head_dim * h + 2 * h
    indexer = (q_in * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
               + h * cfg.index_n_heads + 2 * cfg.index_head_dim)
    dense = 3 * h * cfg.intermediate_size
    moe = (3 * h * cfg.moe_intermediate_size * (cfg.n_routed_experts + cfg.n_shared_experts)
           + h * cfg.n_routed_experts)
    total = cfg.vocab_size * h + h  # lm_head (read even when tied to the embedding) + final norm
    for layer in range(cfg.num_layers):
        total += attn + (indexer if cfg.layer_has_indexer(layer) else 0)
        total += dense if cfg.mlp_layer_types[layer] == "dense" else moe
    return total


def bytes_per_param(cfg) -> int:
    """1 for FP8-quantized checkpoints (``quantization_config.quant_method == 'fp8'``), else the
    element size of the checkpoint dtype."""
    q = cfg.quantization_config or {}
    if str(q.get("quant_method", "")).lower() == "fp8":
        return 1
    return DTYPE_BYTES.get(str(cfg.dtype).removeprefix("torch."), 2)


def geometry_from_config(cfg) -> ModelGeometry:
    """``ModelGeometry`` of a :class:`hisparse.models.config.DSAConfig`."""
    params = count_weight_params(cfg)
    return ModelGeometry(
        num_layers=cfg.num_layers,
        num_indexer_layers=sum(cfg.layer_has_indexer(i) for i in range(cfg.num_layers)),
        kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        weight_bytes=params * bytes_per_param(cfg), num_params=params)


def load_geometry(path: str) -> ModelGeometry:
    """Geometry from a checkpoint directory (or a ``config.json`` path); reads no weights."""
    from hisparse.models.config import DSAConfig

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"model must be a checkpoint directory with config.json or a config.json "
                         f"path, got {path!r}")
    with open(file) as f:
        return geometry_from_config(DSAConfig.from_hf(json.load(f)))


@dataclass(frozen=True)
class CapacityInputs:
    """What to plan for. Sizes in bytes; pools in blocks of ``block_size`` tokens.

    ``context``: tokens per request (prompt + output). ``gpu_kv_bytes``: GPU budget for the KV
    arena plus the indexer cache (the planner splits it unless ``num_gpu_blocks`` and/or
    ``num_indexer_blocks`` fix a pool; a fixed pool is charged to the budget and the other gets
    the rest). ``host_pool_bytes`` or ``num_host_blocks``: the pinned host pool (neither: no host
    pool, the host modes plan 0 requests).
    """

    context: int
    gpu_kv_bytes: int | None = None
    host_pool_bytes: int | None = None
    block_size: int = 64
    hot_buffer_size: int | None = None      # rows per (layer, request); None: 2 * index_topk
    max_num_seqs: int = 256
    kv_cache_dtype: str = "bf16"
    num_gpu_blocks: int | None = None
    num_indexer_blocks: int | None = None
    num_host_blocks: int | None = None
    watermark_blocks: int | None = None     # None: max(hot blocks, num_gpu_blocks // 10)
    hit_rate: float = 0.9
    hbm_gb_s: float = H200_HBM_GB_S
    pcie_gb_s: float = PCIE_GB_S
    weight_bytes: int | None = None         # None: estimated from the config

    def validate(self, geo: ModelGeometry) -> None:
        for name in ("context", "block_size", "max_num_seqs"):
            require_positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _dtype_key(self.kv_cache_dtype)
        if self.hot_buffer_size is not None:
            require_positive("hot_buffer_size", self.hot_buffer_size)
            if self.hot_buffer_size < geo.index_topk:
                raise ValueError(f"hot_buffer_size must be >= index_topk ({geo.index_topk}), "
                                 f"got {self.hot_buffer_size}")
        for name in ("gpu_kv_bytes", "host_pool_bytes", "num_gpu_blocks", "num_indexer_blocks",
                     "num_host_blocks", "watermark_blocks", "weight_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {v!r}")
        if self.gpu_kv_bytes is None and (self.num_gpu_blocks is None
                                          or self.num_indexer_blocks is None):
            raise ValueError("gpu_kv_bytes is required unless num_gpu_blocks and "
                             "num_indexer_blocks are both given")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate!r}")
        for name in ("hbm_gb_s", "pcie_gb_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")


@dataclass
class ModePlan:
    """The plan of one mode. ``bounds``: requests each resource alone would allow. In
    ``hisparse``, past the host pool's bound (host-backed requests), ``gpu_held`` of the
    ``max_running`` requests run without host blocks; ``bound_by`` then names what stops them
    and its bound counts both kinds."""

    mode: str
    max_running: int
    bound_by: str
    bounds: dict[str, int]
    bytes_per_token: dict[str, int]          # per tier: gpu_arena, gpu_indexer, host
    gpu_bytes_per_request: int
    host_bytes_per_request: int
    arena_blocks_per_request: int
    num_gpu_blocks: int
    num_indexer_blocks: int
    num_host_blocks: int
    watermark_blocks: int
    hbm_bytes_per_step: int
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    hbm_ms: float
    pcie_ms: float
    step_time_ms: float
    decode_tok_s: float
    gpu_held: int = 0


@dataclass
class CapacityPlan:
    inputs: CapacityInputs
    geometry: ModelGeometry
    modes: dict[str, ModePlan] = field(default_factory=dict)

    def __getitem__(self, mode: str) -> ModePlan:
        return self.modes[str(mode)]

    def to_dict(self) -> dict:
        """JSON-ready: ``{"inputs", "geometry", "<mode>": {"max_running", "bound_by", ...}}``."""
        out = {"inputs": asdict(self.inputs), "geometry": asdict(self.geometry)}
        out["geometry"]["row_bytes"] = self.geometry.row_bytes(self.inputs.kv_cache_dtype)
        out["geometry"]["key_bytes"] = self.geometry.key_bytes(self.inputs.kv_cache_dtype)
        for mode, mp in self.modes.items():
            out[mode] = asdict(mp)
        return out


def _arena_for(need: int, reserve, floor: int) -> int:
    """Smallest arena ``N >= floor`` with ``N - reserve(N) >= need`` blocks (reserve(N) grows
    slower than N, so ``N - reserve(N)`` is non-decreasing)."""
    lo, hi = max(floor, need), max(floor, need) + 1
    while hi - reserve(hi) < need:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if mid - reserve(mid) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def arena_blocks_for(need: int, watermark_blocks: int | None, hot_blocks: int) -> int:
    """The smallest arena that keeps ``need`` blocks in use beside the watermark (``None``: the
    default rule ``max(hot_blocks, N // 10)``)."""
    return _arena_for(need, lambda n: watermark_for(n, watermark_blocks, hot_blocks), need)


def _pick(bounds: dict[str, int]) -> tuple[int, str]:
    best = min(bounds.values())
    tied = [k for k, v in bounds.items() if v == best]
    if len(tied) > 1 and INDEXER_CACHE in tied:
        tied.remove(INDEXER_CACHE)     # sized to the other bounds (split_gpu_budget): not a cause
    return best, tied[0]


def _plan_mode(mode: str, geo: ModelGeometry, inp: CapacityInputs) -> ModePlan:
    bs, dt = inp.block_size, inp.kv_cache_dtype
    L, Li = geo.num_layers, geo.num_indexer_layers
    row_b, key_b = geo.row_bytes(dt), geo.key_bytes(dt)
    pages = cdiv(inp.context, bs)
    hot = cdiv(hot_buffer_rows(inp.hot_buffer_size, geo.index_topk), bs)
    uses_host = mode != "gpu-only"
    # Whether requests read through a hot buffer (the engine's switch rule for hisparse).
    host_read = mode == "always-host" or (
        mode == "hisparse" and inp.context // bs > hot + ACTIVE_TAIL_PAGES)
    arena_per = hot + min(ACTIVE_TAIL_PAGES, pages) if host_read else pages
    gpu_label = HOT_BUFFERS if host_read else GPU_PAGES
    arena_blk_b = bs * L * row_b
    idx_blk_b = bs * Li * key_b
    host_blk_b = bs * (L * row_b + Li * key_b)

    def reserve(n_blocks: int) -> int:
        if mode == "hisparse" and host_read:
            return watermark_for(n_blocks, inp.watermark_blocks, hot)
        return 0

    # --- host pool
    if not uses_host:
        num_host = 0
    elif inp.num_host_blocks is not None:
        num_host = inp.num_host_blocks
    else:
        num_host = (inp.host_pool_bytes or 0) // host_blk_b
    bounds: dict[str, int] = {}

    # --- GPU: arena + indexer cache
    n_gpu_arena = n_idx = None
    if inp.num_gpu_blocks is not None or inp.num_indexer_blocks is not None:
        n_gpu_arena = inp.num_gpu_blocks
        n_idx = inp.num_indexer_blocks
        if n_gpu_arena is None:
            n_gpu_arena = max(0, inp.gpu_kv_bytes - n_idx * idx_blk_b) // arena_blk_b
        if n_idx is None:
            n_idx = max(0, inp.gpu_kv_bytes - n_gpu_arena * arena_blk_b) // idx_blk_b
        gpu_n = max(0, n_gpu_arena - reserve(n_gpu_arena)) // arena_per
        if n_gpu_arena < pages:      # one max-length prompt must fit (prefill reads it resident)
            gpu_n = 0
        bounds[gpu_label] = gpu_n
        bounds[INDEXER_CACHE] = n_idx // pages
    else:
        budget = inp.gpu_kv_bytes

        def need(n: int) -> int:
            return _arena_for(n * arena_per, reserve, pages) * arena_blk_b + n * pages * idx_blk_b

        lo, hi = 0, budget // (arena_per * arena_blk_b + pages * idx_blk_b) + 1
        while lo < hi:  # largest n with need(n) <= budget
            mid = (lo + hi + 1) // 2
            if need(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        label = INDEXER_CACHE if pages * idx_blk_b > arena_per * arena_blk_b else gpu_label
        bounds[label] = lo
    if uses_host:
        bounds[HOST_POOL] = num_host // pages
    bounds[MAX_NUM_SEQS] = inp.max_num_seqs
    n, bound_by = _pick(bounds)
    held = 0
    if mode == "hisparse" and bound_by == HOST_POOL and n > 0:
        # GPU-held requests fill what the n host-backed ones leave of the GPU; the engine
        # admits one only with the watermark still free, whether or not requests switch
        def held_reserve(n_blocks: int) -> int:
            return watermark_for(n_blocks, inp.watermark_blocks, hot)

        room = inp.max_num_seqs - n
        if n_gpu_arena is not None:
            arena_room = max(0, n_gpu_arena - held_reserve(n_gpu_arena) - n * arena_per) // pages
            # ties name max_num_seqs, then the arena, not pools sized to match them
            held, stop = min((room, MAX_NUM_SEQS), (arena_room, GPU_PAGES),
                             (n_idx // pages - n, INDEXER_CACHE), key=lambda b: b[0])
        else:
            def need_held(k: int) -> int:
                return (_arena_for(n * arena_per + k * pages, held_reserve, pages) * arena_blk_b
                        + (n + k) * pages * idx_blk_b)

            lo, hi = 0, room
            while lo < hi:  # largest k with need_held(k) <= budget
                mid = (lo + hi + 1) // 2
                if need_held(mid) <= inp.gpu_kv_bytes:
                    lo = mid
                else:
                    hi = mid - 1
            held, stop = lo, (MAX_NUM_SEQS if lo == room else GPU_PAGES)
        if held > 0:
            bound_by = stop
            bounds[stop] = n + held     # host-backed and GPU-held requests together
    hosted, n = n, n + held
    if n_gpu_arena is None:  # the split to configure for n requests: indexer for n, arena the rest
        n_idx = n * pages
        n_gpu_arena = max(0, inp.gpu_kv_bytes - n_idx * idx_blk_b) // arena_blk_b
        if n == 0:
            n_gpu_arena, n_idx = inp.gpu_kv_bytes // (arena_blk_b + idx_blk_b), 0

    # --- roofline at n (GPU-held requests read every row resident)
    selected = min(geo.index_topk, inp.context)
    miss_rows = (1.0 - inp.hit_rate) * selected if host_read else 0.0
    per_req_hbm = (inp.context * Li * key_b + selected * L * row_b + L * row_b + Li * key_b)
    weights = geo.weight_bytes if inp.weight_bytes is None else inp.weight_bytes
    hbm = weights + n * per_req_hbm + hosted * miss_rows * L * row_b
    h2d = hosted * miss_rows * L * row_b
    d2h = hosted * (L * row_b + Li * key_b) if uses_host else 0
    hbm_ms = hbm / (inp.hbm_gb_s * 1e9) * 1e3
    pcie_ms = max(h2d, d2h) / (inp.pcie_gb_s * 1e9) * 1e3
    step_ms = max(hbm_ms, pcie_ms)
    return ModePlan(
        mode=mode, max_running=n, bound_by=bound_by, bounds=bounds,
        bytes_per_token={"gpu_arena": L * row_b, "gpu_indexer": Li * key_b,
                         "host": L * row_b + Li * key_b if uses_host else 0},
        gpu_bytes_per_request=arena_per * arena_blk_b + pages * idx_blk_b,
        host_bytes_per_request=pages * host_blk_b if uses_host else 0,
        arena_blocks_per_request=arena_per, num_gpu_blocks=n_gpu_arena,
        num_indexer_blocks=n_idx, num_host_blocks=num_host,
        watermark_blocks=reserve(n_gpu_arena),
        hbm_bytes_per_step=int(hbm), h2d_bytes_per_step=int(h2d), d2h_bytes_per_step=int(d2h),
        hbm_ms=hbm_ms, pcie_ms=pcie_ms, step_time_ms=step_ms,
        decode_tok_s=n / step_ms * 1e3 if n and step_ms > 0 else 0.0, gpu_held=held)


def plan_capacity(model, inputs: CapacityInputs) -> CapacityPlan:
    """Plan every mode. ``model``: a ``ModelGeometry`` or a ``DSAConfig``."""
    geo = model if isinstance(model, ModelGeometry) else geometry_from_config(model)
    inputs.validate(geo)
    plan = CapacityPlan(inputs=inputs, geometry=geo)
    for mode in MODES:
        plan.modes[mode] = _plan_mode(mode, geo, inputs)
    return plan


def split_gpu_budget(geo: ModelGeometry, gpu_kv_bytes: int, mode: str, context: int,
                     **inputs) -> tuple[int, int]:
    """``(num_gpu_blocks, num_indexer_blocks)`` the engine allocates from ``gpu_kv_bytes`` in
    ``mode`` for requests of ``context`` tokens (``inputs``: the other
    :class:`CapacityInputs` fields, e.g. ``num_host_blocks``, ``max_num_seqs``): the planner's
    split -- the indexer cache for the ``max_running`` requests the mode can run (bounded by the
    host pool, the hot buffers or GPU pages, or ``max_num_seqs``; in ``hisparse`` the GPU-held
    requests past the host pool's bound included), the arena the rest of the budget. ``LLM``
    calls this when neither pool is given on CUDA; ``LLM.capacity()`` then reports the pools
    it chose."""
    mp = plan_capacity(geo, CapacityInputs(context=context, gpu_kv_bytes=gpu_kv_bytes,
                                           **inputs))[mode]
    return mp.num_gpu_blocks, mp.num_indexer_blocks


def plan_for_llm(llm, context: int | None = None, **overrides) -> CapacityPlan:
    """The plan of an ``LLM``'s real pools (block size, arena, indexer and host blocks, hot
    buffer, watermark, max_num_seqs, cache dtype); ``context`` defaults to ``max_model_len``;
    ``overrides`` replace ``CapacityInputs`` fields (e.g. ``hit_rate``, ``hbm_gb_s``)."""
    kv = llm.kv_config
    num_host = kv.num_host_blocks
    if not kv.uses_host:
        num_host = None  # the engine has no host pool; plan the host modes on none
    inputs = CapacityInputs(
        context=context or kv.max_model_len, block_size=kv.block_size,
        hot_buffer_size=kv.hot_buffer_size, max_num_seqs=kv.max_num_seqs,
        kv_cache_dtype=planner_kv_dtype(llm.caches.geo),
        num_gpu_blocks=kv.num_gpu_blocks, num_indexer_blocks=kv.num_indexer_blocks,
        num_host_blocks=num_host, watermark_blocks=kv.watermark_blocks)
    mg = planner_geometry(llm.model_config, llm.caches.geo)
    return plan_capacity(mg, replace(inputs, **overrides))


def planner_kv_dtype(cache_geo) -> str:
    """The planner's ``kv_cache_dtype`` of the engine's caches (a
    :class:`~hisparse.worker.cache.CacheGeometry`): ``"fp8"`` or the compute dtype's name."""
    return "fp8" if cache_geo.fp8 else str(cache_geo.dtype).removeprefix("torch.")


def planner_geometry(model_config, cache_geo) -> ModelGeometry:
    """The planner's view of the engine's caches: the model's geometry with the caches' layer
    counts (an MTP layer's KV included)."""
    return replace(geometry_from_config(model_config), num_layers=cache_geo.num_layers,
                   num_indexer_layers=len(cache_geo.indexer_layers))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _bound_cell(m: ModePlan, key: str) -> str:
    if key not in m.bounds:
        return "-"
    return f"{m.bounds[key]}" + (" *" if key == m.bound_by else "")


def format_plan(plan: CapacityPlan) -> str:
    """A human-readable table of ``plan``."""
    inp, geo = plan.inputs, plan.geometry
    dt = inp.kv_cache_dtype
    lines = [
        f"context {inp.context} tokens, block {inp.block_size}, kv dtype {dt} "
        f"(row {geo.row_bytes(dt)} B x {geo.num_layers} layers, key {geo.key_bytes(dt)} B x "
        f"{geo.num_indexer_layers} indexer layers), hot buffer "
        f"{hot_buffer_rows(inp.hot_buffer_size, geo.index_topk)} rows, hit rate "
        f"{inp.hit_rate:g}",
    ]
    weights = geo.weight_bytes if inp.weight_bytes is None else inp.weight_bytes
    arena_blk = inp.block_size * geo.num_layers * geo.row_bytes(dt)
    idx_blk = inp.block_size * geo.num_indexer_layers * geo.key_bytes(dt)
    budget = "" if inp.gpu_kv_bytes is None else f"GPU KV budget {_fmt_bytes(inp.gpu_kv_bytes)}, "
    lines.append(f"{budget}weights read per step {_fmt_bytes(weights)}, HBM {inp.hbm_gb_s:g} GB/s, "
                 f"PCIe {inp.pcie_gb_s:g} GB/s")
    rows = [
        ("max running", lambda m: str(m.max_running)),
        ("  of them GPU-held", lambda m: str(m.gpu_held)),
        ("bound by", lambda m: m.bound_by),
        *((f"  {k}", lambda m, k=k: _bound_cell(m, k))
          for k in (GPU_PAGES, HOT_BUFFERS, INDEXER_CACHE, HOST_POOL, MAX_NUM_SEQS)
          if any(k in m.bounds for m in plan.modes.values())),
        ("GPU arena B/token", lambda m: str(m.bytes_per_token["gpu_arena"])),
        ("GPU indexer B/token", lambda m: str(m.bytes_per_token["gpu_indexer"])),
        ("host B/token", lambda m: str(m.bytes_per_token["host"])),
        ("GPU per request", lambda m: _fmt_bytes(m.gpu_bytes_per_request)),
        ("host per request", lambda m: _fmt_bytes(m.host_bytes_per_request)),
        ("arena / indexer blocks", lambda m: f"{m.num_gpu_blocks} / {m.num_indexer_blocks}"),
        ("arena / indexer GiB", lambda m: f"{m.num_gpu_blocks * arena_blk / GIB:.1f} / "
                                          f"{m.num_indexer_blocks * idx_blk / GIB:.1f}"),
        ("host blocks", lambda m: str(m.num_host_blocks)),
        ("watermark blocks", lambda m: str(m.watermark_blocks)),
        ("HBM per step", lambda m: _fmt_bytes(m.hbm_bytes_per_step)),
        ("PCIe H2D per step", lambda m: _fmt_bytes(m.h2d_bytes_per_step)),
        ("HBM / PCIe ms", lambda m: f"{m.hbm_ms:.2f} / {m.pcie_ms:.2f}"),
        ("step time ms", lambda m: f"{m.step_time_ms:.2f}"),
        ("decode tok/s", lambda m: f"{m.decode_tok_s:.0f}"),
    ]
    modes = list(plan.modes.values())
    cells = [[f(m) for m in modes] for _, f in rows]
    width = max(14, *(len(c) + 2 for row in cells for c in row))
    lines.append("(bounds: requests each resource alone allows; * = the one that binds; arena / "
                 "indexer: the split of the GPU budget for each mode, what LLM allocates when "
                 "neither pool is given)")
    lines.append(f"{'':<24}" + "".join(f"{m.mode:>{width}}" for m in modes))
    for (name, _), row in zip(rows, cells):
        lines.append(f"{name:<24}" + "".join(f"{c:>{width}}" for c in row))
    return "\n".join(lines)
