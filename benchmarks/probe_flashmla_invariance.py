"""Which invariances FlashMLA's FP8 sparse decode keeps (issue 25; why ``auto`` does not pick it):
each line compares two calls whose outputs the lossless contract needs equal, bit for bit, at
16 heads (padded to 64 per call, as ``HISPARSE_ATTENTION=flashmla`` runs it), 8 and 24 tokens,
top-k 2048; the Triton kernel's batch invariance beside it.

Usage (repository root, CUDA, sgl-flash-mla installed): ``PYTHONPATH=. python
benchmarks/probe_flashmla_invariance.py`` (~15 s)
"""
from __future__ import annotations

import torch

from hisparse.ops import quantize_mla_rows_reference
from hisparse.ops._attention_triton import sparse_mla_attention_fp8_triton
from hisparse.ops.attention import _flashmla_fp8, flashmla_sched_meta

H, K, SCALE, N = 16, 2048, 576 ** -0.5, 64 * 1024


def report(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    d = (a.float() - b.float()).abs().max().item()
    print(f"{name:58s} bitwise={torch.equal(a, b)!s:5s} max|diff|={d:.3g}", flush=True)


def flashmla(q, kv8, idx, meta=None):
    return _flashmla_fp8(q, kv8, idx, SCALE, 512, meta)[0]


def probe(T: int, kv8: torch.Tensor) -> None:
    q = torch.randn(T, H, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randperm(N - 128, device="cuda")[: T * K].view(T, K).int()
    idx[:, -300:] = -1                                   # a padding tail, as short requests have
    o = flashmla(q, kv8, idx)
    report(f"T={T} the same call twice", o, flashmla(q, kv8, idx))
    report(f"T={T} FlashMLA vs Triton (FP8 rounding)", o,
           sparse_mla_attention_fp8_triton(q, kv8, idx, SCALE)[0])
    perm = torch.randperm(N, device="cuda")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(N, device="cuda")
    moved = torch.where(idx >= 0, inv[idx.clamp(min=0).long()].int(), idx)
    report(f"T={T} the same rows at other row ids", o, flashmla(q, kv8[perm], moved))
    report(f"T={T} N % 64 != 0 (a cache view of 1-row pages)", o, flashmla(q, kv8[: N - 8], idx))
    holes = idx.clone()
    holes[:, 100:400] = -1
    packed = torch.cat([holes[:, :100], holes[:, 400:], holes[:, 100:400]], 1)
    report(f"T={T} -1 holes mid-list vs the same list packed", flashmla(q, kv8, holes),
           flashmla(q, kv8, packed))
    far = idx.clone()
    far[:, -300:] = N + 5
    report(f"T={T} indices >= N vs -1 (Triton skips both)", o, flashmla(q, kv8, far))
    h = T // 2
    report(f"T={T} first {h} tokens alone vs in the batch", o[:h],
           flashmla(q[:h].contiguous(), kv8, idx[:h].contiguous()))
    tri = sparse_mla_attention_fp8_triton(q, kv8, idx, SCALE)[0]
    report(f"T={T} Triton: first {h} tokens alone vs in the batch", tri[:h],
           sparse_mla_attention_fp8_triton(q[:h].contiguous(), kv8, idx[:h].contiguous(),
                                           SCALE)[0])
    meta = flashmla_sched_meta()
    flashmla(q[:h], kv8, idx[:h], meta)
    try:
        flashmla(q, kv8, idx, meta)
        print(f"T={T} one sched_meta for two batch sizes: accepted")
    except Exception as e:  # noqa: BLE001  (FlashMLA asserts on it)
        print(f"T={T} one sched_meta for two batch sizes: {type(e).__name__}: {str(e)[:100]}")


def main() -> None:
    torch.manual_seed(0)
    kv8 = quantize_mla_rows_reference(torch.randn(N, 576, device="cuda").to(torch.bfloat16), 512)
    for T in (8, 24):
        probe(T, kv8)


if __name__ == "__main__":
    main()
