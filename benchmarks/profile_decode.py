"""Profile a few decode steps of the decode benchmark's model (CUDA): where does a step go?

    python benchmarks/profile_decode.py --context 65536 --requests 8 --mode gpu-only
"""

import argparse
import time

import torch

from hisparse import SamplingParams
from hisparse.bench.decode import write_config
from hisparse.bench.synthetic import synthetic_runner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--mode", default="gpu-only")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    from hisparse import LLM

    mode = a.mode
    path = write_config(a.layers, a.intermediate_size)
    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", block_size=64,
              num_gpu_blocks=a.requests * (a.context // 64 + 8) + 200, host_pool_gib=8,
              mode=mode, max_model_len=a.context + 64, max_num_seqs=a.requests,
              max_num_batched_tokens=4 * a.context, runner_cls=synthetic_runner())
    for i in range(a.requests):
        llm.add_request({"prompt_token_ids": [5 + i] * a.context},
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(8):  # prompts + warm-up decode steps
        llm.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        llm.step()
    torch.cuda.synchronize()
    print(f"step {1e3 * (time.perf_counter() - t) / a.steps:.2f} ms (no profiler)")
    import cProfile
    import pstats
    with cProfile.Profile() as cprof:   # host side: where the CPU time of a step goes
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
    pstats.Stats(cprof).sort_stats("tottime").print_stats(25)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
