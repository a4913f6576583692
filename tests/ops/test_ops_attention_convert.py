"""``HISPARSE_FP8_CONVERT=int``: the FP8 attention's e4m3 -> bf16 by integer PTX
(``_attention_triton._e4m3_tiles_bf16``). The PTX is run here on every e4m3 code by an emulator
of the four instructions it uses; the two scale factors are checked for every scale the
quantizer makes; on the GPU the kernel's outputs equal the conversion instructions' bit for
bit."""

from __future__ import annotations

import inspect

import pytest
import torch

from hisparse.ops import _attention_triton as AT
from hisparse.ops import quant as Q
from hisparse.ops._attention_triton import _e4m3_tiles_bf16


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode, selectors 0-7): result byte i is byte ``sel``'s nibble i
    of the eight bytes ``b:a`` (``a`` the low four)."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _run_ptx(asm: str, word: int) -> tuple[int, int]:
    """``(%0, %1)`` of the inline PTX ``asm`` with ``%2 = word``."""
    ops = [op.strip() for op in asm.strip("{} ").split(";") if op.strip()]
    assert ops[0].startswith(".reg")
    regs = {"$2": word}
    for op in ops[1:]:
        name, args = op.split(None, 1)
        d, *src = [x.strip() for x in args.split(",")]
        v = [regs[x] if x in regs else int(x, 0) for x in src]
        if name == "prmt.b32":
            regs[d] = _prmt(*v)
        elif name == "shl.b32":
            regs[d] = (v[0] << v[1]) & 0xFFFFFFFF
        elif name == "and.b32":
            regs[d] = v[0] & v[1]
        elif name == "or.b32":
            regs[d] = v[0] | v[1]
        else:
            raise AssertionError(f"unexpected PTX op {name}")
    return regs["$0"], regs["$1"]


def _k120(codes: list[int]) -> torch.Tensor:
    """The PTX's bf16 lanes for ``codes`` (packed four to a register, element 0 the low byte;
    ``$0`` holds elements 0-1)."""
    lanes = []
    for i in range(0, len(codes), 4):
        word = int.from_bytes(bytes(codes[i:i + 4]), "little")
        for out in _run_ptx(AT.E4M3_BF16_PTX.value, word):
            lanes += [out & 0xFFFF, out >> 16]
    return torch.tensor(lanes, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)


def test_int_convert_is_the_product_for_every_code_and_scale():
    codes = [c for c in range(256) if c & 0x7F != 0x7F]       # e4m3fn NaNs are never stored
    codes += codes[:(-len(codes)) % 4]
    k120 = _k120(codes)
    e4m3 = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(k120.float() * 2.0 ** 120, e4m3.float())
    # the kernel's two factors (its source is what this checks against)
    src = "".join(inspect.getsource(AT._e4m3_tiles_bf16.fn).split())
    # (k120 * first) * second, left to right: the first product stays in range
    assert ("tl.reshape(k120,[BLOCK_N,NT,TILE])*(tl.minimum(sc,128.0)*TWO_POW_120)"
            ".to(tl.bfloat16)[:,:,None]*tl.maximum(sc*0.0078125,1.0).to(tl.bfloat16)"
            "[:,:,None]") in src
    assert AT.TWO_POW_120.value == 2.0 ** 120
    # every scale ops.quant.pow2_scale makes from bf16 rows: 2^-13 .. 2^120
    lo = int(torch.log2(Q.pow2_scale(torch.tensor([0.0]))).item())
    hi = int(torch.log2(Q.pow2_scale(torch.tensor([torch.finfo(torch.bfloat16).max]))).item())
    assert (lo, hi) == (-13, 120)
    for e in range(lo, hi + 1):
        s = torch.tensor(2.0 ** e)
        want = e4m3.to(torch.bfloat16) * s.to(torch.bfloat16)
        got = (k120 * (torch.clamp(s, max=128.0) * 2.0 ** 120).to(torch.bfloat16)) \
            * torch.clamp(s * 0.0078125, min=1.0).to(torch.bfloat16)
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), e


@pytest.mark.gpu
def test_gpu_int_convert_helper_every_code_and_scale():
    """``_e4m3_tiles_bf16`` compiled: every finite e4m3 code at every scale 2^-13..2^120 (a
    tile of 127 codes per scale and half), bit for bit against ``e4m3.to(bf16) * scale`` (the
    factors' grouping, bf16 subnormal lanes and the packing order on the hardware)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _tiles(raw_ptr, sc_ptr, out_ptr, BLOCK_N: tl.constexpr, NT: tl.constexpr,
               TILE: tl.constexpr, D_V: tl.constexpr):
        r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        c = tl.arange(0, D_V)[None, :]
        sc = tl.load(sc_ptr + r * NT + tl.arange(0, NT)[None, :])
        kn = _e4m3_tiles_bf16(tl.load(raw_ptr + r * D_V + c), sc, BLOCK_N, NT, TILE, D_V)
        tl.store(out_ptr + r * D_V + c, kn)

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    halves = [torch.cat([codes[:127], codes[:1]]), torch.cat([codes[127:], codes[:1]])]
    exps = list(range(-13, 121))
    tiles = [(h, e) for e in exps for h in halves]
    n_rows = 128                                   # 4 tiles a row; 268 tiles padded to 512
    raw = torch.zeros(n_rows * 4, 128, dtype=torch.uint8)
    sc = torch.ones(n_rows * 4)
    for i, (h, e) in enumerate(tiles):
        raw[i], sc[i] = h, 2.0 ** e
    raw, sc = raw.reshape(n_rows, 512).cuda(), sc.reshape(n_rows, 4).cuda()
    out = torch.full((n_rows, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    _tiles[(n_rows // 16,)](raw, sc, out, BLOCK_N=16, NT=4, TILE=128, D_V=512, num_warps=4)
    want = (raw.view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(n_rows, 4, 128)
            * sc.to(torch.bfloat16)[:, :, None]).reshape(n_rows, 512)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64])
def test_gpu_int_convert_bits_equal_native(H, kernel_switches, kernel_launches):
    """Rows over 2^-13 .. 2^24 tile scales (queries scaled so the logits stay finite) and
    padding indices: the same outputs and lse, bit for bit, with either conversion, each launch
    seen to take its path (the switch reaches the kernel)."""
    g = torch.Generator().manual_seed(H)
    N, T = 8192, 24
    magnitude = torch.logspace(-6, 9, N)[torch.randperm(N, generator=g)]
    kv = torch.randn(N, 576, generator=g) * magnitude[:, None]
    rows = Q.quantize_mla_rows_reference(kv, 512).cuda()
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert scales.max().item() > 2.0 ** 7 and scales.min().item() == 2.0 ** -13
    q = (torch.randn(T, H, 576, generator=g) * 1e-10).to(torch.bfloat16).cuda()
    idx = torch.randint(0, N, (T, 2048), generator=g).to(torch.int32)
    idx[torch.rand(T, 2048, generator=g) < 0.2] = -1
    idx = idx.cuda()
    launched = kernel_launches(AT, "_attn_fp8_kernel", "INT_CVT")
    kernel_switches(fp8_convert="native")
    native = AT.sparse_mla_attention_fp8_triton(q, rows, idx, 576 ** -0.5)
    kernel_switches(fp8_convert="int")
    conv = AT.sparse_mla_attention_fp8_triton(q, rows, idx, 576 ** -0.5)
    assert launched == [False, True]
    assert torch.isfinite(native[0]).all()
    assert torch.equal(native[0], conv[0]) and torch.equal(native[1], conv[1])
