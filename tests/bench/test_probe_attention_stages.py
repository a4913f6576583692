"""benchmarks/probe_attention_stages.py edits a copy of the attention kernel's source: every
edit must still match the package's kernel exactly once (a stale edit would cost a GPU call)."""

from __future__ import annotations

import inspect


def test_every_stage_edit_matches_the_kernel_once(load_bench):
    probe = load_bench("probe_attention_stages")
    src = probe.SRC.read_text()
    for name, (old, _new) in list(probe.EDITS.items()) + [("sum_rows", probe.SUM_ROWS)]:
        assert src.count(old) == 1, name
    assert set(probe.BITS) <= set(probe.EDITS) | set(probe.SWITCHED) | {"base"}
    for parts in [()] + [(n,) for n in probe.EDITS] + list(probe.COMBOS.values()):
        mod = probe.variant_module(tuple(parts))
        text = inspect.getsource(mod)
        assert (text == src) == (not parts), parts
        assert callable(mod.sparse_mla_attention_fp8_triton)
