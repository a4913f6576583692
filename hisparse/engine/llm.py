"""The user-facing engine, shaped like vLLM's ``LLM``.

    from hisparse import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", host_pool_gib=8)
    outs = llm.generate(["text", ...] or [{"prompt_token_ids": [...]}, ...],
                        SamplingParams(temperature=0.0, max_tokens=32))

``LLM`` is the public API and the request loop (add, step, generate, abort, stats); its parts
each have one module: arguments (:mod:`~hisparse.engine.engine_args`), pool sizes
(:mod:`~hisparse.engine.pool_sizing`), start-up and shutdown (:mod:`~hisparse.engine.startup`),
request checks (:mod:`~hisparse.engine.input_processor`), live requests
(:mod:`~hisparse.engine.request_table`) and outputs (:mod:`~hisparse.engine.outputs`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from hisparse.config import Mode
from hisparse.engine.engine_args import EngineArgs, resolve_mode
from hisparse.engine.errors import EngineDeadError, EngineStartupError
from hisparse.engine.input_processor import InputProcessor
from hisparse.engine.outputs import CompletionOutput, OutputBuilder, RequestOutput
from hisparse.engine.pool_sizing import auto_kv_cache_dtype
from hisparse.engine.request import Request
from hisparse.engine.request_table import RequestTable
from hisparse.engine.sampling import SamplingParams
from hisparse.engine.startup import EngineParts, build_engine, free_memory, log_summary, stop

# Re-exported: the engine's public names keep their ``hisparse.engine.llm`` import path.
__all__ = ["LLM", "CompletionOutput", "EngineDeadError", "EngineStartupError", "RequestOutput",
           "SamplingParams", "auto_kv_cache_dtype", "resolve_mode"]

logger = logging.getLogger("hisparse.engine")


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
        mode = resolve_mode(mode, hisparse)
        args = EngineArgs(
            model=model, device=device, dtype=dtype, block_size=block_size,
            num_gpu_blocks=num_gpu_blocks, host_pool_gib=host_pool_gib,
            hot_buffer_size=hot_buffer_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            num_indexer_blocks=num_indexer_blocks, enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization, watermark_blocks=watermark_blocks,
            load_format=load_format, host_buffers=host_buffers, enforce_eager=enforce_eager,
            mode=mode, runner_cls=runner_cls, async_scheduling=async_scheduling,
            kv_cache_dtype=kv_cache_dtype, hot_policy=hot_policy,
            tensor_parallel_size=tensor_parallel_size,
            num_speculative_tokens=num_speculative_tokens, staging_rows=staging_rows,
            hot_prefetch_rows=hot_prefetch_rows, gc_freeze=gc_freeze, kv_role=kv_role,
            kv_host=kv_host, kv_port=kv_port, kv_load_failure=kv_load_failure,
            kv_load_timeout_s=kv_load_timeout_s, kv_hold_timeout_s=kv_hold_timeout_s)
        parts = build_engine(args)
        self._adopt(parts)
        if logger.isEnabledFor(logging.INFO):
            log_summary(parts)

    def _adopt(self, parts: EngineParts) -> None:
        """Take over a started engine's parts (each becomes the attribute of its name) and set
        up the request state around them."""
        self.model_dir = parts.model_dir
        self.device = parts.device
        self.tensor_parallel_size = parts.tensor_parallel_size
        self.model_config = parts.model_config
        self.max_model_len = parts.max_model_len
        self.kv_config = parts.kv_config
        self.model = parts.model
        self.caches = parts.caches
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.core = parts.core
        self.disagg = parts.disagg
        self.switches = parts.switches
        self._gpu_kv_budget = parts.gpu_kv_budget
        self._tp = parts.tp
        self._tp_finalizer = (weakref.finalize(self, parts.tp.close)
                              if parts.tp is not None else None)
        self._fault: BaseException | None = None
        self._tokenizer = parts.tokenizer
        # the fail-safe counts already logged by stats(), by its key: each new count once
        self._faults_logged = {"topk_stalls": 0, "hot_lru_corrupt": 0}
        self._inputs = InputProcessor(parts.model_config, parts.max_model_len, parts.tokenizer,
                                      parts.core, parts.kv_config.max_num_seqs, parts.device)
        self._table = RequestTable(parts.scheduler, parts.core, parts.disagg,
                                   parts.max_model_len, self._inputs.grammar)
        self._outputs = OutputBuilder(parts.tokenizer, self._table.fail)
        # Outputs of requests that finished inside generate() but were not its own: the next
        # step() returns them.
        self._stashed: list[RequestOutput] = []

    @property
    def tokenizer(self):
        """The model directory's tokenizer (``None``: token-id prompts only). Assigning one
        makes prompts, bad words, grammars and output text use it from then on."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        if hasattr(self, "_inputs"):
            self._inputs.tokenizer = self._outputs.tokenizer = tokenizer

    @property
    def _requests(self) -> dict[str, Request]:
        """The live requests by id (the request table's map: read it, never change it)."""
        return self._table.requests

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
        stop(getattr(self, "runner", None), getattr(self, "core", None), self.disagg, self._tp)
        self.disagg = None
        if self._fault is None:
            self._fault = RuntimeError("the engine was shut down")
        for name in ("core", "scheduler", "runner", "caches", "model", "_table", "_inputs",
                     "_outputs"):
            if hasattr(self, name):
                delattr(self, name)
        free_memory(self.device)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request, all or nothing: a ValueError leaves nothing queued."""
        self._check_alive()
        text, ids, params = self._inputs.process(prompt, params)
        if request_id is None:
            request_id = self._table.new_id()
        else:
            self._table.check_id(request_id)
        self._table.enqueue(text, ids, params, request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        self._check_open()
        if self._table.abort(request_id):
            self._outputs.drop(request_id)   # no last output: its state goes here

    def capture_cuda_graphs(self) -> None:
        """Capture every decode batch bucket now instead of on first use (keeps capture time out
        of measurements): the plain decode graphs, or with ``num_speculative_tokens`` the
        speculative steps' verify and draft graphs. No-op when decode is not captured (CPU,
        eager, models whose forward syncs with the host) and with ``tensor_parallel_size > 1``
        (the ranks capture on first use, in lockstep: a capture here would run rank 0's
        collectives alone)."""
        self._check_open()
        if self.tensor_parallel_size > 1:
            return
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
        self._outputs.record_errors(errors)
        outputs, table = [], self._table
        if progress:
            outputs = [self._outputs.build(req) for req in update.progressed
                       if not req.finished]
        disagg = self.disagg
        outputs += [self._outputs.build(table.forget(req.req_id))
                    for req in update.finished + update.failed
                    if disagg is None or not disagg.defer(req)]
        if not self.scheduler.has_unfinished:
            self._release_finished()
        if disagg is not None:
            outputs += [self._outputs.build(table.forget(req.req_id), params)
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
                text, ids, checked = self._inputs.process(prompt, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            req_id = self._table.new_id(taken)
            taken.add(req_id)
            prepared.append((text, ids, checked, req_id))
        queued: list[str] = []
        try:
            for item in prepared:
                self._table.enqueue(*item)
                queued.append(item[3])
            return self._run_until_done(queued, use_tqdm)
        except BaseException:
            if self._fault is None:
                for req_id in queued:
                    if req_id in self._table:
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
    def _fault_count(self, key: str, count: int, message: str) -> int:
        """``count`` of a fail-safe that should never fire (a device counter), logged as an
        error once per new value."""
        if count > self._faults_logged[key]:
            logger.error(message, count)
            self._faults_logged[key] = count
        return count

    def stats(self) -> dict:
        self._check_open()
        kv = self.scheduler.kv
        # hot hits, hot (demand) misses, corrupt LRU entries skipped, prefetched, prefetch hits
        hits, misses, lru_corrupt, prefetched, prefetch_hits = (
            int(x) for x in self.caches.counters.tolist())
        topk_stalls = self._fault_count(
            "topk_stalls", self.runner.topk_stalls(),
            "the one-launch top-k gave up %d row barrier wait(s): those selections may not be "
            "exact (HISPARSE_TOPK=phased avoids the waits)")
        hot_lru_corrupt = self._fault_count(
            "hot_lru_corrupt", lru_corrupt,
            "the resolver skipped %d hot-buffer LRU entries out of range: the hot buffers' "
            "state was overwritten (those slots go unused; rows are loaded again)")
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
            # hisparse: requests admitted with every page on GPU and no host blocks because
            # the host pool was full (they never switch to host-read mode)
            "gpu_held_admissions": kv.stats.gpu_held_admissions,
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
            "topk_stalls": topk_stalls,
            "hot_lru_corrupt": hot_lru_corrupt,
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
        out["kv_transfer_quarantined_blocks"] = self.scheduler.kv.quarantined_blocks
        out["kv_transfer_remote_gpu_pages"] = self.scheduler.kv.stats.remote_gpu_pages
        out["kv_transfer_remote_host_pages"] = self.scheduler.kv.stats.remote_host_pages
        return out

    def capacity(self, context: int | None = None, **overrides):
        """Capacity plan of this engine's real pools, every mode (see
        ``hisparse.engine.capacity``); ``context`` defaults to ``max_model_len``; ``overrides``
        replace ``CapacityInputs`` fields (``hit_rate``, ``hbm_gb_s``, ...). When the engine
        split its GPU pools from free memory, ``inputs.gpu_kv_bytes`` is that budget: pass
        ``num_gpu_blocks=None, num_indexer_blocks=None`` to plan a split of it (e.g. with
        another ``max_num_seqs``)."""
        from hisparse.engine.capacity import plan_for_llm

        self._check_open()
        return plan_for_llm(self, context, **{"gpu_kv_bytes": self._gpu_kv_budget, **overrides})
