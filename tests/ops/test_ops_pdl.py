"""Programmatic dependent launch (``hisparse.ops._common.pdl``): off where it cannot apply, on
for SM90 unless switched off. That a chain launched early gives the plain chain's bits is
tested on the fused MoE layer (``test_ops_moe_layer.py``) and by the engine's GPU tests, which
run with it."""

from __future__ import annotations

import pytest
import torch

from hisparse.ops._common import pdl, pdl_args


def test_pdl_off_on_cpu_and_under_the_switch(kernel_switches):
    assert not pdl(torch.zeros(1))
    assert not pdl(torch.device("cpu"))
    assert pdl_args(torch.zeros(1)) == {}
    kernel_switches(pdl=False)
    if torch.cuda.is_available():
        assert not pdl(torch.zeros(1, device="cuda"))


@pytest.mark.gpu
def test_gpu_pdl_is_on_for_sm90(kernel_switches):
    x = torch.zeros(1, device="cuda")
    want = torch.cuda.get_device_capability()[0] >= 9
    assert pdl(x) == want and bool(pdl_args(x)) == want
    kernel_switches(pdl=False)
    assert not pdl(x)
