"""GPU kernel time per engine step, by kernel class (``hisparse bench --profile-kernels N``).

:func:`profile_kernels` runs ``N`` engine steps under ``torch.profiler`` (CUDA activity only:
the kernels, memcpys and memsets CUPTI records, inside CUDA-graph replays too) and sums each
device event's time into the first class of :data:`KERNEL_CLASSES` whose pattern matches the
kernel's name. Events of the side streams (mirrors, prefetch) count like any other: the figure
is device time, not the critical path (the step's wall and GPU-event times say that).

HiSparse (host-read) steps profile like GPU-only ones this way (real rank, 42 host-read
requests: docs/BENCHMARKS.md, "Profiling HiSparse steps"). Under the overlapped loop one
``LLM.step()`` launches step n and then waits for step n-1's tokens: ``N`` calls hold the kernels
of the ``N`` steps launched inside the session (the step in flight when it starts is not in
it), and the session ends after a device synchronize so none of them is still running. Why an
earlier plain profile of HiSparse steps recorded no kernels was not determined (ibid.).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# (class, pattern over the kernel name, case-insensitive); the first match wins, so specific
# classes come before the generic ones ("_moe_gemm" is MoE, "topk" before "index").
REPLAY = "benchmark replay"
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    (REPLAY, r"_bench_"),                 # the benchmark's own top-k replay, not the engine's
    # the radix select's passes (ops/_topk_triton.py) are _hist / _collect / _sort kernels
    ("top-k", r"topk|radix|gatherTopK|bitonic|sort|select_kernel|column_order|_hist_kernel"
              r"|_collect_kernel"),
    ("indexer scoring", r"indexer|_score"),
    ("attention", r"attention|attn|flash|mla(?!_rows)|_combine|splitkv"),
    ("resolver and miss gather", r"resolve|plan_copy|prefetch|stage_rows|gather_rows|"
                                 r"resident_rows"),
    ("MoE", r"moe|expert"),
    ("GEMM", r"gemm|gemv|xmma|cutlass|cublas|sm90_|sm80_|matmul|_mm_|scaled_mm|splitk|nvjet|"
             r"_fp8_stream"),
    ("copies", r"copy|memcpy|memset|CatArray|fill"),
    ("norms and elementwise", r"elementwise|reduce|norm|index|vectorized|softmax|sigmoid|silu|"
                              r"rope|rotary|quant|where|cast|add|mul|exp|relu|scatter|cumsum|"
                              r"_mla_rows|_q_latent"),
)
OTHER = "other"


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a kernel name, or ``"other"``."""
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return cls
    return OTHER


@dataclass
class KernelProfile:
    """Device time of ``steps`` engine steps: ``ms_per_step`` per class (and ``"all"``),
    ``kernels_per_step`` (device events), ``by_kernel`` = every kernel name with its ms and
    launches per step, costliest first (the benchmark's replay included, under its own name),
    and ``top`` = the first ten of them as (name, ms per step)."""
    steps: int
    ms_per_step: dict[str, float] = field(default_factory=dict)
    kernels_per_step: float = 0.0
    by_kernel: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def top(self) -> list[tuple[str, float]]:
        return [(name, ms) for name, ms, _ in self.by_kernel[:10]]

    def per_layer(self, num_layers: int) -> float:
        """Device events per step and decoder layer."""
        return self.kernels_per_step / max(1, num_layers)

    def table(self, num_layers: int) -> str:
        """A short printable table (ms per step by class, kernels per layer, the top kernels)."""
        rows = [f"  {cls:<26} {ms:8.3f} ms" for cls, ms in self.ms_per_step.items()]
        rows.append(f"  kernels per step {self.kernels_per_step:.0f} "
                    f"({self.per_layer(num_layers):.1f} per decoder layer)")
        rows += [f"    {ms:7.3f} ms {n:6.0f}x  {name[:90]}" for name, ms, n in self.by_kernel[:10]]
        return "\n".join(rows)


def summarize(events, steps: int) -> KernelProfile:
    """Sum device events (``torch.profiler`` ``FunctionEvent`` of a CUDA device type) by class."""
    per_class: dict[str, float] = defaultdict(float)
    per_name: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    count = 0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            continue
        us = e.device_time_total
        cls = kernel_class(e.name)
        per_class[cls] += us
        per_name[e.name] += us
        launches[e.name] += 1
        count += cls != REPLAY
    order = [c for c, _ in KERNEL_CLASSES] + [OTHER]
    ms = {c: per_class[c] / 1e3 / steps for c in order if c in per_class}
    total = sum(per_class.values())
    # "engine": what the targets count (the replay stands in for the indexer's selection)
    ms = {"all": total / 1e3 / steps, "engine": (total - per_class[REPLAY]) / 1e3 / steps, **ms}
    by_kernel = [(n, us / 1e3 / steps, launches[n] / steps) for n, us in per_name.most_common()]
    return KernelProfile(steps=steps, ms_per_step=ms, kernels_per_step=count / steps,
                         by_kernel=by_kernel)


def profile_kernels(step: Callable[[], object], steps: int) -> KernelProfile:
    """Run ``step()`` ``steps`` times under the profiler (CUDA activity) and summarize."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return summarize(prof.events(), steps)
