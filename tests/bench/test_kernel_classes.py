"""Kernel classes of ``hisparse bench --profile-kernels`` (names as CUPTI reports them)."""

from dataclasses import replace
from types import SimpleNamespace

import torch

from hisparse.bench.kernels import kernel_class, summarize


def test_kernel_names_fall_in_their_class():
    cases = {
        "void at::native::sbtopk::gatherTopK<long, unsigned int, 2, false>(...)": "top-k",
        "void at::native::radixSortKVInPlace<-2, -1, 32, 4, long, long>(...)": "top-k",
        "_indexer_scores_fp8_kernel": "indexer scoring",
        "_sparse_attention_fp8_kernel": "attention",
        "_resolve_kernel": "resolver and miss gather",
        "_plan_copy_kernel": "resolver and miss gather",
        "_resolve_gather_kernel": "resolver and miss gather",
        "_moe_gate_up_kernel": "MoE",
        "_fp8_gemm_kernel": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "GEMM",
        "void at::native::elementwise_kernel<128, 2, ...>": "norms and elementwise",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copies",
        "Memcpy HtoD (Pinned -> Device)": "copies",
        "void at::native::reduce_kernel<512, 1, ...>": "norms and elementwise",
        "_bench_topk_replay_kernel": "benchmark replay",
        "some_unknown_kernel": "other",
    }
    for name, cls in cases.items():
        assert kernel_class(name) == cls, name


def test_summarize_sums_device_events_per_step_and_skips_cpu_ops():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [SimpleNamespace(device_type=cuda, device_time_total=300.0, name="_resolve_kernel"),
          SimpleNamespace(device_type=cuda, device_time_total=100.0, name="_resolve_kernel"),
          SimpleNamespace(device_type=cuda, device_time_total=200.0, name="_moe_gate_up_kernel"),
          SimpleNamespace(device_type=cuda, device_time_total=60.0,
                          name="_bench_topk_replay_kernel"),
          SimpleNamespace(device_type=cpu, device_time_total=900.0, name="aten::mm")]
    kp = summarize(ev, steps=2)
    assert kp.ms_per_step == {"all": 0.33, "engine": 0.3, "benchmark replay": 0.03,
                              "resolver and miss gather": 0.2, "MoE": 0.1}
    # kernels per step / layer count the engine's kernels, not the replay's
    assert kp.kernels_per_step == 1.5 and kp.per_layer(3) == 0.5
    assert kp.top[0] == ("_resolve_kernel", 0.2)
    # every kernel, costliest first, with its launches per step (the replay under its name)
    assert kp.by_kernel == [("_resolve_kernel", 0.2, 1.0), ("_moe_gate_up_kernel", 0.1, 0.5),
                            ("_bench_topk_replay_kernel", 0.03, 0.5)]


def test_every_triton_kernel_of_the_package_has_a_class():
    """A launched Triton kernel (a ``@triton.jit`` function named ``*_kernel``) that falls in
    "other" hides its time from the class table (the stream GEMM and the radix select's
    passes once did)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "hisparse"
    names = {m.group(1) for p in root.rglob("*.py")
             for m in re.finditer(r"@triton\.jit\s*\ndef (_\w+_kernel)\(", p.read_text())}
    assert len(names) > 20
    unclassified = sorted(n for n in names if kernel_class(n) == "other")
    assert unclassified == []
    assert kernel_class("_mla_rows_kernel") == "norms and elementwise"
    assert kernel_class("_fp8_stream_kernel") == "GEMM"


def test_kernel_table_prints_launches_beside_the_top_kernels(capsys):
    """The bench's kernel table: a column per profiled point, launches a step beside each top
    kernel (``by_kernel``)."""
    from hisparse.bench import report

    base = report.Point(mode="gpu-only", topk_source="synthetic:0.8", context=2048,
                        concurrency=96, outputs=8, decode_tok_s=1.0, tpot_p50_ms=1.0,
                        tpot_p99_ms=1.0, running_reached=96, hot_hit_rate=1.0, h2d_gb_s=0.0,
                        gpu_mem_gib=1.0, host_pool_gib=0.0, num_preempted=0, spilled_pages=0,
                        wall_s=1.0, kernel_ms={"all": 3.5, "GEMM": 2.5, "MoE": 1.0},
                        kernels_per_layer=4.0,
                        top_kernels=[("_fp8_splitk_kernel", 2.5), ("_moe_down_kernel", 1.0)],
                        by_kernel=[("_fp8_splitk_kernel", 2.5, 183.0),
                                   ("_moe_down_kernel", 1.0, 33.0)])
    report.print_kernel_table([base, replace(base, context=32768, kernel_ms={"all": 1.0,
                                                                            "GEMM": 1.0})])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "kernel class | gpu-only lru 2k x 96 | gpu-only lru 32k x 96"
    assert "GEMM | 2.50 | 1.00" in lines and "MoE | 1.00 | 0.00" in lines
    assert lines[-2].endswith("_fp8_splitk_kernel 2.50 (183x); _moe_down_kernel 1.00 (33x)")
