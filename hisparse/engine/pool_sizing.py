"""How big each KV pool of an engine is: :func:`plan_pools` from the arguments and the
checkpoint's config (before any weight is loaded), then :func:`size_kv_config` once the weights
are on the device (free GPU memory is measured after them).

Every limit a pool cannot meet is a ValueError naming the argument to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hisparse.config import KVCacheConfig, Mode, cdiv, host_blocks_for_gib, hot_buffer_rows
from hisparse.engine.engine_args import EngineArgs
from hisparse.worker.cache import CacheGeometry
from hisparse.worker.pinned import auto_host_pool_bytes, available_host_memory_bytes

logger = logging.getLogger("hisparse.engine")


def auto_kv_cache_dtype(device: torch.device, compute_dtype: torch.dtype, mc,
                        block_size: int) -> str:
    """``kv_cache_dtype="auto"``: the deployment format (``"fp8"``) where it applies - a CUDA
    device, a bf16 model, a latent and indexer keys of whole 128-value FP8 tiles and 16-B
    aligned key pages - else the exact one (``"bf16"``: CPU runs, fp32 models, small test
    geometries). Measured on the H200 (docs/BENCHMARKS.md, FP8 KV run 2): FP8 steps cost
    1.03x bf16's at the same batch and fit 1.6x the requests in the same GPU bytes."""
    from hisparse.ops.quant import TILE, index_key_bytes

    if device.type != "cuda" or compute_dtype != torch.bfloat16:
        return "bf16"
    if mc.kv_lora_rank % TILE or mc.index_head_dim % TILE:
        return "bf16"
    if (block_size * index_key_bytes(mc.index_head_dim)) % 16:
        return "bf16"
    return "fp8"


@dataclass
class PoolPlan:
    """The pools as far as the arguments and the checkpoint's config fix them.

    ``kv_fields``: every :class:`~hisparse.config.KVCacheConfig` keyword but
    ``num_gpu_blocks`` (already validated against the smallest workable GPU pool,
    ``min_gpu_blocks``). ``num_gpu_blocks``: the caller's, or ``None`` (sized after the
    weights). ``auto_split``: neither GPU pool was given, so a CUDA device splits its free
    memory between them. ``staging_rows``: rows of the GPU staging area the config will
    allocate. ``host_pool_gib``: the pool asked for, ``"auto"`` resolved to GiB.
    ``num_speculative_tokens`` > 0 adds the MTP layer's KV to ``geometry``."""

    geometry: CacheGeometry
    max_model_len: int
    num_speculative_tokens: int
    kv_fields: dict
    num_gpu_blocks: int | None
    min_gpu_blocks: int
    staging_rows: int
    auto_split: bool
    host_pool_gib: float | str


