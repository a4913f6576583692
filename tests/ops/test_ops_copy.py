import pytest
import torch

from hisparse.ops import FP8KeyLayout, copy_index_keys, copy_rows, gather_rows
from hisparse.ops.quant import quantize_index_keys_reference


def packed_views(L, rows, D, dtype, seed, device="cpu", pin=False):
    """A packed [2, L, rows, D] allocation; return the view of its second half (layer offsets
    must come from the view's own strides, not from the allocation's start)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, L, rows + 2, D, generator=g).to(dtype)
    if pin:
        base = base.pin_memory()
    base = base.to(device) if device != "cpu" else base
    return base, base[1, :, 1:rows + 1]


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 576), (torch.uint8, 656), (torch.float32, 5)])
def test_triton_interpreter_copy_rows(triton_cpu, dtype, D):
    L, rows = 3, 40
    if dtype == torch.uint8:
        src_base = torch.randint(0, 255, (2, L, rows + 2, D), dtype=torch.uint8)
        src = src_base[1, :, 1:rows + 1]
    else:
        src_base, src = packed_views(L, rows, D, dtype, 1)
    dst_base = torch.full((2, L, rows + 2, D), 77).to(dtype)
    dst = dst_base[1, :, 1:rows + 1]
    sr = torch.tensor([3, 0, 39, 17, 5])
    dr = torch.tensor([1, 2, 30, 38, 0])
    snapshot = dst_base.clone()
    copy_rows(src, dst, sr, dr)
    expect = snapshot.clone()
    expect[1, :, 1:rows + 1][:, dr] = src[:, sr]
    assert torch.equal(dst_base, expect)


def test_host_to_host_and_reference(no_force):
    src_base, src = packed_views(2, 10, 16, torch.float32, 2)
    dst = torch.zeros(2, 12, 16)
    copy_rows(src, dst, torch.tensor([1, 9]), torch.tensor([11, 0]))
    assert torch.equal(dst[:, 11], src[:, 1]) and torch.equal(dst[:, 0], src[:, 9])
    assert (dst[:, 1:11] == 0).all()


def test_gather_rows_interpreter(triton_cpu):
    h = torch.randint(0, 255, (50, 656), dtype=torch.uint8)
    rows = torch.randint(0, 50, (9,))
    out = torch.zeros(9, 656, dtype=torch.uint8)
    gather_rows(h, rows, out)
    assert torch.equal(out, h[rows])


def key_pages(L, blocks, D, bs, seed, pad=(1, 2)):
    """Packed ``[2, L, blocks + sum(pad), page]`` uint8 allocation of random valid FP8 key pages;
    returns (allocation, the view of its second half minus ``pad`` blocks, row-format keys of
    the view ``[L, blocks * bs, key_bytes]``)."""
    g = torch.Generator().manual_seed(seed)
    lay = FP8KeyLayout(D, bs)
    nb = blocks + sum(pad)
    keys = quantize_index_keys_reference(torch.randn(2 * L * nb * bs, D, generator=g) * 3)
    base = lay.pages(keys).view(2, L, nb, lay.page_bytes).clone()
    view = base[1, :, pad[0]:pad[0] + blocks]
    rows = keys.view(2, L, nb * bs, -1)[1, :, pad[0] * bs:(pad[0] + blocks) * bs]
    return base, view, rows


@pytest.mark.parametrize("D,bs", [(128, 8), (32, 4), (256, 2), (128, 1)])
@pytest.mark.parametrize("path", ["triton", "reference"])
def test_fp8_key_copy_round_trip(kernel_switches, D, bs, path):
    """Page-split FP8 keys GPU -> host (mirror) -> GPU (restore at other blocks), layer views
    at their own offsets, random rows: every copied key arrives whole (values and scale),
    nothing else changes."""
    if path == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("interpreter tests run on CPU-only machines")
        kernel_switches(force_triton=True)
    else:
        kernel_switches(force_triton=False)
    lay = FP8KeyLayout(D, bs)
    L, blocks = 3, 6
    gpu_base, gpu, gpu_keys = key_pages(L, blocks, D, bs, seed=D + bs)
    host_base, host, _ = key_pages(L, blocks + 2, D, bs, seed=7, pad=(2, 1))
    n = blocks * bs
    src = torch.randperm(n)[:n // 2 + 1]
    mid = torch.randperm((blocks + 2) * bs)[:src.numel()]
    host_before = host_base.clone()
    copy_index_keys(gpu, host, src, mid, D)                         # mirror
    assert torch.equal(lay.gather(host, mid), gpu_keys[:, src])
    changed = (host_base != host_before).view(2, L, -1).sum(-1)
    assert changed[0].sum() == 0 and (changed[1] <= src.numel() * lay.key_bytes).all()
    back_base, back, back_keys = key_pages(L, blocks, D, bs, seed=11)
    before = back_base.clone()
    dst = torch.randperm(n)[:src.numel()]
    copy_index_keys(host, back, mid, dst, D)                        # restore
    assert torch.equal(lay.gather(back, dst), gpu_keys[:, src])
    keep = torch.ones(n, dtype=torch.bool)
    keep[dst] = False
    assert torch.equal(lay.gather(back, keep.nonzero().squeeze(1)), back_keys[:, keep])
    assert torch.equal(back_base[0], before[0])
    assert torch.equal(back_base[1, :, :1], before[1, :, :1])       # pad blocks untouched
    assert torch.equal(back_base[1, :, -2:], before[1, :, -2:])


def test_key_copy_checks_layouts_and_keeps_bf16_keys_rows(no_force):
    a = torch.zeros(2, 4, 8 * 132, dtype=torch.uint8)
    with pytest.raises(ValueError, match="incompatible"):
        copy_index_keys(a, torch.zeros(2, 8, 4 * 132, dtype=torch.uint8), torch.tensor([0]),
                        torch.tensor([0]), 128)
    src = torch.randn(2, 10, 16)
    dst = torch.zeros(2, 10, 16)
    copy_index_keys(src, dst, torch.tensor([3, 4]), torch.tensor([9, 0]), 16)
    assert torch.equal(dst[:, [9, 0]], src[:, [3, 4]]) and (dst[:, 1:9] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_gpu_fp8_key_copy_pinned(direction):
    """Production pages (block 64, D 128) between pinned host and GPU, random rows."""
    L, blocks, D, bs = 4, 512, 128, 64
    lay = FP8KeyLayout(D, bs)
    src_base, src, src_keys = key_pages(L, blocks, D, bs, seed=5)
    dst_base, dst, _ = key_pages(L, blocks, D, bs, seed=6)
    src_base = src_base.pin_memory() if direction == "h2d" else src_base.cuda()
    dst_base = dst_base.pin_memory() if direction == "d2h" else dst_base.cuda()
    src, dst = src_base[1, :, 1:blocks + 1], dst_base[1, :, 1:blocks + 1]
    before = dst_base.cpu()
    n = 5000
    sr = torch.randperm(blocks * bs)[:n]
    dr = torch.randperm(blocks * bs)[:n]
    copy_index_keys(src, dst, sr.cuda(), dr.cuda(), D)
    torch.cuda.synchronize()
    expect = before.clone()
    lay.scatter(expect[1, :, 1:blocks + 1], dr, src_keys[:, sr])
    assert torch.equal(dst_base.cpu(), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_gpu_copy_rows_pinned(direction):
    L, rows, D = 4, 4096, 576
    src_dev = "cpu" if direction == "h2d" else "cuda"
    dst_dev = "cpu" if direction == "d2h" else "cuda"
    src_base, src = packed_views(L, rows, D, torch.bfloat16, 3, device=src_dev,
                                 pin=src_dev == "cpu")
    dst_base, dst = packed_views(L, rows, D, torch.bfloat16, 4, device=dst_dev,
                                 pin=dst_dev == "cpu")
    before = dst_base.clone()
    n = 1000
    sr = torch.randperm(rows)[:n]
    dr = torch.randperm(rows)[:n]
    copy_rows(src, dst, sr.cuda(), dr.cuda())
    torch.cuda.synchronize()
    expect = before.cpu()
    expect[1, :, 1:rows + 1][:, dr] = src.cpu()[:, sr]
    assert torch.equal(dst_base.cpu(), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes", [1152, 656])
def test_gpu_gather_rows_pinned(row_bytes):
    h = torch.randint(0, 255, (100_000, row_bytes), dtype=torch.uint8).pin_memory()
    rows = torch.randint(0, 100_000, (5000,), device="cuda")
    out = torch.full((5000, row_bytes), 7, dtype=torch.uint8, device="cuda")
    gather_rows(h, rows, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), h[rows.cpu()])
