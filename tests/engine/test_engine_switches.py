"""An engine runs the kernel switches of its start (hisparse.ops.switches): a variable changed
later changes nothing it runs, the next engine in the process follows the new environment, an
override at its start applies, and tensor-parallel ranks run rank 0's switches."""

from __future__ import annotations

import dataclasses

import pytest
from workload import prompts, tokens

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint
from hisparse.ops import switches

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def tiny(path, **kw):
    return LLM(path, device="cpu", dtype="float32", block_size=8, max_model_len=96,
               max_num_seqs=4, **kw)


@pytest.fixture
def seen(monkeypatch):
    """Every switches object an op read (``switches.current()`` calls) from now on."""
    out = []
    real = switches.current

    def current():
        s = real()
        out.append(s)
        return s

    monkeypatch.setattr(switches, "current", current)
    return out


def test_a_variable_changed_after_the_start_changes_nothing_the_engine_runs(dsv32_path,
                                                                            monkeypatch, seen):
    batch = prompts(2, 10, 20, seed=3)
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "reference")
    monkeypatch.setenv("HISPARSE_TOPK", "phased")
    llm = tiny(dsv32_path)
    try:
        assert (llm.switches.fp8_gemm, llm.switches.topk) == ("reference", "phased")
        want = tokens(llm.generate(batch, GREEDY))
        # on CPU these would switch the step to Triton kernels (HISPARSE_FORCE_TRITON) and to
        # a top-k mode that does not exist, had the step read them
        monkeypatch.setenv("HISPARSE_FORCE_TRITON", "1")
        monkeypatch.setenv("HISPARSE_FUSED_GLUE", "0")
        monkeypatch.setenv("HISPARSE_TOPK", "bitonic")
        seen.clear()
        assert tokens(llm.generate(batch, GREEDY)) == want
        assert seen and all(s is llm.switches for s in seen), len(seen)
    finally:
        llm.shutdown()
    # the next engine reads the environment at its start: a bad value is refused there, by name
    with pytest.raises(ValueError, match="HISPARSE_TOPK='bitonic'"):
        tiny(dsv32_path)
    monkeypatch.delenv("HISPARSE_TOPK")
    monkeypatch.delenv("HISPARSE_FORCE_TRITON")
    llm = tiny(dsv32_path)
    try:
        assert not llm.switches.fused_glue and llm.switches.topk == "fused"
        seen.clear()
        llm.generate(batch[:1], GREEDY)
        assert seen and all(s is llm.switches for s in seen)
    finally:
        llm.shutdown()


def test_an_override_at_the_start_is_what_the_engine_and_its_tp_ranks_run(dsv32_path):
    with switches.override(fp8_gemm="reference", fused_moe=False, topk="legacy"):
        llm = tiny(dsv32_path, tensor_parallel_size=2)
        try:
            assert (llm.switches.fp8_gemm, llm.switches.fused_moe,
                    llm.switches.topk) == ("reference", False, "legacy")
            (w1,) = llm.tp_worker_info()
            # rank 1's process never saw the override in its environment: it got rank 0's
            assert w1["switches"] == dataclasses.asdict(llm.switches)
        finally:
            llm.shutdown()


def _gpu_checkpoint(tmp_path, seed):
    """A 2-layer V3.2-shaped random checkpoint whose requests outgrow its top-k (64)."""
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path, "deepseek_v32", seed=seed, hidden_size=256,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  q_lora_rank=128, num_hidden_layers=2, **geo)


def _gpu_engine(path):
    return LLM(path, device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
               max_num_seqs=4, max_num_batched_tokens=256)


@pytest.mark.gpu
def test_gpu_eager_and_replayed_steps_keep_the_start_switches(tmp_path, monkeypatch, seen):
    """CUDA, decode graphs captured at the start: variables flipped afterwards (each picks other
    kernels: reference GEMMs, unfused glue and MoE, the legacy top-k, untuned GEMMs) change
    neither the eager (prefill) nor the replayed (decode) steps: the same greedy tokens, and
    every op read the start's switches."""
    path = _gpu_checkpoint(tmp_path, seed=5)
    batch = prompts(4, 100, 200, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = _gpu_engine(path)
    try:
        assert llm.runner.graphs is not None and llm.runner.graphs.capture
        want = tokens(llm.generate(batch, sp))
        for env, value in {"HISPARSE_FP8_GEMM": "reference", "HISPARSE_FUSED_GLUE": "0",
                           "HISPARSE_FUSED_MOE": "0", "HISPARSE_TOPK": "legacy",
                           "HISPARSE_TRITON_AUTOTUNE": "0"}.items():
            monkeypatch.setenv(env, value)
        seen.clear()
        assert tokens(llm.generate(batch, sp)) == want
        assert seen and all(s is llm.switches for s in seen), len(seen)
    finally:
        llm.shutdown()


def test_an_engine_started_beside_a_live_one_under_other_switches_is_warned(dsv32_path,
                                                                           monkeypatch, caplog):
    first = tiny(dsv32_path)
    try:
        monkeypatch.setenv("HISPARSE_FP8_GEMM", "reference")
        with caplog.at_level("WARNING", logger="hisparse"):
            second = tiny(dsv32_path)
        second.shutdown()
        assert any("fp8_gemm='reference'" in r.getMessage() and "still alive" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        first.shutdown()
    caplog.clear()
    with caplog.at_level("WARNING", logger="hisparse"):       # nobody alive: no warning
        tiny(dsv32_path).shutdown()
    assert not any("still alive" in r.getMessage() for r in caplog.records)