def plan_pools(args: EngineArgs, mc) -> PoolPlan:
    """Check ``args`` against the model config ``mc`` and size everything that does not depend
    on free GPU memory. Reads no weights; the host pool's size is checked against the host
    memory available."""
    from hisparse.models.config import parse_dtype

    if args.tensor_parallel_size > 1:
        from hisparse.models.tp import check_tp_divisible
        check_tp_divisible(mc, args.tensor_parallel_size)
    max_model_len = args.max_model_len or min(mc.max_position_embeddings, 16384)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({mc.max_position_embeddings})")
    k_spec, mode, block_size = args.num_speculative_tokens, args.mode, args.block_size
    hot_buffer_size = args.hot_buffer_size
    if k_spec and mc.num_nextn_predict_layers < 1:
        raise ValueError(f"num_speculative_tokens={k_spec} needs MTP layers, but the "
                         f"checkpoint's config has num_nextn_predict_layers="
                         f"{mc.num_nextn_predict_layers}")
    if k_spec and mode != Mode.GPU_ONLY:
        # A verify group's union of selections is at most (k + 1) * index_topk rows: a hot
        # buffer that large can never overflow (the resolver would fail the step).
        need = (k_spec + 1) * mc.index_topk
        if hot_buffer_size is None:
            hot_buffer_size = max(need, hot_buffer_rows(None, mc.index_topk))
        elif hot_buffer_size < need:
            raise ValueError(f"hot_buffer_size ({hot_buffer_size}) must be >= "
                             f"(num_speculative_tokens + 1) * index_topk = {need}: a "
                             f"verify step resolves the union of its tokens' selections")
    compute_dtype = parse_dtype(args.dtype) if args.dtype is not None else mc.dtype
    kv_cache_dtype = args.kv_cache_dtype
    if kv_cache_dtype == "auto":
        kv_cache_dtype = auto_kv_cache_dtype(args.device, compute_dtype, mc, block_size)
    n_cache_layers = mc.num_layers + (1 if k_spec else 0)   # + the MTP layer's KV
    geo = CacheGeometry(num_layers=n_cache_layers, row_dim=mc.kv_row_dim,
                        indexer_layers=tuple(l for l in range(n_cache_layers)
                                             if mc.layer_has_indexer(l)),
                        index_head_dim=mc.index_head_dim,
                        dtype=compute_dtype,
                        kv_cache_dtype=kv_cache_dtype, rope_dim=mc.qk_rope_head_dim)
    pages = cdiv(max_model_len, block_size)
    # Both GPU pools unset on CUDA: split the free memory after the weights by the planner
    # (size_kv_config); until then the largest indexer cache validates the arguments.
    auto_split = args.num_gpu_blocks is None and args.num_indexer_blocks is None
    num_indexer_blocks = args.num_indexer_blocks
    if num_indexer_blocks is None:
        num_indexer_blocks = args.max_num_seqs * pages
    num_host_blocks = 0
    host_pool_gib, host_buffers = args.host_pool_gib, args.host_buffers
    if mode != Mode.GPU_ONLY:
        if host_pool_gib == "auto" and host_buffers is not None:
            host_pool_gib = sum(t.numel() * t.element_size() for t in host_buffers) / (1 << 30)
        elif host_pool_gib == "auto":
            host_pool_gib = auto_host_pool_bytes(args.device.type == "cuda") / (1 << 30)
            logger.info("host_pool_gib='auto': %.1f GiB", host_pool_gib)
            if host_pool_gib <= 0:
                raise ValueError(
                    f"host_pool_gib='auto' found no host memory to pin beside the headroom "
                    f"(available {available_host_memory_bytes() / (1 << 30):.1f} GiB, cgroup "
                    f"limit included): give host_pool_gib a size, or run mode='gpu-only'")
        num_host_blocks = host_blocks(host_pool_gib, host_buffers is not None, geo, block_size,
                                      max_model_len)
    kv_fields = dict(block_size=block_size, num_host_blocks=num_host_blocks,
                     num_indexer_blocks=num_indexer_blocks, max_model_len=max_model_len,
                     index_topk=mc.index_topk, hot_buffer_size=hot_buffer_size,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, mode=mode,
                     enable_prefix_caching=args.enable_prefix_caching,
                     watermark_blocks=args.watermark_blocks, staging_rows=args.staging_rows,
                     hot_prefetch_rows=args.hot_prefetch_rows)
    # Validates everything but the GPU pool size; gives the smallest workable pool.
    probe = KVCacheConfig(num_gpu_blocks=max(args.num_gpu_blocks or 0, 1 << 40), **kv_fields)
    if args.num_gpu_blocks is not None:
        KVCacheConfig(num_gpu_blocks=args.num_gpu_blocks, **kv_fields)  # names the limit
    return PoolPlan(geometry=geo, max_model_len=max_model_len, num_speculative_tokens=k_spec,
                    kv_fields=kv_fields, num_gpu_blocks=args.num_gpu_blocks,
                    min_gpu_blocks=probe.min_gpu_blocks, staging_rows=probe.num_staging_rows,
                    auto_split=auto_split, host_pool_gib=host_pool_gib)


