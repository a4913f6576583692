"""benchmarks/probe_topk_phases.py edits a copy of the top-k kernel's source: every phase of the
one-launch branch gets its stamp, the start where the program ran, and the edit adds only those
and the register cap (a stale marker would cost a GPU call)."""

from __future__ import annotations

import ast
import re


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
    assert text.count(probe.CAP[1]) == 1
    text = text.replace(probe.CAP[1], probe.CAP[0])
    kept = [line for line in text.splitlines(keepends=True)
            if not re.match(r"\s*(_c = |_g = |_sm = |tl\.store\(stamp_ptr)", line)]
    restored = "".join(kept).replace("stall_ptr, stamp_ptr,", "stall_ptr,")
    restored = restored.replace("scratch.stalls, _STAMPS, ", "scratch.stalls, ")
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
