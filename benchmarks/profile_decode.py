"""Profile decode steps of the decode benchmark's model (CUDA): where does a step's time go?

    python benchmarks/profile_decode.py --layers 4 --intermediate-size 32768 --context 16384 \
        --requests 128 --mode always-host

Prints the wall time per step split into the engine's phases (schedule + plan, launch, waiting
for the previous step's tokens, applying them), a host cProfile of the steady state, and a
torch profiler table of the GPU kernels.
"""

import argparse
import cProfile
import gc
import pstats
import time
from collections import defaultdict

import torch

from hisparse import SamplingParams
from hisparse.bench.decode import make_topk_override, topk_table, write_config
from hisparse.bench.synthetic import synthetic_runner


def timed(obj, name: str, acc: dict) -> None:
    """Accumulate the wall time of ``obj.name`` calls into ``acc[name]``."""
    real = getattr(obj, name)

    def wrapper(*args, **kw):
        t = time.perf_counter()
        try:
            return real(*args, **kw)
        finally:
            acc[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--mode", default="gpu-only")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8"], default="bf16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--host-pool-gib", type=float, default=8.0)
    p.add_argument("--topk", default="indexer", help="indexer or synthetic:<overlap>")
    a = p.parse_args()
    from hisparse import LLM

    path = write_config(a.layers, a.intermediate_size)
    table = topk_table(a.topk, a.layers, a.context, 256, 2048)
    override = None if table is None else make_topk_override(table.to("cuda"), a.context)
    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", block_size=64,
              num_gpu_blocks=a.requests * (a.context // 64 + 8) + 200,
              host_pool_gib=a.host_pool_gib, mode=a.mode, max_model_len=a.context + 64,
              max_num_seqs=a.requests, max_num_batched_tokens=4 * a.context,
              kv_cache_dtype=a.kv_cache_dtype, runner_cls=synthetic_runner(topk_override=override))
    llm.capture_cuda_graphs()
    for i in range(a.requests):
        llm.add_request({"prompt_token_ids": [5 + i] * a.context},
                        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(400):  # prompts, until (nearly) every request decodes
        got = {out.request_id for out in llm.step()}
        if len(got) >= 0.95 * a.requests:
            break
    print(f"decoding: {len(got)} requests; stats {llm.stats()}")
    acc: dict[str, float] = defaultdict(float)
    gc_start: list[float] = []

    def gc_timer(phase, info):   # time spent in the garbage collector
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            acc[f"gc{info['generation']}"] += time.perf_counter() - gc_start.pop()

    gc.callbacks.append(gc_timer)
    timed(llm.scheduler, "schedule", acc)
    timed(llm.runner, "execute", acc)
    timed(llm.core, "_apply", acc)
    timed(llm.core, "_launch", acc)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        llm.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / a.steps
    print(f"step {1e3 * wall:.2f} ms: " + ", ".join(
        f"{k} {1e3 * v / a.steps:.2f}" for k, v in acc.items()) + " (ms per step)")
    with cProfile.Profile() as cprof:   # host side: where the CPU time of a step goes
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
    pstats.Stats(cprof).sort_stats("tottime").print_stats(20)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