def host_blocks(host_pool_gib: float, given_buffers: bool, geo: CacheGeometry,
                block_size: int, max_model_len: int) -> int:
    """Host pool blocks of ``host_pool_gib``; at least one ``max_model_len`` request's, and (when
    the engine allocates the pool: not ``given_buffers``) no more than the host memory
    available."""
    pages = cdiv(max_model_len, block_size)
    per_block = geo.bytes_per_token * block_size
    avail = available_host_memory_bytes()
    if not given_buffers and host_pool_gib * (1 << 30) > avail:
        raise ValueError(f"host_pool_gib ({host_pool_gib}) exceeds available host memory "
                         f"({avail / (1 << 30):.1f} GiB)")
    blocks = host_blocks_for_gib(host_pool_gib, per_block)
    if blocks < pages:
        need = pages * per_block / (1 << 30)
        raise ValueError(
            f"host_pool_gib ({host_pool_gib}) holds {blocks} blocks of {block_size} tokens; "
            f"one max_model_len={max_model_len} request needs {pages} "
            f"(host_pool_gib >= {need:.3g}): raise host_pool_gib or lower max_model_len")
    return blocks


def size_kv_config(plan: PoolPlan, args: EngineArgs, mc, model) -> tuple[KVCacheConfig,
                                                                         int | None]:
    """The engine's :class:`~hisparse.config.KVCacheConfig`: ``plan`` with the GPU pools sized,
    and the GPU KV budget they were split from (bytes; ``None`` unless split: CPU, or a pool
    given). Given ``num_gpu_blocks`` is kept; otherwise CPU holds ``max_num_seqs`` full-length
    requests and CUDA fills free memory x ``gpu_memory_utilization`` less the logits state, the
    speculative graphs' buffers (``model`` loaded: its weights already counted as used) and the
    staging area, split between the arena and the indexer cache when ``plan.auto_split``."""
    kv_fields = dict(plan.kv_fields)
    num_gpu_blocks = plan.num_gpu_blocks
    split_budget = None
    if num_gpu_blocks is None:
        from hisparse.engine.logits import LogitsState

        device, k_spec, max_num_seqs = args.device, plan.num_speculative_tokens, args.max_num_seqs
        geo, min_gpu = plan.geometry, plan.min_gpu_blocks
        pages = cdiv(plan.max_model_len, args.block_size)
        reserve = LogitsState.nbytes(max_num_seqs, mc.vocab_size)   # penalty token state
        # the speculative steps' static buffers exist captured or not (bucketed eager)
        if k_spec and device.type == "cuda" and model.cuda_graph_safe:
            from hisparse.worker.cuda_graph import spec_graph_bytes
            reserve += spec_graph_bytes(max_num_seqs, k_spec, mc.vocab_size, mc.hidden_size)
        budget = gpu_kv_budget(device, geo, args.gpu_memory_utilization, reserve,
                               plan.staging_rows)
        if budget is None:      # CPU: room for max_num_seqs full-length requests
            num_gpu_blocks = max(max_num_seqs * pages, min_gpu)
        elif plan.auto_split:
            num_gpu_blocks, kv_fields["num_indexer_blocks"] = split_gpu_budget(plan, mc, budget)
            split_budget = budget
        else:
            num_gpu_blocks = default_gpu_blocks(plan, device, args.gpu_memory_utilization,
                                                reserve)
    return KVCacheConfig(num_gpu_blocks=num_gpu_blocks, **kv_fields), split_budget


