"""Kernel classes of ``hisparse bench --profile-kernels`` (names as CUPTI reports them)."""

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
