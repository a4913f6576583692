"""The engine keeps the cyclic GC off admitted requests' token lists (``gc.freeze()`` after
requests are added, after a young-generation collection only) without leaking: finished
requests are still freed while the heap is frozen (no reference cycles), the frozen set does
not grow with the number of requests served, admission never walks the old heap, and an idle
engine whose frozen set grew runs one full pass."""

from __future__ import annotations

import gc
import importlib.util
import pathlib
import weakref

import pytest

from hisparse import LLM, SamplingParams
from hisparse.engine.core import RequestFreezer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny(path, **kw):
    return LLM(path, device="cpu", dtype="float32", block_size=8, max_model_len=256,
               max_num_seqs=4, **kw)


def _tracked_ids() -> set[int]:
    """Objects the collector walks (frozen ones are in no generation)."""
    return {id(o) for o in gc.get_objects()}


def _step_until_finished(llm: LLM, req_id: str) -> None:
    for _ in range(200):
        if any(o.request_id == req_id and o.finished for o in llm.step()):
            return
    raise AssertionError(f"{req_id} did not finish")


def test_finished_requests_are_freed_while_frozen(dsv32_path):
    llm = tiny(dsv32_path)
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # A long request keeps the engine busy (so the heap stays frozen) while short ones come
    # and go.
    keep = llm.add_request({"prompt_token_ids": list(range(1, 40))}, long_params)
    llm.step()
    kept = llm._requests[keep]
    tracked = _tracked_ids()
    assert id(kept) not in tracked and id(kept.token_ids) not in tracked
    assert id(kept.prompt_token_ids) not in tracked     # the caller-visible prompt list too

    dead, counts = [], []
    for i in range(30):
        rid = llm.add_request({"prompt_token_ids": [3 + i % 7] * (20 + i)}, short)
        dead.append(weakref.ref(llm._requests[rid]))
        _step_until_finished(llm, rid)
        counts.append(gc.get_freeze_count())
    assert llm.has_unfinished_requests()        # still busy: nothing was unfrozen
    assert llm.core.freezer.freezes >= 31
    # Frozen objects are only freed by reference counting: every finished request went away
    # (the last one may still be held by the step in flight).
    alive = [r for r in dead[:-1] if r() is not None]
    assert not alive, f"{len(alive)} finished requests leaked (a reference cycle?)"
    # The frozen set is what is alive, not what was ever admitted (it grows by this test's
    # own weakrefs: one per round).
    assert counts[-1] - counts[4] <= 25 + 50, counts

    llm.abort(keep)
    del kept
    for _ in range(3):
        llm.step()
    assert not llm.has_unfinished_requests()
    assert all(r() is None for r in dead)


def test_gc_freeze_off_leaves_the_collector_alone(dsv32_path):
    llm = tiny(dsv32_path, gc_freeze=False)
    before = gc.get_freeze_count()
    rid = llm.add_request({"prompt_token_ids": list(range(1, 30))},
                          SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.step()
    req = llm._requests[rid]
    assert id(req.token_ids) in _tracked_ids()
    _step_until_finished(llm, rid)
    # no freeze: the permanent generation did not grow (it may shrink meanwhile: objects an
    # earlier test of this process froze are freed when the cycles holding them are collected)
    assert llm.core.freezer.freezes == 0 and gc.get_freeze_count() <= before
    with pytest.raises(ValueError, match="gc_freeze"):
        tiny(dsv32_path, gc_freeze="yes")


def test_admission_collects_only_young_generations(dsv32_path, monkeypatch):
    """A request reaching an idle engine must not pay for a walk of the whole heap (measured:
    ~220 ms at 460k objects when idle unfroze everything): only ``gc.collect(1)`` runs."""
    llm = tiny(dsv32_path)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 30}], sp)          # served once, now idle
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    outs = llm.generate([{"prompt_token_ids": [5] * 30}, {"prompt_token_ids": [7] * 12}], sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert outs[0].prompt_token_ids == [5] * 30 and type(outs[0].prompt_token_ids) is list
    assert calls == [(1,)], calls
    assert llm.core.freezer.freezes == 2 and gc.get_freeze_count() > 0


def test_idle_engine_runs_a_full_pass_once_the_frozen_set_grew(dsv32_path, monkeypatch):
    llm = tiny(dsv32_path)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 20}], sp)
    freezer = llm.core.freezer
    assert freezer.full_passes == 0 and freezer._baseline is not None
    monkeypatch.setattr(RequestFreezer, "FULL_PASS_MIN_GROWTH", 0)
    freezer._baseline = 1                    # pretend the frozen set has grown a lot
    cycle = []
    probe = weakref.ref(_Cyclic(cycle))
    gc.freeze()                              # frozen, as an earlier admission would have
    del cycle                                # now cyclic garbage among frozen objects
    gc.collect(1)
    assert probe() is not None               # young collections never reach it
    llm.generate([{"prompt_token_ids": [6] * 20}], sp)   # admits (freezes), then goes idle
    assert freezer.full_passes == 1 and freezer._baseline is None
    assert probe() is None                   # the idle full pass reclaimed it
    llm.generate([{"prompt_token_ids": [7] * 20}], sp)
    assert freezer.full_passes == 1          # grew by less than twice: no second pass


class _Cyclic:
    def __init__(self, ref):
        self.ref = ref
        ref.append(self)


def test_bench_engine_reports_gc_and_freezes():
    spec = importlib.util.spec_from_file_location(
        "bench_scheduler", ROOT / "benchmarks" / "bench_scheduler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for freeze in (False, True):
        gc.unfreeze()   # the benchmark leaves its engine busy (frozen) on purpose
        res = bench.run_engine(requests=4, context=300, block_size=16, steps=6,
                               mode="always-host", gc_freeze=freeze)
        assert set(res["gc_during_steps"]) == {"gen0", "gen1", "gen2"}
        total = res["ms_per_step"]["total"]
        assert total["max"] >= total["p99"] >= total["median"] > 0
        assert (res["gc_frozen_objects"] > 0) == freeze
    gc.unfreeze()


def test_shutdown_frees_the_engine_frozen_with_its_requests(dsv32_path):
    """The engine's own objects are frozen along with its requests' lists, and the runner and
    captured graphs sit in reference cycles: dropping a frozen engine freed nothing (a benchmark
    creating one engine per point ran out of GPU memory). ``shutdown`` must free them."""
    with tiny(dsv32_path) as llm:
        llm.generate([{"prompt_token_ids": list(range(1, 30))}],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert llm.core.freezer.freezes >= 1 and gc.get_freeze_count() > 0
        # a cycle through the caches, like the graphs <-> runner one on CUDA
        llm.runner.caches.back_reference = llm.runner
        caches = weakref.ref(llm.runner.caches)
        model = weakref.ref(llm.model)
    assert caches() is None and model() is None
    assert not llm.has_unfinished_requests()
    with pytest.raises(Exception, match="shut down"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1))
    with pytest.raises(Exception, match="shut down"):
        llm.stats()
    llm.shutdown()      # idempotent
