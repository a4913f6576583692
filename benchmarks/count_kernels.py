"""Count the GPU kernels of one eager decode step, per decoder layer (CUDA).

    python benchmarks/count_kernels.py --compare               # unfused vs fused, one run
    python benchmarks/count_kernels.py                         # as the environment says
    HISPARSE_FUSED_GLUE=0 python benchmarks/count_kernels.py   # the unfused references
    python benchmarks/count_kernels.py --kv-cache-dtype bf16 --json out.json

The model is one TP-8 rank of DeepSeek-V3.2 (``--model-shape``; FP8 block weights, dummy
load) at a few depths: the step's kernels at ``d`` dense layers and at ``d + 1`` give the
kernels of one dense layer, and at ``d`` vs ``d + 2`` MoE layers (after the ``d`` dense ones)
those of one MoE layer; the rest (embedding, final norm, LM head, sampling, the engine's
per-step uploads) is the fixed part. Every count comes from ``torch.profiler`` (CUDA kernel
events, memcpy/memset excluded) over one decode step of ``--requests`` requests, eager
(``enforce_eager``: one launch per kernel), after warm-up steps, synchronous scheduling.
Kernel names are grouped into classes (GEMM, MoE, attention/indexer/top-k, norm/RoPE glue,
elementwise, copies, other) as in issue 25's table. ``--compare`` profiles one step with
``HISPARSE_FUSED_GLUE=0`` and one with the fused glue on each model (switched between eager
steps with ``hisparse.ops.switches.override``), after warm-up steps under both (every kernel
compiled before a profiled step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter

from hisparse.bench import scratch_dir

os.environ.setdefault("HISPARSE_TRITON_AUTOTUNE", "0")   # counts do not depend on tuning
FLAG = "HISPARSE_FUSED_GLUE"

CLASSES = [
    ("moe", r"moe"),
    ("gemm", r"gemm|gemv|sgemm|xmma|cutlass|cublas|_fp8_|scaled_mm|nvjet|splitk"),
    ("attention/indexer/top-k", r"flash|mla|attention|indexer|topk|radix|sort|resolve|_attn"),
    ("fused glue", r"_add_rms_norm|_mla_rows|_index_keys|_rope_heads|_q_latent|_quant_write"),
    ("copies", r"copy|cat|Cat|index_put|scatter|gather|index_elementwise"),
    ("elementwise/reduce", r"elementwise|reduce|vectorized|unrolled|Reduce|softmax|layer_norm"),
]


def kernel_class(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name):
            return cls
    return "other"


def _profile_step(llm, cpu: bool) -> Counter:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = (lambda: None) if cpu else torch.cuda.synchronize
    sync()
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        llm.step()
        sync()
    want = torch.autograd.DeviceType.CPU if cpu else torch.autograd.DeviceType.CUDA
    counts: Counter = Counter()
    for e in prof.events():
        if e.device_type != want or (cpu and not e.name.startswith("aten::")):
            continue
        if re.search(r"^Memcpy|^Memset|memcpy|memset", e.name):
            continue
        counts[e.name] += 1
    return counts


def step_kernels(layers: int, a, settings: list[str]) -> dict[str, Counter]:
    """``HISPARSE_FUSED_GLUE`` value -> (kernel name -> launches in one decode step of a
    ``layers``-deep model)."""
    import torch

    from hisparse import LLM, SamplingParams
    from hisparse.bench.decode import write_config
    from hisparse.ops import switches

    cpu = a.device == "cpu"
    if cpu:
        from hisparse.models.random_checkpoint import make_random_checkpoint

        path = scratch_dir("hisparse-count-")
        make_random_checkpoint(path, num_hidden_layers=layers, first_k_dense_replace=a.dense_layers)
    else:
        path = write_config(layers, shape=a.model_shape)
    kw = dict(host_pool_gib=a.host_pool_gib) if a.mode != "gpu-only" else {}
    llm = LLM(path, device=a.device, dtype="bfloat16", load_format="auto" if cpu else "dummy",
              block_size=64, max_model_len=a.context + 64, max_num_seqs=a.requests,
              max_num_batched_tokens=max(2048, a.requests * a.context), mode=a.mode,
              kv_cache_dtype=a.kv_cache_dtype, enforce_eager=True, async_scheduling=False,
              num_indexer_blocks=a.requests * (a.context // 64 + 2),
              num_gpu_blocks=a.requests * (a.context // 64 + 2) + 64, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        for _ in range(a.requests):
            ids = torch.randint(2, min(1000, llm.model_config.vocab_size), (a.context,),
                                generator=g).tolist()
            llm.add_request({"prompt_token_ids": ids}, params)
        tokens: dict[str, int] = {}
        for i in range(a.warmup):
            with switches.override(fused_glue=settings[i % len(settings)] == "1"):
                for out in llm.step():          # both paths compiled
                    tokens[out.request_id] = len(out.outputs[0].token_ids)
        if len(tokens) < a.requests or min(tokens.values()) < 2:
            raise SystemExit(f"after {a.warmup} warm-up steps some request is not decoding yet "
                             f"({tokens}): raise --warmup")
        out: dict[str, Counter] = {}
        for value in settings:
            with switches.override(fused_glue=value == "1"):
                out[value] = _profile_step(llm, cpu)
        return out
    finally:
        llm.shutdown()


def per_layer(c_dm1: Counter, c_d: Counter, c_moe2: Counter, d: int) -> dict[str, dict]:
    """Counts at ``d - 1`` and ``d`` dense layers and ``d`` dense + 2 MoE -> per dense layer,
    per MoE layer and the fixed part of a step."""
    def diff(big: Counter, small: Counter, n: int) -> dict[str, float]:
        names = set(big) | set(small)
        return {k: (big[k] - small[k]) / n for k in names if big[k] != small[k]}

    dense, moe = diff(c_d, c_dm1, 1), diff(c_moe2, c_d, 2)
    fixed = {k: v - (d - 1) * dense.get(k, 0) for k, v in c_dm1.items()}
    return {"dense_layer": dense, "moe_layer": moe, "fixed": fixed}


def report(parts: dict[str, dict], title: str, top: int) -> None:
    print(f"\n=== {title}")
    for name, per in parts.items():
        by_cls: Counter = Counter()
        for k, v in per.items():
            by_cls[kernel_class(k)] += v
        print(f"\n{name}: {sum(per.values()):g} kernels  "
              + ", ".join(f"{c} {v:g}" for c, v in by_cls.most_common()))
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {v:6g}  [{kernel_class(k)}] {k[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="deepseek-v3.2-tp8-rank")
    p.add_argument("--dense-layers", type=int, default=3,
                   help="the shape's first_k_dense_replace (3 for DeepSeek-V3.2; >= 2)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--mode", default="gpu-only")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["bf16", "fp8"])
    p.add_argument("--host-pool-gib", type=float, default=8.0)
    p.add_argument("--warmup", type=int, default=4, help="steps before the profiled ones "
                   "(the prefill and the first decode steps)")
    p.add_argument("--compare", action="store_true",
                   help="profile HISPARSE_FUSED_GLUE=0 and =1 on the same models")
    p.add_argument("--top", type=int, default=40, help="kernel names listed per part")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on the "
                   "tiny test model, counting profiler CPU op events instead of kernels")
    p.add_argument("--json", default=None, help="write the counts here")
    a = p.parse_args()
    d = a.dense_layers
    if d < 2:
        p.error("--dense-layers must be >= 2 (a dense layer is the difference of two depths)")
    from hisparse.ops import switches

    settings = ["0", "1"] if a.compare else ["1" if switches.current().fused_glue else "0"]
    runs = [step_kernels(n, a, settings) for n in (d - 1, d, d + 2)]
    print(f"{a.model_shape}, {a.requests} x {a.context} tokens, {a.mode}, KV {a.kv_cache_dtype}")
    out, totals = {}, {}
    for value in settings:
        parts = per_layer(*(r[value] for r in runs), d)
        out[f"fused_glue={value}"] = parts
        report(parts, f"fused glue {'on' if value != '0' else 'off'} ({FLAG}={value})", a.top)
        totals[value] = {k: sum(v.values()) for k, v in parts.items()}
    print("\nkernels per part:", json.dumps(totals))
    for value, t in totals.items():
        print(f"{FLAG}={value}: a 61-layer rank step (3 dense + 58 MoE) launches "
              f"{t['fixed'] + 3 * t['dense_layer'] + 58 * t['moe_layer']:g} kernels")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
