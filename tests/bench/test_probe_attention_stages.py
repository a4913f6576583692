"""benchmarks/probe_attention_stages.py edits a copy of the attention kernel's source: every
edit must still match the package's kernel exactly once (a stale edit would cost a GPU call)."""

from __future__ import annotations

import inspect


def test_every_stage_edit_matches_the_kernel_once(load_bench):
    probe = load_bench("probe_attention_stages")
    src = probe.SRC.read_text()
    for name, (old, _new) in list(probe.EDITS.items()) + [("sum_rows", probe.SUM_ROWS)]:
        assert src.count(old) == 1, name
    for parts in [()] + [(n,) for n in probe.EDITS] + list(probe.COMBOS.values()):
        mod = probe.variant_module(tuple(parts))
        text = inspect.getsource(mod)
        assert (text == src) == (not parts), parts
        assert callable(mod.sparse_mla_attention_fp8_triton)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode, selectors 0-7): result byte i is byte ``sel``'s nibble i
    of the eight bytes ``b:a`` (``a`` the low four)."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_asm_convert_is_the_e4m3_value_times_two_to_minus_120(load_bench):
    """The ``asm_convert`` variant's PTX, run here on every e4m3 code four at a time (the
    packing the kernel sees: element 0 in the low byte, elements 0-1 in ``$0``): each bf16 lane
    times 2^120 is the e4m3 value, and times the tile scale times 2^120 in bf16 it is the
    kernel's product, bit for bit, for scales 2^-40..2^7; ``asm_exact``'s two factors give it
    for every scale the quantizer makes."""
    import re

    import torch

    probe = load_bench("probe_attention_stages")
    asm = "".join(re.findall(r'"([^"]*)"', probe.EDITS["asm_convert"][1].split("=r,=r,r")[0]))
    ops = [op.strip() for op in asm.strip("{} ").split(";") if op.strip()][1:]  # no .reg line
    codes = [c for c in range(256) if c & 0x7F != 0x7F]       # e4m3fn NaNs are never stored
    codes += codes[:(-len(codes)) % 4]
    lanes = []
    for i in range(0, len(codes), 4):
        regs = {"$2": int.from_bytes(bytes(codes[i:i + 4]), "little")}
        for op in ops:
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
        for out in ("$0", "$1"):
            lanes += [regs[out] & 0xFFFF, regs[out] >> 16]
    k120 = torch.tensor(lanes, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    e4m3 = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(k120.float() * 2.0 ** 120, e4m3.float())
    for e in range(-40, 8):
        scale = torch.tensor(2.0 ** e)
        want = e4m3.to(torch.bfloat16) * scale.to(torch.bfloat16)
        got = k120 * (scale * 1.329227995784916e36).to(torch.bfloat16)   # 2^120
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), e
    # asm_exact: the scale in two bf16 factors, exact for every scale the quantizer makes
    # (2^-13 .. 2^120: ops.quant.pow2_scale over bf16 rows)
    text = probe.EDITS["asm_exact"][1]
    assert "tl.minimum(sc, 128.0) * 1.329227995784916e36" in text
    assert "tl.maximum(sc * 0.0078125, 1.0)" in text
    for e in range(-13, 121):
        scale = torch.tensor(2.0 ** e)
        want = e4m3.to(torch.bfloat16) * scale.to(torch.bfloat16)
        got = (k120 * (torch.clamp(scale, max=128.0) * 2.0 ** 120).to(torch.bfloat16)) \
            * torch.clamp(scale * 0.0078125, min=1.0).to(torch.bfloat16)
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), e
