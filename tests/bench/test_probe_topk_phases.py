"""benchmarks/probe_topk_phases.py edits a copy of the top-k kernel's source: every phase of the
one-launch branch gets its stamp, the start where the program ran, and the edit adds only those,
the program order and the fitted splits (a stale marker would cost a GPU call)."""

from __future__ import annotations

import ast
import re

import pytest


def test_every_phase_stamped_and_nothing_else_changed(load_bench):
    probe = load_bench("probe_topk_phases")
    src = probe.SRC.read_text()
    text = probe.instrumented_source()
    ast.parse(text)
    stamp = r"tl\.store\(stamp_ptr \+ pid\.to\(tl\.int64\) \* \d+ \+ 2 \* \(([^)]*)\), _c\)"
    slots = re.findall(stamp, text)
    assert sorted(slots) == sorted(["0", "1", "2", "2 * L + 1", "2 * L + 2", "9", "10", "11",
                                    "12", "13"])
    assert len(probe.NAMES) == 14 and 2 * len(probe.NAMES) <= 2 * probe.SLOTS
    assert text.count("_sm = tl.inline_asm_elementwise('mov.u32 $0, %smid;'") == 1
    where = r"tl\.store\(stamp_ptr \+ pid\.to\(tl\.int64\) \* (\d+) \+ (\d+), "
    assert sorted(re.findall(where, text)) == [("32", "29"), ("32", "30"), ("32", "31")]
    assert text.count(probe.SPREAD) == 1
    text = text.replace(probe.SPREAD, "")
    for old, new in probe.FIT.items():
        assert text.count(new) == 1, new
        text = text.replace(new, old)
    kept = [line for line in text.splitlines(keepends=True)
            if not re.match(r"\s*(_c = |_g = |_sm = |tl\.store\(stamp_ptr)", line)]
    restored = "".join(kept).replace("stall_ptr, stamp_ptr, spread_g, fit_on,", "stall_ptr,")
    restored = restored.replace("scratch.stalls, _STAMPS, _SPREAD, _FIT, ", "scratch.stalls, ")
    restored = restored.split("\n_STAMPS = None")[0]
    assert restored == src


def test_placement_counts_each_sms_programs_and_key_blocks(load_bench):
    """Rows of 4,096 and 2,500 columns (4 and 3 blocks of 1,024) in 2 splits each: split 0
    takes 2 blocks of either, split 1 the rest (2 and 1); on SMs 0, 0, 1, 2 the busiest
    reads 4 blocks; adjacency follows the hardware ids (given out of order)."""
    import torch

    probe = load_bench("probe_topk_phases")

    def packed(row, sp, splits):
        return (row << 32) | (sp << 16) | splits

    where = torch.tensor([[2, 1, packed(1, 0, 2)], [0, 0, packed(0, 0, 2)],
                          [3, 2, packed(1, 1, 2)], [1, 0, packed(0, 1, 2)]], dtype=torch.int64)
    got = probe.placement(where, torch.tensor([4096, 2500]), 8192, 1024)
    assert got == {"sms": 3, "most_programs": 2, "busiest_blocks": 4, "mean_blocks": 7 / 3,
                   "next_on_same_sm": 1 / 3}


@pytest.mark.parametrize("spread", [1, 4])
@pytest.mark.parametrize("ranked", [True, False])
def test_program_order_and_fitted_splits_keep_the_selection(load_bench, kernel_switches,
                                                            spread, ranked):
    """The probe's kernel (without the stamps, which the interpreter cannot run) with its
    programs asked for in another order and the splits fitted to the longest live row
    selects what the reference does: one live row of 10 blocks takes 5 splits of the 8
    programs, two take 4 each (no fit), the order a permutation of the grid."""
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    kernel_switches(force_triton=True, topk="fused")
    probe = load_bench("probe_topk_phases")
    from kernel_copy import load_ops_module

    from hisparse.ops.topk import (
        TopkLaunch,
        TopkScratch,
        orderable_keys,
        topk_select,
        topk_select_reference,
    )
    name = "hisparse.ops._topk_triton"
    before = sys.modules.get(name)
    try:
        mod = load_ops_module("_topk_triton", text=probe.instrumented_source(stamps=False))
        mod._SPREAD, mod._FIT = spread, 1
        g = torch.Generator().manual_seed(spread)
        T, W, k = 8, 640, 48
        for lengths in ([600] + [0] * 7, [0, 0, 600, 0, 0, 333, 0, 0]):
            keys = orderable_keys(torch.randint(-40, 40, (T, W), generator=g).float())
            lens = torch.tensor(lengths, dtype=torch.int32)
            keys[torch.arange(W)[None, :] >= lens[:, None]] = 2**31 - 1   # never read
            scratch = TopkScratch(T, "cpu")
            scratch.split_hist.fill_(-5)
            got = topk_select(keys, lens, k, scratch=scratch, ranked=ranked,
                              launch=TopkLaunch(block=64, sort_chunk=16))
            assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=ranked))
            used = 5 if lengths[0] else 8                   # the split slots the programs wrote
            assert (scratch.split_hist[:used, 0] != -5).all()
            assert (scratch.split_hist[used:] == -5).all()
    finally:
        if before is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before
