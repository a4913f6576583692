"""Programmatic dependent launch (``hisparse.ops._common.pdl``): off where it cannot apply, and
on the GPU a kernel chain launched early (each kernel waiting on its predecessor) gives the
bits of the same chain launched plainly, eager and in CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from hisparse.ops._common import pdl, pdl_args
from hisparse.ops.moe_layer import moe_layer

from .test_ops_moe_layer import RANK, _rank_layer


def test_pdl_off_on_cpu_and_under_the_switch(kernel_switches):
    assert not pdl(torch.zeros(1))
    assert not pdl(torch.device("cpu"))
    assert pdl_args(torch.zeros(1)) == {}
    kernel_switches(pdl=False)
    if torch.cuda.is_available():
        assert not pdl(torch.zeros(1, device="cuda"))


@pytest.fixture(scope="module")
def rank_layer():
    return _rank_layer(seed=11)


@pytest.mark.gpu
def test_gpu_pdl_is_on_for_sm90(kernel_switches):
    x = torch.zeros(1, device="cuda")
    want = torch.cuda.get_device_capability()[0] >= 9
    assert pdl(x) == want and bool(pdl_args(x)) == want
    kernel_switches(pdl=False)
    assert not pdl(x)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 24, 96])
def test_gpu_pdl_chain_same_bits_eager_and_replayed(rank_layer, kernel_switches, T):
    """The fused MoE layer (seven dependent launches: router GEMM, routing, alignment, both
    grouped GEMMs, quantization, combine) twice in a row, so each launch reads what the one
    before it wrote."""
    args, kw, _ = rank_layer

    def chain(x):
        y = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
        return moe_layer(y, *args[:2], RANK, *args[2:], **kw)

    x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    kernel_switches(pdl=False)
    plain = chain(x)
    kernel_switches(pdl=True)
    assert torch.equal(chain(x), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for seed in range(5):
        x.copy_(torch.randn(x.shape, generator=torch.Generator("cuda").manual_seed(seed),
                            device="cuda", dtype=x.dtype))
        out.fill_(float("nan"))
        graph.replay()
        kernel_switches(pdl=False)
        want = chain(x)
        kernel_switches(pdl=True)
        assert torch.equal(out, want), seed
