import pytest
import torch

from hisparse.ops import copy_rows, gather_rows


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
