"""The user-facing engine, shaped like vLLM's ``LLM``.

    from hisparse import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", host_pool_gib=8)
    outs = llm.generate(["text", ...] or [{"prompt_token_ids": [...]}, ...],
                        SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import numbers
import os
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hisparse.config import KVCacheConfig, Mode, cdiv, host_blocks_for_gib
from hisparse.engine.core import EngineCore
from hisparse.engine.detokenizer import IncrementalDetokenizer
from hisparse.engine.disagg import Disaggregation, check_disagg_args
from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.models.loader import load_config, load_model
from hisparse.worker.cache import KV_CACHE_DTYPES, CacheGeometry, KVCaches
from hisparse.worker.model_runner import ModelRunner
from hisparse.worker.pinned import auto_host_pool_bytes, available_host_memory_bytes

logger = logging.getLogger("hisparse.engine")

# Seeds random (load_format="dummy") weights identically on every tensor-parallel rank.
_TP_SEED = 0

# The deprecated ``hisparse=`` keyword's values.
HISPARSE_MODES = {True: Mode.HISPARSE, False: Mode.GPU_ONLY, "always-host": Mode.ALWAYS_HOST}


MAX_SPECULATIVE_TOKENS = 8


class EngineStartupError(RuntimeError):
    """A resource could not be allocated at start-up; the message names the knob to change."""


class EngineDeadError(RuntimeError):
    """An engine-wide fault (device error, a failed forward) stopped the engine."""


@dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None      # "stop" | "length" | "abort" | "error"
    error: str | None = None       # why, when finish_reason == "error"
    # per output token ``{token id: log-probability}``, the sampled token first, then the
    # ``SamplingParams.logprobs`` most likely (raw model distribution); None unless asked
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One request's tokens so far (``finished`` once it is done). ``prompt_token_ids`` is the
    engine's own list of the prompt, shared by every output of the request: read it, do not
    mutate it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True          # False: a streaming update (tokens so far) of a running one
    # Prefill instance (``kv_role="prefill"``): the params of the decode request of a
    # ``do_remote_decode`` request (vLLM's protocol; :mod:`hisparse.kv.transfer_plan`)
    kv_transfer_params: dict | None = None


# ---------------------------------------------------------------------- argument checks
def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}"
                         + (" or None" if optional else "") + f", got {value!r}")


def _check_real(name: str, value, lo: float, hi: float, lo_open: bool = True) -> None:
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi)
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], "
                         f"got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def resolve_mode(mode: Mode | str | None, hisparse: bool | str | None) -> Mode:
    """``mode`` (new) or the deprecated ``hisparse`` keyword, mapped once to a :class:`Mode`."""
    if hisparse is not None:
        if mode is not None:
            raise ValueError("pass mode=... only (hisparse=... is its deprecated alias)")
        warnings.warn("LLM(hisparse=...) is deprecated: use mode='hisparse' | 'gpu-only' | "
                      "'always-host'", DeprecationWarning, stacklevel=3)
        if not isinstance(hisparse, (bool, str)) or hisparse not in HISPARSE_MODES:
            raise ValueError(f"hisparse must be True, False or 'always-host', got {hisparse!r}")
        return HISPARSE_MODES[hisparse]
    return Mode.HISPARSE if mode is None else Mode.parse(mode)


def _parse_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; "
                             "use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA "
                             "device(s) exist")
    return dev



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

class LLM:
    """Continuous-batching DSA engine with lossless HiSparse KV tiering.

    ``mode`` (a :class:`~hisparse.config.Mode` or its value): ``"hisparse"`` (GPU first, spill
    under pressure; the default), ``"gpu-only"`` (baseline: admission bounded by GPU blocks) or
    ``"always-host"`` (every request reads its history through its hot buffer once its prompt is
    done). ``hisparse=True|False|"always-host"`` is the deprecated spelling.
    ``num_gpu_blocks=None`` sizes the GPU arena from free device memory (CUDA) or to hold
    ``max_num_seqs`` full-length requests (CPU), never below what one request needs. With
    ``num_indexer_blocks=None`` too, on CUDA the free memory is split for the mode that runs
    (:func:`hisparse.engine.capacity.split_gpu_budget`): the indexer cache for the requests the
    mode can run (bounded by the host pool, the hot buffers or GPU pages, or ``max_num_seqs``),
    the arena the rest; :meth:`capacity` shows the pools chosen and what bounds them.
    ``host_pool_gib="auto"``: the largest pool that pins (probed on CUDA, in chunks, then freed;
    doubles the start-up pinning time) less a headroom, or half the available memory without
    CUDA (:mod:`hisparse.worker.pinned`). A pool that cannot be allocated or pinned is an
    ``EngineStartupError`` naming ``host_pool_gib``. On CUDA,
    pure decode steps of dense-MLP models are captured as CUDA graphs unless ``enforce_eager``.

    Every argument is checked before anything is loaded (ValueError naming the field and the
    limit). A request that fails (sampling, non-finite logits, detokenizing) finishes with
    ``finish_reason="error"`` and the engine keeps serving; an engine-wide fault raises
    :class:`EngineDeadError` from then on.
    ``kv_cache_dtype``: ``"auto"`` (default: ``"fp8"`` on CUDA for a bf16 model whose latent
    and indexer keys are whole 128-value tiles, as DeepSeek-V3.2 and GLM-5 are; ``"bf16"``
    otherwise), ``"bf16"`` (rows and indexer keys unquantized in the model dtype: the exact
    format, for comparisons against transformers) or ``"fp8"`` (FlashMLA's 656-B FP8 rows and
    132-B FP8 indexer keys, the deployment format: 1.75x the tokens per byte in both tiers;
    :mod:`hisparse.ops.quant`). ``stats()["kv_cache_dtype"]`` says which one runs.
    ``runner_cls``: the worker's one extension seam, a ``ModelRunner`` subclass (or callable with
    its signature) used instead of ``ModelRunner`` (benchmarks: ``hisparse.bench.synthetic``).
    ``tensor_parallel_size=N > 1``: this process is rank 0 (scheduler, sampling, its own shard)
    and starts N-1 worker processes (``torch.multiprocessing`` spawn; NCCL on CUDA, gloo on CPU)
    that execute every step with their shard; one host pool in shared memory serves every rank
    (``host_pool_gib`` is the node's pool, not per rank). See :mod:`hisparse.worker.tp`; call
    :meth:`shutdown` (or drop the LLM) to stop the workers. Decode runs eager under TP for now.
    ``num_speculative_tokens=k`` (0 = off, 1..8, ``< block_size``): MTP speculative decoding
    (:mod:`hisparse.engine.spec`). The checkpoint's first MTP layer is loaded (its KV is one
    more cache layer); each step verifies every decoding request's last token and ``k`` drafts
    (``k + 1`` positions resolved as one group through its hot buffer), accepts by rejection
    sampling (exact; greedy output identical to ``k = 0``) and drafts the next ``k``. It runs
    in the synchronous loop (``async_scheduling`` is ignored); on CUDA, unless
    ``enforce_eager``, steps whose requests all decode replay CUDA graphs (the verify forward of
    ``k + 1`` tokens per request and the MTP drafts:
    :class:`~hisparse.worker.cuda_graph.SpecGraphs`), other steps run eagerly. It needs
    ``hot_buffer_size >= (k + 1) * index_topk`` outside gpu-only mode (the default grows
    to that), so a verify group's union of selections always fits.
    ``hot_policy``: ``"score"`` (default: evict the hot row with the lowest last indexer rank;
    measured on the H200 with a real trace, 11% fewer demand misses than LRU at the same step
    time), ``"lru"`` or ``"score+prefetch"`` (issue 15); with
    prefetch, up to ``hot_prefetch_rows`` (default ``max(1, index_topk // 64)``) band rows per
    (layer, request) step are copied into the hot buffer on a side stream, off the critical path.
    ``gc_freeze`` (default on): before the step after requests are added, the engine runs
    ``gc.collect()`` then ``gc.freeze()`` so the cyclic collector never walks their
    context-length token lists again (a full collection over 256 x 32k-token requests stalled
    a step for 170-320 ms); an idle engine runs one full pass once the frozen set has doubled,
    and :meth:`shutdown` unfreezes. Process-wide: objects alive at a freeze are freed by
    reference counting only (cycles among them wait for a full pass or the shutdown). See
    :class:`~hisparse.engine.core.RequestFreezer`.
    ``kv_role``: prefill/decode disaggregation over NIXL (:mod:`hisparse.engine.disagg`;
    ``pip install --no-deps nixl-cu13==1.5.1``): ``"prefill"`` holds a ``do_remote_decode``
    request's prompt KV for a decode instance (``kv_hold_timeout_s``) and returns
    ``RequestOutput.kv_transfer_params``; ``"decode"`` pulls the KV of requests whose
    ``SamplingParams.kv_transfer_params`` carry them (``kv_load_timeout_s``; a failed load
    recomputes the prompt, or fails the request with ``kv_load_failure="fail"``).
    ``kv_host`` / ``kv_port``: this instance's KV handshake server (default: a free port).
    Needs a host tier (not ``gpu-only``) and ``tensor_parallel_size=1``.
    """

    def __init__(self, model: str, device: str | None = None, dtype: str | None = None,
                 block_size: int = 64, num_gpu_blocks: int | None = None,
                 host_pool_gib: float | str = 4.0, hisparse: bool | str | None = None,
                 hot_buffer_size: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 num_indexer_blocks: int | None = None, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.9, watermark_blocks: int | None = None,
                 load_format: str = "auto",
                 host_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                 enforce_eager: bool = False, mode: Mode | str | None = None,
                 runner_cls=None, async_scheduling: bool = True, kv_cache_dtype: str = "auto",
                 hot_policy: str = "score", tensor_parallel_size: int = 1,
                 num_speculative_tokens: int = 0, staging_rows: int | None = None,
                 hot_prefetch_rows: int | None = None, gc_freeze: bool = True,
                 kv_role: str | None = None, kv_host: str = "127.0.0.1",
                 kv_port: int | None = None, kv_load_failure: str = "recompute",
                 kv_load_timeout_s: float = 30.0, kv_hold_timeout_s: float = 120.0):
        # ---- 1. arguments alone (nothing read from disk yet)
        mode = resolve_mode(mode, hisparse)
        check_disagg_args(kv_role, kv_host, kv_port, kv_load_failure, kv_load_timeout_s,
                          kv_hold_timeout_s)
        if kv_role is not None and mode == Mode.GPU_ONLY:
            raise ValueError(f"kv_role={kv_role!r} needs a host tier: mode 'hisparse' or "
                             f"'always-host', not 'gpu-only'")
        if kv_role is not None and tensor_parallel_size > 1:
            raise ValueError(f"kv_role={kv_role!r} is not supported with "
                             f"tensor_parallel_size > 1 yet (only rank 0's caches are "
                             f"registered)")
        self.disagg = None
        if hot_policy not in ("lru", "score", "score+prefetch"):
            raise ValueError(f"hot_policy must be 'lru', 'score' or 'score+prefetch', "
                             f"got {hot_policy!r}")
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a checkpoint directory path, got {model!r}")
        model = os.fspath(model)
        if not os.path.isdir(model):
            raise ValueError(f"model: no such checkpoint directory {model!r}")
        if dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
        _check_int("block_size", block_size)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        _check_int("num_gpu_blocks", num_gpu_blocks, optional=True)
        _check_int("hot_buffer_size", hot_buffer_size, optional=True)
        _check_int("max_model_len", max_model_len, minimum=2, optional=True)
        _check_int("max_num_seqs", max_num_seqs)
        _check_int("max_num_batched_tokens", max_num_batched_tokens)
        _check_int("num_indexer_blocks", num_indexer_blocks, optional=True)
        _check_int("watermark_blocks", watermark_blocks, minimum=0, optional=True)
        _check_int("staging_rows", staging_rows, minimum=1, optional=True)
        _check_int("hot_prefetch_rows", hot_prefetch_rows, minimum=0, optional=True)
        _check_bool("enable_prefix_caching", enable_prefix_caching)
        _check_bool("enforce_eager", enforce_eager)
        _check_bool("async_scheduling", async_scheduling)
        _check_bool("gc_freeze", gc_freeze)
        _check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        if num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {num_speculative_tokens}")
        if num_speculative_tokens >= block_size:
            raise ValueError(f"num_speculative_tokens ({num_speculative_tokens}) must be < "
                             f"block_size ({block_size})")
        _check_real("gpu_memory_utilization", gpu_memory_utilization, 0.0, 1.0)
        if mode != Mode.GPU_ONLY and host_pool_gib != "auto":
            _check_real("host_pool_gib", host_pool_gib, 0.0, math.inf)
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        _check_int("tensor_parallel_size", tensor_parallel_size)
        if num_speculative_tokens and tensor_parallel_size > 1:
            raise ValueError("num_speculative_tokens > 0 is not supported with "
                             "tensor_parallel_size > 1 yet (the TP workers run the plain step)")
        self.tensor_parallel_size = tp = tensor_parallel_size
        self._tp = None
        self._tp_finalizer = None
        self._fault: BaseException | None = None
        self.device = _parse_device(device)
        if tp > 1 and self.device.type == "cuda":
            first = self.device.index or 0
            if first + tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={tp} needs CUDA devices {first}.."
                                 f"{first + tp - 1}; only {torch.cuda.device_count()} exist")

        # ---- 2. the model's config.json, then every size (still nothing loaded)
        mc = load_config(model)
        self.model_config = mc
        if tp > 1:
            from hisparse.models.tp import check_tp_divisible
            check_tp_divisible(mc, tp)
            enforce_eager = True    # collectives inside captured graphs: not done yet
        self.max_model_len = max_model_len or min(mc.max_position_embeddings, 16384)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        from hisparse.models.config import parse_dtype
        k_spec = num_speculative_tokens
        if k_spec and mc.num_nextn_predict_layers < 1:
            raise ValueError(f"num_speculative_tokens={k_spec} needs MTP layers, but the "
                             f"checkpoint's config has num_nextn_predict_layers="
                             f"{mc.num_nextn_predict_layers}")
        if k_spec and mode != Mode.GPU_ONLY:
            # A verify group's union of selections is at most (k + 1) * index_topk rows: a hot
            # buffer that large can never overflow (the resolver would fail the step).
            need = (k_spec + 1) * mc.index_topk
            if hot_buffer_size is None:
                hot_buffer_size = max(need, 2 * mc.index_topk)
            elif hot_buffer_size < need:
                raise ValueError(f"hot_buffer_size ({hot_buffer_size}) must be >= "
                                 f"(num_speculative_tokens + 1) * index_topk = {need}: a "
                                 f"verify step resolves the union of its tokens' selections")
        compute_dtype = parse_dtype(dtype) if dtype is not None else mc.dtype
        if kv_cache_dtype == "auto":
            kv_cache_dtype = auto_kv_cache_dtype(self.device, compute_dtype, mc, block_size)
        n_cache_layers = mc.num_layers + (1 if k_spec else 0)   # + the MTP layer's KV
        geo = CacheGeometry(num_layers=n_cache_layers, row_dim=mc.kv_row_dim,
                            indexer_layers=tuple(l for l in range(n_cache_layers)
                                                 if mc.layer_has_indexer(l)),
                            index_head_dim=mc.index_head_dim,
                            dtype=compute_dtype,
                            kv_cache_dtype=kv_cache_dtype, rope_dim=mc.qk_rope_head_dim)
        pages = cdiv(self.max_model_len, block_size)
        # Both GPU pools unset on CUDA: split the free memory after the weights by the planner
        # (below); until then the largest indexer cache validates the arguments.
        auto_split = num_gpu_blocks is None and num_indexer_blocks is None
        if num_indexer_blocks is None:
            num_indexer_blocks = max_num_seqs * pages
        num_host_blocks = 0
        if mode != Mode.GPU_ONLY:
            if host_pool_gib == "auto" and host_buffers is not None:
                host_pool_gib = sum(t.numel() * t.element_size() for t in host_buffers) / (1 << 30)
            elif host_pool_gib == "auto":
                host_pool_gib = auto_host_pool_bytes(self.device.type == "cuda") / (1 << 30)
                logger.info("host_pool_gib='auto': %.1f GiB", host_pool_gib)
            num_host_blocks = self._host_blocks(host_pool_gib, host_buffers, geo, block_size,
                                                pages)
        kv_args = dict(block_size=block_size, num_host_blocks=num_host_blocks,
                       num_indexer_blocks=num_indexer_blocks, max_model_len=self.max_model_len,
                       index_topk=mc.index_topk, hot_buffer_size=hot_buffer_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       mode=mode, enable_prefix_caching=enable_prefix_caching,
                       watermark_blocks=watermark_blocks, staging_rows=staging_rows,
                       hot_prefetch_rows=hot_prefetch_rows)
        # Validates everything but the GPU pool size; gives the smallest workable pool.
        probe = KVCacheConfig(num_gpu_blocks=max(num_gpu_blocks or 0, 1 << 40), **kv_args)
        min_gpu = probe.min_gpu_blocks
        self._staging_rows_probe = probe.num_staging_rows
        if num_gpu_blocks is not None:
            KVCacheConfig(num_gpu_blocks=num_gpu_blocks, **kv_args)  # names the limit

        # ---- 3. weights, then the caches
        if tp > 1:
            torch.manual_seed(_TP_SEED)     # load_format="dummy": the same weights on every rank
        self.model, _ = load_model(model, dtype=dtype, device=self.device,
                                   num_mtp_layers=1 if k_spec else 0,
                                   load_format=load_format, config=mc)
        if tp > 1:
            from hisparse.models.tp import shard_model_
            shard_model_(self.model, 0, tp)
        if num_gpu_blocks is None:
            from hisparse.engine.logits import LogitsState
            reserve = LogitsState.nbytes(max_num_seqs, mc.vocab_size)   # penalty token state
            # the speculative steps' static buffers exist captured or not (bucketed eager)
            if k_spec and self.device.type == "cuda" and self.model.cuda_graph_safe:
                from hisparse.worker.cuda_graph import spec_graph_bytes
                reserve += spec_graph_bytes(max_num_seqs, k_spec, mc.vocab_size, mc.hidden_size)
            budget = self._gpu_kv_budget(geo, gpu_memory_utilization, reserve)
            if budget is None:      # CPU: room for max_num_seqs full-length requests
                num_gpu_blocks = max(max_num_seqs * pages, min_gpu)
            elif auto_split:
                num_gpu_blocks, num_indexer_blocks = self._split_gpu_budget(
                    geo, budget, mode, num_host_blocks, kv_args, min_gpu)
                kv_args["num_indexer_blocks"] = num_indexer_blocks
            else:
                num_gpu_blocks = self._default_gpu_blocks(geo, block_size, num_indexer_blocks,
                                                          max_num_seqs * pages, min_gpu,
                                                          gpu_memory_utilization, reserve)
        self.kv_config = KVCacheConfig(num_gpu_blocks=num_gpu_blocks, **kv_args)
        if tp > 1:
            host_buffers = self._start_tp(geo, host_buffers, runner_cls, model, dtype,
                                          load_format, hot_policy)
        try:
            self.caches = self._allocate_caches(geo, host_buffers, host_pool_gib)
            self.caches.set_hot_policy(hot_policy)
            # k is passed only when set: a runner_cls without the argument still serves k = 0
            spec_kw = {"num_speculative_tokens": k_spec} if k_spec else {}
            self.runner = (runner_cls or ModelRunner)(self.model, self.caches, mc.index_topk,
                                                      mc.kv_lora_rank,
                                                      enforce_eager=enforce_eager, **spec_kw)
            if tp > 1:
                self._join_tp()
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(self.kv_config)
        self.core = EngineCore(self.scheduler, self.runner, frozenset(mc.eos_token_ids),
                               async_scheduling, num_speculative_tokens=k_spec,
                               gc_freeze=gc_freeze, vocab_size=mc.vocab_size)
        if kv_role is not None:
            try:
                self.disagg = Disaggregation(kv_role, self.scheduler, self.caches, mc, kv_host,
                                             kv_port, kv_load_failure, kv_load_timeout_s,
                                             kv_hold_timeout_s)
            except BaseException:
                self.shutdown()
                raise
            if kv_role == "decode":
                self.core.kv_transfer = self.disagg.agent
                self.core.recompute_failed_loads = self.disagg.recompute
        self.tokenizer = self._load_tokenizer(model)
        self._requests: dict[str, Request] = {}
        self._errors: dict[str, str] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}   # by request id
        self._ids = itertools.count()
        # Outputs of requests that finished inside generate() but were not its own: the next
        # step() returns them.
        self._stashed: list[RequestOutput] = []
        self.model_dir = model
        if logger.isEnabledFor(logging.INFO):
            self._log_summary(geo)

    # ------------------------------------------------------------------ tensor parallelism
    def _start_tp(self, geo: CacheGeometry, host_buffers, runner_cls, model: str, dtype,
                  load_format: str, hot_policy: str):
        """Allocate the node's one shared host pool, write its nonce, spawn ranks 1..N-1
        (they load their shards while this rank builds its caches). Returns the pool."""
        from hisparse.worker.tp import TPWorkers, shared_host_buffers, write_nonce

        cfg = self.kv_config
        rows = cfg.num_host_blocks * cfg.block_size if cfg.uses_host else 0
        if host_buffers is None:
            try:
                host_buffers = shared_host_buffers(
                    (geo.num_layers, rows, geo.row_width),
                    geo.indexer_shape(rows // cfg.block_size, cfg.block_size), geo.storage_dtype,
                    self.device.type == "cuda")
            except RuntimeError as e:
                raise EngineStartupError(
                    f"could not allocate the shared host pool ({cfg.num_host_blocks} blocks): "
                    f"lower host_pool_gib ({e})") from e
        elif not all(t.is_shared() for t in host_buffers):
            raise ValueError("host_buffers must live in shared memory (tensor.share_memory_()) "
                             "when tensor_parallel_size > 1")
        write_nonce(host_buffers[0])
        spec = dict(world=self.tensor_parallel_size, device=self.device, model=model,
                    dtype=dtype, load_format=load_format, model_config=self.model_config,
                    kv_config=cfg, geometry=geo, hot_policy=hot_policy, runner_cls=runner_cls,
                    seed=_TP_SEED,
                    threads=torch.get_num_threads() if self.device.type == "cpu" else None)
        self._tp = TPWorkers(spec, host_buffers)
        self._tp_finalizer = weakref.finalize(self, self._tp.close)
        return host_buffers

    def _join_tp(self) -> None:
        """Start-up check of every rank against this one, then wrap the runner."""
        import torch.distributed as dist

        from hisparse.models.tp import set_tp_group
        from hisparse.worker.tp import TPRunner, fingerprint

        self._tp.wait_ready(fingerprint(self.model, self.model_config, self.kv_config,
                                        self.caches.geo, self.caches.host,
                                        self.caches.host_indexer, self.tensor_parallel_size))
        set_tp_group(self.model, dist.group.WORLD)
        self.runner = TPRunner(self.runner, self._tp)

    def tp_worker_info(self, digest: bool = False) -> list[dict]:
        """Ranks 1..N-1: hot hits / misses, host pool size and sharing, optionally a SHA-1 of
        the host pool bytes each rank sees (tests and diagnostics). ``[]`` without TP."""
        self._check_alive()
        return self._tp.info(digest) if self._tp is not None else []

    def shutdown(self) -> None:
        """Stop the engine and free its memory: tensor-parallel workers stop, the model, caches
        and captured graphs are released (GPU memory returns to the allocator's cache, which
        is emptied), and the heap frozen for the engine's requests is unfrozen so that nothing
        of the engine outlives this call. Idempotent; every later call raises
        :class:`EngineDeadError`. ``with LLM(...) as llm:`` calls it on exit."""
        if hasattr(self, "runner") and hasattr(self.runner, "drain"):
            try:
                self.runner.drain()    # mirror copies still in flight write the pools
            except Exception:  # noqa: BLE001  (a faulted device: nothing more to wait for)
                pass
        if hasattr(self, "core"):
            self.core.freezer.release()
        if getattr(self, "disagg", None) is not None:
            self.disagg.close()
            self.disagg = None
        if self._tp is not None and not self._tp.closed:
            self._tp.close()
        if self._fault is None:
            self._fault = RuntimeError("the engine was shut down")
        for name in ("core", "scheduler", "runner", "caches", "model", "_requests"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _log_summary(self, geo: CacheGeometry) -> None:
        """One start-up summary: the model, the pools in tokens and bytes, mode, graphs."""
        cfg, mc, bs = self.kv_config, self.model_config, self.kv_config.block_size
        graphs = self.runner.graphs
        spec_graphs = getattr(self.runner, "spec_graphs", None)
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
                    self.model_dir, mc.num_layers, mc.vocab_size, mc.index_topk,
                    str(geo.dtype).removeprefix("torch."), geo.kv_cache_dtype, self.device)
        logger.info(
            "mode %s | GPU pool %d blocks x %d = %d tokens (%s) | host pool %d tokens "
            "(%s) | indexer %d tokens | hot buffer %d rows/layer/request | "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d | CUDA graphs %s",
            cfg.mode, cfg.num_gpu_blocks, bs, cfg.num_gpu_blocks * bs,
            size(cfg.num_gpu_blocks * geo.gpu_bytes_per_block(bs)), cfg.num_host_blocks * bs,
            size(cfg.num_host_blocks * geo.bytes_per_token * bs), cfg.num_indexer_blocks * bs,
            cfg.hot_buffer_size, self.max_model_len, cfg.max_num_seqs,
            cfg.max_num_batched_tokens, buckets)
        try:
            plan = self.capacity()
            logger.info("capacity at %d tokens/request: %s", self.max_model_len, ", ".join(
                f"{m} {mp.max_running} running ({mp.bound_by})" for m, mp in plan.modes.items()))
        except Exception as e:  # noqa: BLE001 - the summary must not stop start-up
            logger.debug("capacity plan unavailable: %s", e)

    # ------------------------------------------------------------------ set-up helpers
    def _host_blocks(self, host_pool_gib: float, host_buffers, geo: CacheGeometry,
                     block_size: int, pages: int) -> int:
        per_block = geo.bytes_per_token * block_size
        avail = available_host_memory_bytes()
        if host_buffers is None and host_pool_gib * (1 << 30) > avail:
            raise ValueError(f"host_pool_gib ({host_pool_gib}) exceeds available host memory "
                             f"({avail / (1 << 30):.1f} GiB)")
        blocks = host_blocks_for_gib(host_pool_gib, per_block)
        if blocks < pages:
            need = pages * per_block / (1 << 30)
            raise ValueError(
                f"host_pool_gib ({host_pool_gib}) holds {blocks} blocks of {block_size} tokens; "
                f"one max_model_len={self.max_model_len} request needs {pages} "
                f"(host_pool_gib >= {need:.3g}): raise host_pool_gib or lower max_model_len")
        return blocks

    def _gpu_kv_budget(self, geo: CacheGeometry, utilization: float, reserve: int) -> int | None:
        """Bytes for the arena plus the indexer cache: free device memory x ``utilization``
        less the staging area and ``reserve``; ``None`` without CUDA (CPU pools are sized by
        ``max_num_seqs``)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * utilization - self._staging_rows_probe * geo.row_bytes - reserve)

    def _split_gpu_budget(self, geo: CacheGeometry, budget: int, mode: Mode,
                          num_host_blocks: int, kv_args: dict, min_gpu: int) -> tuple[int, int]:
        """``(num_gpu_blocks, num_indexer_blocks)`` of ``budget`` bytes for ``mode`` (the
        capacity planner's split, :func:`hisparse.engine.capacity.split_gpu_budget`): the
        indexer cache holds the requests the mode can run -- bounded by the host pool, the hot
        buffers / GPU pages or ``max_num_seqs`` -- and the arena gets the rest, so neither pool
        idles while the other binds."""
        from hisparse.engine.capacity import split_gpu_budget

        bs, pages = kv_args["block_size"], cdiv(self.max_model_len, kv_args["block_size"])
        n_gpu, n_idx = split_gpu_budget(
            self._planner_geometry(geo), budget, mode=str(mode), context=self.max_model_len,
            block_size=bs, hot_buffer_size=kv_args["hot_buffer_size"],
            max_num_seqs=kv_args["max_num_seqs"], kv_cache_dtype=self._planner_dtype(geo),
            num_host_blocks=num_host_blocks if mode != Mode.GPU_ONLY else None,
            watermark_blocks=kv_args["watermark_blocks"])
        n_idx = max(n_idx, pages)
        n_gpu = min(n_gpu, max(kv_args["max_num_seqs"] * pages, min_gpu))
        if n_gpu < min_gpu:
            raise ValueError(
                f"free GPU memory for the KV cache ({budget / (1 << 30):.2f} GiB after the "
                f"weights) holds {max(n_gpu, 0)} KV blocks next to an indexer cache of {n_idx} "
                f"blocks; the engine needs num_gpu_blocks >= {min_gpu}: lower max_model_len or "
                "raise gpu_memory_utilization")
        return n_gpu, n_idx

    @staticmethod
    def _planner_dtype(geo: CacheGeometry) -> str:
        return "fp8" if geo.fp8 else str(geo.dtype).removeprefix("torch.")

    def _planner_geometry(self, geo: CacheGeometry):
        """The planner's view of the engine's caches (an MTP layer's KV included)."""
        from hisparse.engine.capacity import geometry_from_config

        mg = geometry_from_config(self.model_config)
        return dataclasses.replace(mg, num_layers=geo.num_layers,
                                   num_indexer_layers=len(geo.indexer_layers))

    def _default_gpu_blocks(self, geo: CacheGeometry, block_size: int, num_indexer_blocks: int,
                            unconstrained: int, min_gpu: int, utilization: float,
                            reserve: int = 0) -> int:
        """KV blocks that fit the free memory after the indexer cache, the staging area and
        ``reserve`` bytes (the speculative CUDA graphs' buffers and pool)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = (free * utilization - num_indexer_blocks * geo.indexer_bytes_per_block(block_size)
                  - self._staging_rows_probe * geo.row_bytes - reserve)
        blocks = min(int(budget // geo.gpu_bytes_per_block(block_size)), unconstrained)
        if blocks < min_gpu:
            raise ValueError(
                f"free GPU memory ({free / (1 << 30):.2f} GiB x gpu_memory_utilization="
                f"{utilization}) holds {max(blocks, 0)} KV blocks after the indexer cache "
                f"(num_indexer_blocks={num_indexer_blocks}); the engine needs num_gpu_blocks >= "
                f"{min_gpu}: lower max_model_len / max_num_seqs / num_indexer_blocks or raise "
                "gpu_memory_utilization")
        return blocks

    def _allocate_caches(self, geo: CacheGeometry, host_buffers, host_pool_gib: float
                         ) -> KVCaches:
        """Allocate the tiers; a failure names the pool to shrink and leaves nothing behind."""
        cfg = self.kv_config
        try:
            return KVCaches(cfg, geo, self.device, host_buffers)
        except RuntimeError as e:   # torch.OutOfMemoryError included
            gib = 1 << 30
            arena = cfg.num_gpu_blocks * geo.gpu_bytes_per_block(cfg.block_size)
            idx = cfg.num_indexer_blocks * geo.indexer_bytes_per_block(cfg.block_size)
            self._release_partial()
            gpu_short = isinstance(e, torch.OutOfMemoryError) and (
                self.device.type != "cuda"
                or torch.cuda.mem_get_info(self.device)[0] < arena + idx)
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
                f"could not allocate the {'pinned ' if self.device.type == 'cuda' else ''}host "
                f"pool (host_pool_gib={host_pool_gib}, {cfg.num_host_blocks} blocks); "
                f"{avail:.1f} GiB host memory available: lower host_pool_gib ({e})") from e

    def _release_partial(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def _load_tokenizer(path: str):
        if not any(os.path.exists(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer in the model directory; "
                                 "pass {'prompt_token_ids': [...]} instead")
            try:
                ids = list(self.tokenizer.encode(prompt))
            except Exception as e:  # noqa: BLE001 - the tokenizer's own error, reported
                raise ValueError(f"prompt: the tokenizer failed: {e}") from e
            return prompt, [int(t) for t in ids]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            raw = prompt["prompt_token_ids"]
            if hasattr(raw, "tolist"):
                raw = raw.tolist()
            if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {raw!r}")
            raw = list(raw)
            bad = [t for t in raw if not _is_int(t)]
            if bad:
                raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is not an integer")
            return None, [int(t) for t in raw]
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    def _check_request(self, ids: list[int], params) -> SamplingParams:
        """Validate one request; return the engine's own validated copy of its params."""
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: length {len(ids)} must be < max_model_len "
                             f"({self.max_model_len})")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params = dataclasses.replace(params)   # re-validates fields mutated after construction
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        if params.logprobs is not None and self.core.num_speculative_tokens:
            raise ValueError("logprobs: not supported with num_speculative_tokens > 0 (the "
                             "verify step does not report them yet)")
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        words = list(params.bad_words_token_ids or [])
        bad = [t for w in words for t in w if t >= vocab]
        if bad:
            raise ValueError(f"bad_words_token_ids: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        if params.bad_words:
            words += self._bad_word_ids(params.bad_words)
            params = dataclasses.replace(params, bad_words_token_ids=words, bad_words=None)
        if params.kv_transfer_params:
            # the prefill samples the first token without the grammar, and the decode side
            # adds it without its logprobs entry: refused until both carry across
            for name, given in (("structured_outputs", params.structured_outputs is not None),
                                ("logprobs", params.logprobs is not None)):
                if given:
                    raise ValueError(f"{name}: not supported with kv_transfer_params "
                                     "(prefill/decode disaggregation)")
        if params.structured_outputs is not None:
            if self.core.num_speculative_tokens:
                raise ValueError("structured_outputs: not supported with "
                                 "num_speculative_tokens > 0 (drafts are not run through the "
                                 "grammar)")
            self._grammar("structured_outputs").compile(params.structured_outputs)
        return params

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone and after a space (a word-start
        token often differs), without special tokens; the token sequences, deduplicated."""
        if self.tokenizer is None:
            raise ValueError("bad_words: needs a tokenizer in the model directory; use "
                             "bad_words_token_ids")
        vocab = self.model_config.vocab_size
        out: list[list[int]] = []
        for w in words:
            for text in (w, " " + w.lstrip()):
                ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
                if ids and ids not in out and all(t < vocab for t in ids):
                    out.append(ids)
        # same limits as token-id words (SamplingParams names them)
        return SamplingParams(bad_words_token_ids=out or None).bad_words_token_ids or []

    def _grammar(self, field: str):
        """The structured-output backend (built at the first constrained request: xgrammar's
        tokenizer info over the engine's tokenizer)."""
        if self.core.grammar is None:
            if self.tokenizer is None:
                raise ValueError(f"{field}: structured output needs a tokenizer in the model "
                                 "directory")
            try:
                from hisparse.engine.structured import GrammarBackend
            except ImportError as e:
                raise ValueError(f"{field}: structured output needs xgrammar (pip install "
                                 f"'hisparse[structured]'): {e}") from None
            self.core.grammar = GrammarBackend(
                self.tokenizer, self.model_config.vocab_size,
                sorted(self.model_config.eos_token_ids), self.scheduler.cfg.max_num_seqs,
                self.device)
        return self.core.grammar

    def _check_id(self, request_id, taken: set[str] = frozenset()) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests or request_id in taken:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _new_id(self, taken: set[str] = frozenset()) -> str:
        while True:  # auto ids skip ids the caller chose
            req_id = f"req-{next(self._ids)}"
            if req_id not in self._requests and req_id not in taken:
                return req_id

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request, all or nothing: a ValueError leaves nothing queued."""
        self._check_alive()
        text, ids = self._prompt_ids(prompt)
        params = self._check_request(ids, params)
        if request_id is None:
            request_id = self._new_id()
        else:
            self._check_id(request_id)
        self._enqueue(text, ids, params, request_id)
        return request_id

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams,
                 req_id: str) -> None:
        remote, hold = None, False
        if params.kv_transfer_params:
            if self.disagg is None:
                raise ValueError("kv_transfer_params need an instance started with kv_role "
                                 "'prefill' or 'decode'")
            params, remote, hold = self.disagg.prepare(ids, params)
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        req = Request(req_id, ids, max_tokens=params.max_tokens, max_len=max_len,
                      sampling=params, stop_token_ids=frozenset(params.stop_token_ids),
                      prompt_text=text)
        if params.structured_outputs is not None:    # compiled in _check_request: a cache hit
            backend = self._grammar("structured_outputs")
            req.grammar = backend.matcher(backend.compile(params.structured_outputs))
        if remote is not None:      # its first token comes from the prefill instance
            req.remote_prefill = remote
            req.token_ids.append(remote.first_token)
        req.hold_for_remote_decode = hold
        self.scheduler.add(req)
        self._requests[req_id] = req
        self.core.request_added()

    def abort(self, request_id: str) -> None:
        self._check_open()
        if request_id in self.scheduler.loading:
            self.core.kv_transfer.cancel(request_id)
        if self.scheduler.abort(request_id) is not None:
            self._forget(request_id)
            self._detokenizers.pop(request_id, None)   # no last output: its state goes here

    def _forget(self, req_id: str) -> Request:
        return self._requests.pop(req_id)

    def capture_cuda_graphs(self) -> None:
        """Capture every decode batch bucket now instead of on first use (keeps capture time out
        of measurements): the plain decode graphs, or with ``num_speculative_tokens`` the
        speculative steps' verify and draft graphs. No-op when decode is not captured (CPU,
        eager, models whose forward syncs with the host)."""
        self._check_open()
        graphs = self.runner.graphs or getattr(self.runner, "spec_graphs", None)
        if graphs is not None and graphs.capture:
            variants = (False,) if self.kv_config.mode == Mode.GPU_ONLY else (False, True)
            graphs.capture_all(variants)

    def has_unfinished_requests(self) -> bool:
        return hasattr(self, "scheduler") and (
            self.scheduler.has_unfinished
            or (self.disagg is not None and bool(self.disagg.handoffs)))

    def service_kv_transfer(self) -> None:
        """Prefill instance: release held prompts the decode side read or that timed out
        (also done by every step; a server calls it while idle)."""
        self._check_alive()
        if self.disagg is not None:
            self.disagg.service()

    # ------------------------------------------------------------------ stepping
    def _check_open(self) -> None:
        """Raise if :meth:`shutdown` ran (the engine's state is gone; a faulted engine's
        stats and aborts still work)."""
        if not hasattr(self, "core"):
            raise EngineDeadError("the engine was shut down; create a new LLM")

    def _check_alive(self) -> None:
        if self._fault is not None:
            raise EngineDeadError(f"the engine stopped after an engine-wide fault "
                                  f"({type(self._fault).__name__}: {self._fault}); create a "
                                  "new LLM") from self._fault

    def _die(self, exc: BaseException, where: str) -> EngineDeadError:
        self._fault = exc
        self.core.freezer.idle()   # a dead engine keeps its requests: stop freezing for them
        if self._tp is not None:
            self._tp.close()       # no rank is left waiting in a collective
        return EngineDeadError(f"engine-wide fault in {where}: {type(exc).__name__}: {exc}; "
                               "the engine is stopped")

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got a token in it (its
        tokens so far; ``finished`` once it is done) and for every request that failed. ``[]``
        when idle.

        With ``async_scheduling`` a call launches a step and returns the results of the one
        before it. Also returns outputs of requests added with :meth:`add_request` that
        :meth:`generate` stepped.
        """
        self._check_alive()
        if self._stashed:
            stashed, self._stashed = self._stashed, []
            return stashed
        return self._step_own(progress=True)

    def _step_own(self, progress: bool) -> list[RequestOutput]:
        """One step; outputs of finished requests, and of the others that got a token when
        ``progress`` (streaming)."""
        self._check_alive()
        try:
            update, errors = self.core.step()
        except Exception as e:
            raise self._die(e, "the engine step") from e
        self._errors.update(errors)
        outputs = []
        if progress:
            outputs = [self._output(req) for req in update.progressed if not req.finished]
        disagg = self.disagg
        outputs += [self._output(self._forget(req.req_id))
                    for req in update.finished + update.failed
                    if disagg is None or not disagg.defer(req)]
        if not self.scheduler.has_unfinished:
            self._release_finished()
        if disagg is not None:
            outputs += [self._output(self._forget(req.req_id), params)
                        for req, params in disagg.ready()]
            disagg.service()
        return outputs

    def _release_finished(self) -> None:
        """No request left: wait for the step and the mirrors in flight, so finished requests'
        KV is back in the pools."""
        try:
            self.core.release()
        except Exception as e:
            raise self._die(e, "releasing finished requests") from e

    def _output(self, req: Request, kv_transfer_params: dict | None = None) -> RequestOutput:
        ids = req.token_ids[len(req.prompt_token_ids):]     # one copy (a new list)
        error = self._errors.pop(req.req_id, None)
        reason = req.finish_reason
        text = None
        if self.tokenizer is not None:
            try:
                # the last output uses the same detokenizer: every text extends the previous one
                detok = (self._detokenizers.pop(req.req_id, None) if req.finished
                         else self._detokenizers.get(req.req_id))
                if detok is None:
                    detok = IncrementalDetokenizer(
                        self.tokenizer, getattr(req.sampling, "skip_special_tokens", True))
                    if not req.finished:
                        self._detokenizers[req.req_id] = detok
                text = detok.update(ids, final=req.finished)
            except Exception as e:  # noqa: BLE001 - one request's failure
                reason, error = "error", f"detokenizing failed: {type(e).__name__}: {e}"
                if not req.finished:    # stop it now: it would fail again at every step
                    self.scheduler.finish(req.req_id, "error")
                    self._forget(req.req_id)
                    self._detokenizers.pop(req.req_id, None)
        # The prompt list is shared, not copied: step() builds an output per running request
        # per step, and copying 147 prompts of 32k tokens cost 27-34 ms per step (CPU box).
        return RequestOutput(req.req_id, req.prompt_text, req.prompt_token_ids,
                             [CompletionOutput(0, text, ids, reason, error,
                                               None if req.logprobs is None
                                               else req.logprobs[:len(ids)])],
                             finished=req.finished, kv_transfer_params=kv_transfer_params)

    def generate(self, prompts: Sequence, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        Every prompt is validated before any is queued: a bad one raises ValueError and leaves
        nothing of the batch queued. A request that fails while running comes back with
        ``finish_reason="error"``. Finished requests' KV is released before this returns.
        """
        self._check_alive()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence):
            params = list(sampling_params)
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        prepared, taken = [], set()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, ids = self._prompt_ids(prompt)
                checked = self._check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            req_id = self._new_id(taken)
            taken.add(req_id)
            prepared.append((text, ids, checked, req_id))
        queued: list[str] = []
        try:
            for item in prepared:
                self._enqueue(*item)
                queued.append(item[3])
            return self._run_until_done(queued, use_tqdm)
        except BaseException:
            if self._fault is None:
                for req_id in queued:
                    if req_id in self._requests:
                        self.abort(req_id)
            raise

    def _run_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while wanted - done.keys():
                for out in self._step_own(progress=False):
                    if out.request_id not in wanted:
                        self._stashed.append(out)
                    elif out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        if not self.scheduler.has_unfinished:
            self._release_finished()
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        self._check_open()
        kv = self.scheduler.kv
        hits, misses = self.runner.hot_counters()
        prefetched, prefetch_hits = (int(x) for x in self.caches.counters[3:5].tolist())
        row_bytes = self.runner.row_bytes
        return {
            "mode": str(self.kv_config.mode),
            "kv_cache_dtype": self.caches.geo.kv_cache_dtype,
            "num_gpu_blocks": self.kv_config.num_gpu_blocks,
            "num_host_blocks": self.kv_config.num_host_blocks,
            "spilled_pages": kv.stats.spilled_pages,
            "lost_pages": kv.stats.lost_pages,
            "restored_pages": kv.stats.restored_pages,
            "host_read_switches": kv.stats.host_read_switches,
            "hot_hits": hits,
            "hot_misses": misses,
            "hot_demand_misses": misses,
            "hot_prefetched": prefetched,
            "hot_prefetch_hits": prefetch_hits,
            "h2d_bytes": self.runner.h2d_bytes + (misses + prefetched) * row_bytes,
            "d2h_bytes": self.runner.d2h_bytes,
            "prefix_hit_tokens": kv.stats.prefix_hit_tokens,
            "host_prefix_hit_tokens": kv.stats.host_prefix_hit_tokens,
            "num_preempted": self.scheduler.num_preempted,
            "peak_running": self.scheduler.peak_running,
            "free_gpu_blocks": kv.gpu_pool.num_free,
            "free_host_blocks": kv.host_pool.num_free if kv.host_pool is not None else 0,
            "free_indexer_blocks": kv.indexer_pool.num_free,
            # staged prefill (issue 14): host-only history rows a prefill chunk read through the
            # staging area (zero-copy from the host pool), and their bytes (every layer)
            "staged_rows": self.runner.staged_rows,
            "staged_bytes": self.runner.staged_rows * row_bytes,
            "staged_chunks": kv.stats.staged_chunks,
            "num_speculative_tokens": self.core.num_speculative_tokens,
            **self.core.spec_stats.as_dict(),
            **self._kv_transfer_stats(),
        }

    def _kv_transfer_stats(self) -> dict:
        """``kv_transfer_*`` counters of a disaggregated instance (``{}`` otherwise)."""
        if self.disagg is None:
            return {}
        out = {f"kv_transfer_{k}": v for k, v in self.disagg.metrics.as_dict().items()}
        out["kv_transfer_role"] = self.disagg.role
        out["kv_transfer_held_now"] = len(self.disagg.held)
        out["kv_transfer_loading_now"] = len(self.scheduler.loading)
        out["kv_transfer_remote_gpu_pages"] = self.scheduler.kv.stats.remote_gpu_pages
        out["kv_transfer_remote_host_pages"] = self.scheduler.kv.stats.remote_host_pages
        return out

    def capacity(self, context: int | None = None, **overrides):
        """Capacity plan of this engine's real pools, every mode (see
        ``hisparse.engine.capacity``); ``context`` defaults to ``max_model_len``; ``overrides``
        replace ``CapacityInputs`` fields (``hit_rate``, ``hbm_gb_s``, ...)."""
        from hisparse.engine.capacity import plan_for_llm

        self._check_open()
        return plan_for_llm(self, context, **overrides)
