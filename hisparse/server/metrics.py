"""Prometheus metrics of the server: requests, latencies, tokens, and the KV tier view.

Request-level series are recorded when a request finishes; engine counters and the tier view
are read from the engine thread's last published snapshot at scrape time (a custom collector),
so a scrape never touches the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hisparse.engine.async_engine import AsyncLLM, RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# stats() key -> (metric name, help)
_ENGINE_COUNTERS = {
    "hot_hits": ("hisparse_hot_buffer_hits", "Top-k rows served from hot buffers"),
    "hot_misses": ("hisparse_hot_buffer_misses", "Top-k rows copied from host into hot buffers"),
    "h2d_bytes": ("hisparse_h2d_bytes", "Bytes copied host to GPU (restores and hot misses)"),
    "d2h_bytes": ("hisparse_d2h_bytes", "Bytes mirrored GPU to host"),
    "spilled_pages": ("hisparse_spilled_pages", "GPU pages given up by host-read requests"),
    "restored_pages": ("hisparse_restored_pages", "Pages restored host to GPU"),
    "host_read_switches": ("hisparse_host_read_switches",
                           "Requests switched to host-read mode"),
    "gpu_held_admissions": ("hisparse_gpu_held_admissions",
                            "Requests admitted GPU-held (every page on GPU, no host blocks: "
                            "the host pool was full)"),
    "num_preempted": ("hisparse_preemptions", "Requests preempted"),
    "topk_stalls": ("hisparse_topk_stalls",
                    "Top-k row barrier waits that gave up (never expected: inexact selections)"),
    "hot_lru_corrupt": ("hisparse_hot_lru_corrupt_entries",
                        "Hot-buffer LRU entries out of range the resolver skipped (never "
                        "expected)"),
    "spec_draft_tokens": ("hisparse_spec_draft_tokens", "MTP draft tokens verified"),
    "spec_accepted_tokens": ("hisparse_spec_accepted_tokens", "MTP draft tokens accepted"),
    "spec_verify_steps": ("hisparse_spec_verify_steps",
                          "Request-steps that verified MTP drafts"),
    "hot_demand_misses": ("hisparse_hot_buffer_demand_misses",
                          "Top-k rows a step waited for (not prefetched)"),
    "hot_prefetched": ("hisparse_hot_buffer_prefetched",
                       "Band rows copied into hot buffers ahead of use"),
    "hot_prefetch_hits": ("hisparse_hot_buffer_prefetch_hits",
                          "Prefetched rows later selected"),
    "staged_rows": ("hisparse_staged_rows", "Spilled history rows staged for prefill chunks"),
    "staged_bytes": ("hisparse_staged_bytes", "Bytes staged host to GPU for prefill chunks"),
    "staged_chunks": ("hisparse_staged_chunks", "Prefill chunks that read staged history"),
}


class ServerMetrics:
    """Every series of one server, in its own registry (``registry``)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.engine: AsyncLLM | None = None
        labels = {"model_name": model_name}
        self._labels = labels
        r = self.registry
        self.finished = Counter("hisparse_requests_finished", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter("hisparse_requests_rejected",
                                "Requests rejected (400 bad request, 503 overloaded)",
                                ["model_name", "status"], registry=r)
        self.ttft = Histogram("hisparse_time_to_first_token_seconds", "Time to first token",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hisparse_time_per_output_token_seconds",
                              "Time per output token after the first", ["model_name"],
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("hisparse_e2e_request_latency_seconds", "End-to-end latency",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hisparse_prompt_tokens", "Prompt tokens of finished "
                                     "requests", ["model_name"], registry=r)
        self.generation_tokens = Counter("hisparse_generation_tokens", "Generated tokens of "
                                         "finished requests", ["model_name"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(model_name, reason)
        for status in ("400", "503"):
            self.rejected.labels(model_name, status)
        r.register(_EngineCollector(self))

    def attach(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def on_request_finished(self, m: RequestMetrics) -> None:
        name = self._labels["model_name"]
        self.finished.labels(name, m.finish_reason or "abort").inc()
        self.prompt_tokens.labels(name).inc(m.prompt_tokens)
        self.generation_tokens.labels(name).inc(m.output_tokens)
        self.e2e.labels(name).observe(m.e2e)
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(name).observe(m.tpot)


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        engine = self.metrics.engine
        if engine is None:
            return
        snap = engine.snapshot
        name = self.metrics._labels["model_name"]
        stats = snap.stats

        def gauge(metric, help_, value, **extra):
            g = GaugeMetricFamily(metric, help_, labels=["model_name", *extra])
            g.add_metric([name, *extra.values()], value)
            return g

        yield gauge("hisparse_requests_running", "Requests running", snap.num_running)
        yield gauge("hisparse_requests_waiting", "Requests waiting", snap.num_waiting)
        pages = GaugeMetricFamily("hisparse_gpu_pages", "Computed pages of live requests by "
                                  "state: dirty (GPU only), clean (GPU + durable host copy), "
                                  "host_only", labels=["model_name", "state"])
        for state in ("dirty", "clean", "host_only"):
            pages.add_metric([name, state], snap.page_states.get(state, 0))
        yield pages
        total_gpu = stats.get("num_gpu_blocks", 0)
        total_host = stats.get("num_host_blocks", 0)
        yield gauge("hisparse_gpu_blocks_total", "GPU KV blocks", total_gpu)
        yield gauge("hisparse_gpu_blocks_free", "Free GPU KV blocks (cached prefixes count as "
                    "free)", stats.get("free_gpu_blocks", 0))
        yield gauge("hisparse_host_blocks_total", "Host pool blocks", total_host)
        yield gauge("hisparse_host_blocks_used", "Host pool blocks in use",
                    total_host - stats.get("free_host_blocks", 0))
        yield gauge("hisparse_indexer_blocks_free", "Free indexer-cache blocks",
                    stats.get("free_indexer_blocks", 0))
        yield gauge("hisparse_copies_in_flight", "Mirror copies in flight",
                    snap.copies_in_flight)
        yield gauge("hisparse_engine_up", "1 while the engine loop runs",
                    0 if engine.dead is not None else 1)
        yield gauge("hisparse_spec_acceptance_rate", "Accepted / verified MTP draft tokens",
                    stats.get("spec_acceptance_rate", 0.0))
        yield gauge("hisparse_spec_mean_accepted_length", "Tokens produced per verify step",
                    stats.get("spec_mean_accepted_length", 0.0))
        yield gauge("hisparse_spec_union_size_mean", "Mean union of a verify group's top-k "
                    "selections (rows)", stats.get("spec_union_size_mean", 0.0))
        for key, (metric, help_) in _ENGINE_COUNTERS.items():
            c = CounterMetricFamily(metric, help_, labels=["model_name"])
            c.add_metric([name], stats.get(key, 0))
            yield c
        if "kv_transfer_role" in stats:
            yield from _kv_transfer_metrics(name, stats, gauge)
        c = CounterMetricFamily("hisparse_prefix_hit_tokens", "Prompt tokens served from the "
                                "prefix cache, by the tier their rows came from",
                                labels=["model_name", "tier"])
        host = stats.get("host_prefix_hit_tokens", 0)
        c.add_metric([name, "gpu"], stats.get("prefix_hit_tokens", 0) - host)
        c.add_metric([name, "host"], host)
        yield c


# stats() key -> (metric name, help): prefill/decode disaggregation (issue 23)
_KV_TRANSFER_COUNTERS = {
    "kv_transfer_requests": ("hisparse_kv_transfer_requests",
                             "Remote prompts whose KV was pulled (decode)"),
    "kv_transfer_failures": ("hisparse_kv_transfer_failures",
                             "Remote KV loads that failed: hash mismatch, error, timeout"),
    "kv_transfer_bytes": ("hisparse_kv_transfer_bytes", "Bytes pulled over NIXL (decode)"),
    "kv_transfer_seconds": ("hisparse_kv_transfer_seconds",
                            "Summed start-to-landed time of remote KV loads (decode)"),
    "kv_transfer_prefix_hit_rows": ("hisparse_kv_transfer_prefix_hit_rows",
                                    "Remote prompt rows not pulled: prefix-cache hits here "
                                    "(decode)"),
    "kv_transfer_stalled": ("hisparse_kv_transfer_stalled",
                            "Failed or aborted remote KV loads whose NIXL READs were still in "
                            "flight: their blocks were quarantined (decode)"),
    "kv_transfer_held": ("hisparse_kv_transfer_held",
                         "Prompts held for a remote decode (prefill)"),
    "kv_transfer_released": ("hisparse_kv_transfer_released",
                             "Held prompts released on the decode's notification (prefill)"),
    "kv_transfer_expired": ("hisparse_kv_transfer_expired",
                            "Held prompts freed by the timeout (prefill)"),
}


def _kv_transfer_metrics(name: str, stats: dict, gauge):
    for key, (metric, help_) in _KV_TRANSFER_COUNTERS.items():
        c = CounterMetricFamily(metric, help_, labels=["model_name"])
        c.add_metric([name], stats.get(key, 0))
        yield c
    c = CounterMetricFamily("hisparse_kv_transfer_rows_landed", "Remote prompt rows landed "
                            "(per layer), by tier", labels=["model_name", "tier"])
    c.add_metric([name, "gpu"], stats.get("kv_transfer_rows_gpu", 0))
    c.add_metric([name, "host"], stats.get("kv_transfer_rows_host", 0))
    yield c
    yield gauge("hisparse_kv_transfer_held_requests", "Prompts held now for a remote decode",
                stats.get("kv_transfer_held_now", 0))
    yield gauge("hisparse_kv_transfer_loading_requests", "Requests waiting for remote KV now",
                stats.get("kv_transfer_loading_now", 0))
    yield gauge("hisparse_kv_transfer_quarantined_blocks", "Blocks (GPU, host and indexer) "
                "kept out of the pools now: a failed load's NIXL READs may still write them",
                stats.get("kv_transfer_quarantined_blocks", 0))
    yield gauge("hisparse_kv_transfer_quarantined_loads", "Failed remote KV loads whose NIXL "
                "READs have not ended yet", stats.get("kv_transfer_quarantined_loads", 0))
