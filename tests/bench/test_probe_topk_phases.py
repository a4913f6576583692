"""benchmarks/probe_topk_phases.py edits a copy of the top-k kernel's source: every phase of the
one-launch branch gets its stamp, and the edit adds only the stamps (a stale marker would cost a
GPU call)."""

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
    kept = [line for line in text.splitlines(keepends=True)
            if not re.match(r"\s*(_c = |_g = |tl\.store\(stamp_ptr)", line)]
    restored = "".join(kept).replace("stall_ptr, stamp_ptr,", "stall_ptr,")
    restored = restored.replace("scratch.stalls, _STAMPS, ", "scratch.stalls, ")
    restored = restored.split("\n_STAMPS = None")[0]
    assert restored == src
