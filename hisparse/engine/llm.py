"""The user-facing engine, shaped like vLLM's ``LLM``.

    from hisparse import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", host_pool_gib=8)
    outs = llm.generate(["text", ...] or [{"prompt_token_ids": [...]}, ...],
                        SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hisparse.config import KVCacheConfig, cdiv, host_blocks_for_gib
from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams, sample
from hisparse.engine.scheduler import Scheduler
from hisparse.models.loader import load_model
from hisparse.worker.cache import CacheGeometry, KVCaches
from hisparse.worker.model_runner import ModelRunner

HISPARSE_MODES = {True: "hisparse", False: "gpu-only", "always-host": "always-host"}


@dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


def available_host_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class LLM:
    """Continuous-batching DSA engine with lossless HiSparse KV tiering.

    ``hisparse``: True (GPU first, spill under pressure), False (GPU-only baseline: admission
    bounded by GPU blocks) or ``"always-host"`` (every request reads its history through its hot
    buffer once its prompt is done). ``num_gpu_blocks=None`` sizes the GPU arena from free device
    memory (CUDA) or to hold ``max_num_seqs`` full-length requests (CPU). On CUDA, pure decode
    steps of dense-MLP models are captured as CUDA graphs unless ``enforce_eager``.
    ``runner_cls``: the worker's one extension seam, a ``ModelRunner`` subclass (or callable with
    its signature) used instead of ``ModelRunner`` (benchmarks: ``hisparse.bench.synthetic``).
    """

    def __init__(self, model: str, device: str | None = None, dtype: str | None = None,
                 block_size: int = 64, num_gpu_blocks: int | None = None,
                 host_pool_gib: float = 4.0, hisparse: bool | str = True,
                 hot_buffer_size: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 num_indexer_blocks: int | None = None, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.9, watermark_blocks: int | None = None,
                 load_format: str = "auto",
                 host_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                 enforce_eager: bool = False, runner_cls=None):
        if hisparse not in HISPARSE_MODES:
            raise ValueError(f"hisparse must be True, False or 'always-host', got {hisparse!r}")
        mode = HISPARSE_MODES[hisparse]
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        self.model, self.model_config = load_model(model, dtype=dtype, device=self.device,
                                                   load_format=load_format)
        mc = self.model_config
        self.max_model_len = max_model_len or min(mc.max_position_embeddings, 16384)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        geo = CacheGeometry(num_layers=mc.num_layers, row_dim=mc.kv_row_dim,
                            indexer_layers=tuple(l for l in range(mc.num_layers)
                                                 if mc.layer_has_indexer(l)),
                            index_head_dim=mc.index_head_dim, dtype=self.model.dtype)
        pages = cdiv(self.max_model_len, block_size)
        if num_indexer_blocks is None:
            num_indexer_blocks = max_num_seqs * pages
        num_host_blocks = 0
        if mode != "gpu-only":
            avail = available_host_memory_bytes()
            if host_buffers is None and host_pool_gib * (1 << 30) > avail:
                raise ValueError(f"host_pool_gib ({host_pool_gib}) exceeds available host memory "
                                 f"({avail / (1 << 30):.1f} GiB)")
            num_host_blocks = host_blocks_for_gib(host_pool_gib, geo.bytes_per_token * block_size)
        if num_gpu_blocks is None:
            num_gpu_blocks = self._default_gpu_blocks(geo, block_size, num_indexer_blocks,
                                                      max_num_seqs * pages,
                                                      gpu_memory_utilization)
        self.kv_config = KVCacheConfig(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            num_host_blocks=num_host_blocks, num_indexer_blocks=num_indexer_blocks,
            max_model_len=self.max_model_len, index_topk=mc.index_topk,
            hot_buffer_size=hot_buffer_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, mode=mode,
            enable_prefix_caching=enable_prefix_caching, watermark_blocks=watermark_blocks)
        self.caches = KVCaches(self.kv_config, geo, self.device, host_buffers)
        self.runner = (runner_cls or ModelRunner)(self.model, self.caches, mc.index_topk,
                                                  mc.kv_lora_rank, enforce_eager=enforce_eager)
        self.scheduler = Scheduler(self.kv_config)
        self.tokenizer = self._load_tokenizer(model)
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._acks: list[int] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------ set-up helpers
    def _default_gpu_blocks(self, geo: CacheGeometry, block_size: int, num_indexer_blocks: int,
                            unconstrained: int, utilization: float) -> int:
        if self.device.type != "cuda":
            return unconstrained
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = free * utilization - num_indexer_blocks * geo.indexer_bytes_per_block(block_size)
        blocks = int(budget // geo.gpu_bytes_per_block(block_size))
        if blocks <= 0:
            raise ValueError("not enough free GPU memory for the indexer cache and one KV block: "
                             "lower max_num_seqs / num_indexer_blocks")
        return min(blocks, unconstrained)

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
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, [int(t) for t in prompt["prompt_token_ids"]]
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
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
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; raises ValueError on bad input (other requests are unaffected)."""
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        self._validate(ids, params)
        return self._enqueue(text, ids, params, request_id)

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> str:
        req_id = request_id or f"req-{next(self._ids)}"
        if req_id in self._requests:
            raise ValueError(f"request_id {req_id!r} is already in use")
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        req = Request(req_id, ids, max_tokens=params.max_tokens, max_len=max_len,
                      sampling=params, stop_token_ids=frozenset(params.stop_token_ids),
                      prompt_text=text)
        self.scheduler.add(req)
        self._requests[req_id] = req
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self._generators[req_id] = gen
        return req_id

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._forget(request_id)

    def _forget(self, req_id: str) -> Request:
        self._generators.pop(req_id, None)
        return self._requests.pop(req_id)

    def capture_cuda_graphs(self) -> None:
        """Capture every decode batch bucket now instead of on first use (keeps capture time out
        of measurements). No-op when decode is not captured (CPU, eager, MoE models)."""
        if self.runner.graphs is not None:
            variants = (False,) if self.kv_config.mode == "gpu-only" else (False, True)
            self.runner.graphs.capture_all(variants)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that finished in it."""
        plan = self.scheduler.schedule(self._acks)
        self._acks = []
        if plan is None:
            if not self.runner.in_flight:
                raise RuntimeError("engine is stuck: requests wait but nothing can be scheduled")
            self._acks = self.runner.drain()  # finished requests still hold KV until acked
            return []
        reqs = [self._requests[s.req_id] for s in plan.seqs]
        input_ids = [t for s, r in zip(plan.seqs, reqs)
                     for t in r.token_ids[s.start_pos:s.start_pos + s.num_tokens]]
        logits, self._acks = self.runner.execute(plan, input_ids)
        sampling = [(s, r) for s, r in zip(plan.seqs, reqs) if s.sample]
        tokens = sample(logits, [r.sampling for _, r in sampling],
                        [self._generators[s.req_id] for s, _ in sampling])
        sampled = {s.req_id: tok for (s, _), tok in zip(sampling, tokens)}
        finished = self.scheduler.update(plan, sampled,
                                         frozenset(self.model_config.eos_token_ids))
        return [self._output(self._forget(r.req_id)) for r in finished]

    def _output(self, req: Request) -> RequestOutput:
        ids = list(req.output_token_ids)
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        return RequestOutput(req.req_id, req.prompt_text,
                             list(req.prompt_token_ids),
                             [CompletionOutput(0, text, ids, req.finish_reason)])

    def generate(self, prompts: Sequence, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        Every prompt is validated before any is queued: a bad one raises ValueError and leaves
        the engine serving whatever else it holds.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        prepared = []
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            self._validate(ids, p or SamplingParams())
            prepared.append((text, ids, p or SamplingParams()))
        ids = [self._enqueue(*item) for item in prepared]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        while wanted - done.keys():
            for out in self.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        self._acks += self.runner.drain()
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        kv = self.scheduler.kv
        hits, misses = self.runner.hot_counters()
        row_bytes = self.runner.row_bytes
        return {
            "mode": self.kv_config.mode,
            "num_gpu_blocks": self.kv_config.num_gpu_blocks,
            "num_host_blocks": self.kv_config.num_host_blocks,
            "spilled_pages": kv.stats.spilled_pages,
            "lost_pages": kv.stats.lost_pages,
            "restored_pages": kv.stats.restored_pages,
            "host_read_switches": kv.stats.host_read_switches,
            "hot_hits": hits,
            "hot_misses": misses,
            "h2d_bytes": self.runner.h2d_bytes + misses * row_bytes,
            "d2h_bytes": self.runner.d2h_bytes,
            "prefix_hit_tokens": kv.stats.prefix_hit_tokens,
            "host_prefix_hit_tokens": kv.stats.host_prefix_hit_tokens,
            "num_preempted": self.scheduler.num_preempted,
            "peak_running": self.scheduler.peak_running,
        }

    def capacity(self, context: int | None = None, **overrides):
        """Capacity plan of this engine's real pools, every mode (see
        ``hisparse.engine.capacity``); ``context`` defaults to ``max_model_len``; ``overrides``
        replace ``CapacityInputs`` fields (``hit_rate``, ``hbm_gb_s``, ...)."""
        from hisparse.engine.capacity import plan_for_llm

        return plan_for_llm(self, context, **overrides)
