"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 under forced spills, one shared host pool
read by every rank, a killed rank stops the engine with a clear error (issue 16)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time

import pytest
import torch
from workload import prompts

from hisparse import LLM, SamplingParams
from hisparse.engine.llm import EngineDeadError
from hisparse.worker.model_runner import ModelRunner
from hisparse.worker.tp import TPRunner, pool_bytes

pytest.importorskip("transformers")



def tiny_pool(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
                num_gpu_blocks=30, hot_buffer_size=32, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, **base)


def sha1(t: torch.Tensor) -> str:
    return hashlib.sha1(pool_bytes(t).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("arch", ["dsv32", "glm"])
def test_tp2_greedy_matches_tp1_under_forced_spills_with_one_shared_host_pool(arch, request):
    path = request.getfixturevalue(f"{arch}_path")
    batch = prompts(8, 20, 120, seed=10)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(4, 30),
                             ignore_eos=True) for i in range(len(batch))]
    ref = tiny_pool(path)
    assert ref._tp is None and type(ref.runner) is ModelRunner     # TP=1: no process, as before
    want = [o.outputs[0].token_ids for o in ref.generate(batch, params)]

    llm = tiny_pool(path, tensor_parallel_size=2)
    try:
        assert isinstance(llm.runner, TPRunner)
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        assert got == want
        s = llm.stats()
        assert s["spilled_pages"] > 0 and s["host_read_switches"] > 0 and s["hot_misses"] > 0
        # One host pool for the node: its full size (not divided by N), in shared memory.
        cfg, geo = llm.kv_config, llm.caches.geo
        host = llm.caches.host
        size = cfg.num_host_blocks * cfg.block_size * geo.num_layers * geo.row_bytes
        assert host.is_shared() and llm.caches.host_indexer.is_shared()
        assert host.untyped_storage().nbytes() == size
        assert cfg.num_host_blocks == ref.kv_config.num_host_blocks
        (w1,) = llm.tp_worker_info(digest=True)
        assert w1["host_shared"] and w1["host_nbytes"] == size
        # Rank 1's resolver served the same misses from the pool; rank 0 alone wrote mirrors.
        assert w1["hot_misses"] == s["hot_misses"] > 0
        assert w1["d2h_bytes"] == 0 and s["d2h_bytes"] > 0
        assert w1["host_sha1"] == sha1(host)
        # Same mapping, not a copy: bytes rank 0 writes now are what rank 1 reads.
        pool_bytes(host)[:4096] = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        (w1,) = llm.tp_worker_info(digest=True)
        assert w1["host_sha1"] == sha1(host)
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm._tp.procs)
    with pytest.raises(EngineDeadError):
        llm.generate(batch[:1], params[0])


def test_tp_rank_killed_stops_the_engine_with_a_clear_error(dsv32_path):
    llm = tiny_pool(dsv32_path, tensor_parallel_size=2)
    try:
        (w1,) = llm.tp_worker_info()
        for p in prompts(4, 30, 60, seed=3):
            llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for _ in range(3):
            llm.step()
        os.kill(w1["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 .*died"):
            for _ in range(100):
                llm.step()
        assert time.monotonic() - t0 < 15
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.step()
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm._tp.procs)


def test_tp_argument_checks_happen_before_any_process_starts(dsv32_path):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tiny_pool(dsv32_path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_heads"):
        tiny_pool(dsv32_path, tensor_parallel_size=3)
