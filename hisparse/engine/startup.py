"""An engine's life cycle: :func:`build_engine` turns checked :class:`EngineArgs` into the
:class:`EngineParts` an ``LLM`` runs with (config, weights, caches, runner, scheduler, core,
disaggregation, tokenizer; tensor-parallel workers started and joined), and :func:`stop` /
:func:`free_memory` take them down again (``LLM.shutdown``, and a start-up that failed half
way: nothing it allocated outlives the exception).

Order matters: everything checkable without weights is checked first
(:func:`~hisparse.engine.pool_sizing.plan_pools`), the kernel switches are read from the
environment once (:func:`hisparse.ops.switches.reload`: nothing later, graph capture included,
sees a variable changed after this), the weights are loaded before the GPU pools
are sized (free memory is measured after them), and TP ranks load their shards while this rank
allocates its caches.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import traceback
import weakref
from dataclasses import dataclass

import torch

from hisparse.config import KVCacheConfig
from hisparse.engine.core import EngineCore
from hisparse.engine.disagg import Disaggregation
from hisparse.engine.engine_args import EngineArgs
from hisparse.engine.errors import EngineStartupError
from hisparse.engine.pool_sizing import PoolPlan, plan_pools, size_kv_config
from hisparse.engine.scheduler import Scheduler
from hisparse.models.loader import load_config, load_model, model_bytes
from hisparse.ops import switches as kernel_switches
from hisparse.worker.cache import CacheGeometry, KVCaches
from hisparse.worker.model_runner import ModelRunner
from hisparse.worker.pinned import available_host_memory_bytes

logger = logging.getLogger("hisparse.engine")

# Seeds random (load_format="dummy") weights identically on every tensor-parallel rank.
_TP_SEED = 0


@dataclass
class EngineParts:
    """What a started engine consists of; an ``LLM`` adopts each part as its attribute of the
    same name (``tp``: ``_tp``). ``switches``: the kernel switches it runs with (read at its
    start; every rank runs rank 0's). ``tp`` is the ``TPWorkers`` of ranks 1..N-1 (``None`` without
    tensor parallelism); ``runner`` then wraps them (``TPRunner``). ``disagg`` is ``None``
    without ``kv_role``; ``tokenizer`` is ``None`` when the model directory has none."""

    model_dir: str
    device: torch.device
    tensor_parallel_size: int
    model_config: object
    max_model_len: int
    kv_config: KVCacheConfig
    model: torch.nn.Module | None
    caches: KVCaches | None
    runner: object
    scheduler: Scheduler
    core: EngineCore
    disagg: Disaggregation | None
    tokenizer: object
    switches: kernel_switches.KernelSwitches
    tp: object = None
    gpu_kv_budget: int | None = None    # bytes the GPU pools were split from (None: not split)


def build_engine(args: EngineArgs) -> EngineParts:
    """Load, size, allocate and wire everything ``args`` asks for. A ValueError (a limit the
    checkpoint or the machine sets) comes before any weight is loaded where it can; an
    allocation that fails is an :class:`EngineStartupError` naming the knob to change. On any
    failure, what was started is stopped and its memory released before the error propagates."""
    mc = load_config(args.model)
    plan = plan_pools(args, mc)
    switches = kernel_switches.reload()
    _warn_if_live_engines_differ(switches)
    tp, k_spec = args.tensor_parallel_size, plan.num_speculative_tokens
    if tp > 1:
        torch.manual_seed(_TP_SEED)     # load_format="dummy": the same weights on every rank
    model = load_weights(args, mc, 1 if k_spec else 0)
    kv_config, gpu_kv_budget = size_kv_config(plan, args, mc, model)
    workers = runner = core = disagg = None
    try:
        host_buffers = args.host_buffers
        if tp > 1:
            host_buffers, workers = start_tp(args, mc, kv_config, plan.geometry, switches)
        caches = allocate_caches(kv_config, plan, args.device, host_buffers)
        caches.set_hot_policy(args.hot_policy)
        # k is passed only when set: a runner_cls without the argument still serves k = 0
        spec_kw = {"num_speculative_tokens": k_spec} if k_spec else {}
        runner = (args.runner_cls or ModelRunner)(
            model, caches, mc.index_topk, mc.kv_lora_rank,
            enforce_eager=args.enforce_eager or tp > 1,   # collectives in graphs: not yet
            **spec_kw)
        if tp > 1:
            runner = join_tp(workers, runner, model, mc, kv_config, caches, tp)
        scheduler = Scheduler(kv_config)
        core = EngineCore(scheduler, runner, frozenset(mc.eos_token_ids), args.async_scheduling,
                          num_speculative_tokens=k_spec, gc_freeze=args.gc_freeze,
                          vocab_size=mc.vocab_size)
        if args.kv_role is not None:
            disagg = Disaggregation(args.kv_role, scheduler, caches, mc, args.kv_host,
                                    args.kv_port, args.kv_load_failure, args.kv_load_timeout_s,
                                    args.kv_hold_timeout_s)
            if args.kv_role == "decode":
                core.kv_transfer = disagg.agent
                core.recompute_failed_loads = disagg.recompute
        tokenizer = load_tokenizer(args.model)
    except BaseException:
        stop(runner, core, disagg, workers)
        model = caches = runner = core = disagg = None   # free them below
        free_memory(args.device)
        raise
    _LIVE_SWITCHES[core] = switches
    return EngineParts(model_dir=args.model, device=args.device, tensor_parallel_size=tp,
                       model_config=mc, max_model_len=plan.max_model_len, kv_config=kv_config,
                       model=model, caches=caches, runner=runner, scheduler=scheduler,
                       core=core, disagg=disagg, tokenizer=tokenizer, switches=switches,
                       tp=workers, gpu_kv_budget=gpu_kv_budget)


def load_weights(args: EngineArgs, mc, num_mtp_layers: int) -> torch.nn.Module:
    """The model on ``args.device`` (rank 0's shard under tensor parallelism: the whole model is
    loaded, then sharded), its weights finalized (``finalize_weights_``). Out of device memory: an
    :class:`EngineStartupError` with the weights' size against the device's memory."""
    tp = args.tensor_parallel_size
    try:
        model, _ = load_model(args.model, dtype=args.dtype, device=args.device,
                              num_mtp_layers=num_mtp_layers, load_format=args.load_format,
                              config=mc)
        if tp > 1:
            from hisparse.models.tp import shard_model_
            shard_model_(model, 0, tp)
        # before the KV cache is sized: the stacked copies are made while the GPU has room
        model.finalize_weights_()
        return model
    except torch.OutOfMemoryError as e:
        traceback.clear_frames(e.__traceback__)     # the partial model's tensors, freed below
        free_memory(args.device)
        gib = 1 << 30
        need = model_bytes(mc, args.dtype, num_mtp_layers) / gib
        have = (f" of {torch.cuda.get_device_properties(args.device).total_memory / gib:.1f} "
                "GiB" if args.device.type == "cuda" else "")
        raise EngineStartupError(
            f"out of memory loading the weights on {args.device}{have}: the model is "
            f"{need:.1f} GiB ({mc.num_layers} layers{', then sharded' if tp > 1 else ''}, "
            "plus stacked projection copies): use a checkpoint with fewer parameters per GPU "
            "(one tensor-parallel rank's shape, e.g. `hisparse bench --model-shape "
            "deepseek-v3.2-tp8-rank`, and `--layers N` for a cut of it) or a GPU with more "
            "memory") from e


# the kernel switches each engine of this process started with (by its core, while it lives)
_LIVE_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warn_if_live_engines_differ(new: kernel_switches.KernelSwitches) -> None:
    """Kernel switches are per process (:mod:`hisparse.ops.switches`): an engine started while
    another one lives under a different environment changes what the older one runs, eager
    steps and sizes not yet captured included. Say so, naming the switches."""
    for old in list(_LIVE_SWITCHES.values()):
        changed = [f.name for f in dataclasses.fields(new)
                   if getattr(new, f.name) != getattr(old, f.name)]
        if changed:
            logger.warning("kernel switches %s differ from those of an engine still alive in "
                           "this process: it follows the new ones from now on (switches are "
                           "per process; start engines of one process under one environment)",
                           ", ".join(f"{n}={getattr(new, n)!r}" for n in changed))
            return


def stop(runner, core: EngineCore | None, disagg: Disaggregation | None, tp) -> None:
    """Stop what runs in the background of an engine (any part may be ``None``): mirror copies
    in flight finish writing the pools, the heap frozen for its requests is unfrozen, the NIXL
    agent closes and tensor-parallel workers stop."""
    if core is not None:
        _LIVE_SWITCHES.pop(core, None)
    if runner is not None and hasattr(runner, "drain"):
        try:
            runner.drain()    # mirror copies still in flight write the pools
        except Exception:  # noqa: BLE001  (a faulted device: nothing more to wait for)
            pass
    if core is not None:
        core.freezer.release()
    if disagg is not None:
        disagg.close()
    if tp is not None and not tp.closed:
        tp.close()


def free_memory(device: torch.device) -> None:
    """Collect dropped engine parts now and return cached GPU memory to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- tensor parallelism
