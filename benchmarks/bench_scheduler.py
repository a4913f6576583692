"""Scheduler CPU time per decode step: 256 running requests at 64k context, block 64.

Measures Scheduler.schedule (acks, page allocation, reclaim, StepPlan with mirror rows) plus
Scheduler.update (append sampled tokens) per pure decode step; no worker, acks arrive one step
late. Target: <= 1 ms per step.

    python benchmarks/bench_scheduler.py [--requests 256] [--context 65536] [--mode hisparse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hisparse.config import KVCacheConfig, cdiv
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler


def run(requests: int, context: int, block_size: int, steps: int, mode: str) -> dict:
    # Early requests decode while later ones prefill: leave room for those tokens.
    max_len = context + 4096 + steps
    pages = cdiv(max_len, block_size)
    hot_blocks = cdiv(4096, block_size)
    # GPU pool far smaller than the working set: most requests end up in host-read mode.
    gpu_blocks = max(pages + 64, requests * (hot_blocks + 4) + 2 * pages) \
        if mode != "gpu-only" else requests * pages
    cfg = KVCacheConfig(block_size=block_size, num_gpu_blocks=gpu_blocks,
                        num_host_blocks=requests * pages, num_indexer_blocks=requests * pages,
                        max_model_len=max_len, index_topk=2048, hot_buffer_size=4096,
                        max_num_seqs=requests, max_num_batched_tokens=16384, mode=mode)
    sched = Scheduler(cfg)
    for i in range(requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(context)]
        sched.add(Request(f"r{i}", prompt, max_tokens=max_len - context, max_len=max_len))
    acks: list[int] = []
    t0 = time.perf_counter()
    prefill_steps = 0
    while sched.waiting or any(r.num_uncomputed > 1 for r in sched.running):
        plan = sched.schedule(acks)
        acks = [plan.step_id]
        sched.update(plan, [1 for s in plan.seqs if s.sample])
        prefill_steps += 1
    setup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = sched.schedule(acks)
        sched.update(plan, [1 for s in plan.seqs if s.sample])
        times.append(time.perf_counter() - t)
        acks = [plan.step_id]
        assert len(plan.seqs) == requests, "every request decodes each step"
    kv = sched.kv
    host_read = sum(r.host_read for r in kv.requests.values())
    return dict(mode=mode, requests=requests, context=context, block_size=block_size,
                gpu_blocks=gpu_blocks, host_read_requests=host_read, steps=steps,
                setup_s=round(setup_s, 2), prefill_steps=prefill_steps,
                step_ms_median=round(1e3 * statistics.median(times), 3),
                step_ms_p99=round(1e3 * sorted(times)[int(0.99 * len(times)) - 1], 3),
                step_ms_mean=round(1e3 * statistics.fmean(times), 3))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--mode", default="hisparse")
    a = p.parse_args()
    print(json.dumps(run(a.requests, a.context, a.block_size, a.steps, a.mode)))


if __name__ == "__main__":
    main()