def gpu_kv_budget(device: torch.device, geo: CacheGeometry, utilization: float, reserve: int,
                  staging_rows: int) -> int | None:
    """Bytes for the arena plus the indexer cache: free device memory x ``utilization``
    less the staging area (``staging_rows``) and ``reserve``; ``None`` without CUDA (CPU pools
    are sized by ``max_num_seqs``)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * utilization - staging_rows * geo.row_bytes - reserve)


def split_gpu_budget(plan: PoolPlan, mc, budget: int) -> tuple[int, int]:
    """``(num_gpu_blocks, num_indexer_blocks)`` of ``budget`` bytes for the plan's mode (the
    capacity planner's split, :func:`hisparse.engine.capacity.split_gpu_budget`): the
    indexer cache holds the requests the mode can run -- bounded by the host pool, the hot
    buffers / GPU pages or ``max_num_seqs`` -- and the arena gets the rest, so neither pool
    idles while the other binds."""
    from hisparse.engine.capacity import arena_blocks_for, planner_geometry, planner_kv_dtype
    from hisparse.engine.capacity import split_gpu_budget as planner_split

    kv, geo, min_gpu = plan.kv_fields, plan.geometry, plan.min_gpu_blocks
    mode, bs = kv["mode"], kv["block_size"]
    pages = cdiv(plan.max_model_len, bs)
    n_gpu, n_idx = planner_split(
        planner_geometry(mc, geo), budget, mode=str(mode), context=plan.max_model_len,
        block_size=bs, hot_buffer_size=kv["hot_buffer_size"],
        max_num_seqs=kv["max_num_seqs"], kv_cache_dtype=planner_kv_dtype(geo),
        num_host_blocks=kv["num_host_blocks"] if mode != Mode.GPU_ONLY else None,
        watermark_blocks=kv["watermark_blocks"])
    n_idx = max(n_idx, pages)
    cap = max(kv["max_num_seqs"] * pages, min_gpu)
    if mode == Mode.HISPARSE:   # GPU-held requests: that many full-length ones, watermark free
        cap = arena_blocks_for(cap, kv["watermark_blocks"],
                               cdiv(hot_buffer_rows(kv["hot_buffer_size"], kv["index_topk"]),
                                    bs))
    n_gpu = min(n_gpu, cap)
    if n_gpu < min_gpu:
        raise ValueError(
            f"free GPU memory for the KV cache ({budget / (1 << 30):.2f} GiB after the "
            f"weights) holds {max(n_gpu, 0)} KV blocks next to an indexer cache of {n_idx} "
            f"blocks; the engine needs num_gpu_blocks >= {min_gpu}: lower max_model_len or "
            "raise gpu_memory_utilization")
    return n_gpu, n_idx


def default_gpu_blocks(plan: PoolPlan, device: torch.device, utilization: float,
                       reserve: int = 0) -> int:
    """KV blocks that fit the free memory after the indexer cache (the plan's
    ``num_indexer_blocks``), the staging area and ``reserve`` bytes (the logits state, the
    speculative CUDA graphs' buffers), at most ``max_num_seqs`` full-length requests'."""
    kv, geo, min_gpu = plan.kv_fields, plan.geometry, plan.min_gpu_blocks
    block_size, num_indexer_blocks = kv["block_size"], kv["num_indexer_blocks"]
    unconstrained = kv["max_num_seqs"] * cdiv(plan.max_model_len, block_size)
    free, _ = torch.cuda.mem_get_info(device)
    budget = (free * utilization - num_indexer_blocks * geo.indexer_bytes_per_block(block_size)
              - plan.staging_rows * geo.row_bytes - reserve)
    blocks = min(int(budget // geo.gpu_bytes_per_block(block_size)), unconstrained)
    if blocks < min_gpu:
        raise ValueError(
            f"free GPU memory ({free / (1 << 30):.2f} GiB x gpu_memory_utilization="
            f"{utilization}) holds {max(blocks, 0)} KV blocks after the indexer cache "
            f"(num_indexer_blocks={num_indexer_blocks}); the engine needs num_gpu_blocks >= "
            f"{min_gpu}: lower max_model_len / max_num_seqs / num_indexer_blocks or raise "
            "gpu_memory_utilization")
    return blocks