def start_tp(args: EngineArgs, mc, cfg: KVCacheConfig, geo: CacheGeometry,
             switches: kernel_switches.KernelSwitches):
    """Allocate the node's one shared host pool (unless ``args.host_buffers`` is one), write
    its nonce, spawn ranks 1..N-1 (they load their shards while this rank builds its caches;
    each runs with ``switches``, rank 0's). Returns ``(host_buffers, TPWorkers)``."""
    from hisparse.worker.tp import TPWorkers, shared_host_buffers, write_nonce

    host_buffers = args.host_buffers
    rows = cfg.num_host_blocks * cfg.block_size if cfg.uses_host else 0
    if host_buffers is None:
        try:
            host_buffers = shared_host_buffers(
                (geo.num_layers, rows, geo.row_width),
                geo.indexer_shape(rows // cfg.block_size, cfg.block_size), geo.storage_dtype,
                args.device.type == "cuda")
        except RuntimeError as e:
            raise EngineStartupError(
                f"could not allocate the shared host pool ({cfg.num_host_blocks} blocks): "
                f"lower host_pool_gib ({e})") from e
    elif not all(t.is_shared() for t in host_buffers):
        raise ValueError("host_buffers must live in shared memory (tensor.share_memory_()) "
                         "when tensor_parallel_size > 1")
    write_nonce(host_buffers[0])
    spec = dict(world=args.tensor_parallel_size, device=args.device, model=args.model,
                dtype=args.dtype, load_format=args.load_format, model_config=mc,
                kv_config=cfg, geometry=geo, hot_policy=args.hot_policy,
                runner_cls=args.runner_cls, seed=_TP_SEED, switches=switches,
                threads=torch.get_num_threads() if args.device.type == "cpu" else None)
    return host_buffers, TPWorkers(spec, host_buffers)


def join_tp(workers, runner, model, mc, cfg: KVCacheConfig, caches: KVCaches, world: int):
    """Start-up check of every rank against this one; returns the runner wrapped to drive
    them (``TPRunner``)."""
    import torch.distributed as dist

    from hisparse.models.tp import set_tp_group
    from hisparse.worker.tp import TPRunner, fingerprint

    workers.wait_ready(fingerprint(model, mc, cfg, caches.geo, caches.host,
                                   caches.host_indexer, world))
    set_tp_group(model, dist.group.WORLD)
    return TPRunner(runner, workers)


# ---------------------------------------------------------------------- allocation
def allocate_caches(cfg: KVCacheConfig, plan: PoolPlan, device: torch.device,
                    host_buffers) -> KVCaches:
    """Allocate the tiers; a failure names the pool to shrink and leaves nothing behind."""
    geo = plan.geometry
    try:
        return KVCaches(cfg, geo, device, host_buffers)
    except RuntimeError as e:   # torch.OutOfMemoryError included
        gib = 1 << 30
        arena = cfg.num_gpu_blocks * geo.gpu_bytes_per_block(cfg.block_size)
        idx = cfg.num_indexer_blocks * geo.indexer_bytes_per_block(cfg.block_size)
        free_memory(device)
        gpu_short = isinstance(e, torch.OutOfMemoryError) and (
            device.type != "cuda" or torch.cuda.mem_get_info(device)[0] < arena + idx)
        if gpu_short or not cfg.uses_host or host_buffers is not None:
            if not isinstance(e, torch.OutOfMemoryError):
                raise
            raise EngineStartupError(
                f"out of GPU memory allocating the KV cache: num_gpu_blocks="
                f"{cfg.num_gpu_blocks} ({arena / gib:.2f} GiB), num_indexer_blocks="
                f"{cfg.num_indexer_blocks} ({idx / gib:.2f} GiB): lower num_gpu_blocks "
                "(or gpu_memory_utilization), num_indexer_blocks or max_num_seqs") from e
        avail = available_host_memory_bytes() / gib
        raise EngineStartupError(
            f"could not allocate the {'pinned ' if device.type == 'cuda' else ''}host "
            f"pool (host_pool_gib={plan.host_pool_gib}, {cfg.num_host_blocks} blocks); "
            f"{avail:.1f} GiB host memory available: lower host_pool_gib ({e})") from e


def load_tokenizer(path: str):
    """The model directory's tokenizer (transformers' ``AutoTokenizer``), ``None`` if it has
    no tokenizer files."""
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------- start-up summary
def log_summary(parts: EngineParts) -> None:
    """One start-up summary (INFO): the model, the pools in tokens and bytes, mode, graphs,
    and the capacity each mode has with these pools."""
    from hisparse.engine.capacity import plan_for_llm

    cfg, mc, geo = parts.kv_config, parts.model_config, parts.caches.geo
    bs = cfg.block_size
    graphs = parts.runner.graphs
    spec_graphs = getattr(parts.runner, "spec_graphs", None)
    if graphs is not None and not graphs.capture:
        graphs = None
    if spec_graphs is not None and not spec_graphs.capture:
        spec_graphs = None

    def size(n: float) -> str:
        return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"

    buckets = "off"
    if graphs is not None:
        buckets = f"decode batches up to {graphs.max_batch}"
    elif spec_graphs is not None:
        buckets = (f"speculative steps ({spec_graphs.k1} tokens per request) of batches up "
                   f"to {spec_graphs.max_batch}")
    logger.info("model %s: %d layers, vocab %d, index_topk %d, dtype %s, KV %s, device %s",
                parts.model_dir, mc.num_layers, mc.vocab_size, mc.index_topk,
                str(geo.dtype).removeprefix("torch."), geo.kv_cache_dtype, parts.device)
    logger.info(
        "mode %s | GPU pool %d blocks x %d = %d tokens (%s) | host pool %d tokens "
        "(%s) | indexer %d tokens | hot buffer %d rows/layer/request | "
        "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d | CUDA graphs %s",
        cfg.mode, cfg.num_gpu_blocks, bs, cfg.num_gpu_blocks * bs,
        size(cfg.num_gpu_blocks * geo.gpu_bytes_per_block(bs)), cfg.num_host_blocks * bs,
        size(cfg.num_host_blocks * geo.bytes_per_token * bs), cfg.num_indexer_blocks * bs,
        cfg.hot_buffer_size, parts.max_model_len, cfg.max_num_seqs,
        cfg.max_num_batched_tokens, buckets)
    logger.info("kernel switches (read at start-up): %s", parts.switches)
    try:
        plan = plan_for_llm(parts)
        logger.info("capacity at %d tokens/request: %s", parts.max_model_len, ", ".join(
            f"{m} {mp.max_running} running ({mp.bound_by})" for m, mp in plan.modes.items()))
    except Exception as e:  # noqa: BLE001 - the summary must not stop start-up
        logger.debug("capacity plan unavailable: %s", e)
