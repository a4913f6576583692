"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 under forced spills, one shared host pool
read by every rank, a killed rank stops the engine with a clear error (issue 16); plans travel
to the other ranks as changed table rows only, in order.

``python tests/engine/test_tp.py`` prints the per-step message size at a production-like size
(:func:`decode_message_bytes`)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from workload import prompts

from hisparse import LLM, SamplingParams
from hisparse.config import KVCacheConfig
from hisparse.engine.llm import EngineDeadError
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.simulate import Simulation
from hisparse.kv.plan import TABLES
from hisparse.worker.model_runner import ModelRunner
from hisparse.worker.tp import (
    PlanMessage,
    PlanOrderError,
    RankTables,
    TPRunner,
    plan_message,
    pool_bytes,
    table_sha1,
)

pytest.importorskip("transformers")


def wire_bytes(*cmd) -> int:
    """Bytes of one command as the pipe sends it (``Connection.send`` pickles with
    ``ForkingPickler``)."""
    return len(ForkingPickler.dumps(cmd))


def table_bytes(plan) -> int:
    return sum(getattr(plan, f"{n}_block_table").nbytes for n in TABLES)


def decode_message_bytes(num_seqs: int = 256, pages: int = 1024, block_size: int = 64,
                         steps: int = 120, num_gpu_blocks: int | None = None, seed: int = 0
                         ) -> dict:
    """Micro-benchmark: pickled bytes per decode step of the ``execute`` command rank 0 sends
    each rank, before (the whole plan, four tables included) and after (:class:`PlanMessage`),
    on real plans of the KV core at a production-like size (``num_seqs`` x ``pages`` tables;
    ~2k-token prompts, every mirror acknowledged at once)."""
    cfg = KVCacheConfig(block_size=block_size,
                        num_gpu_blocks=num_gpu_blocks or num_seqs * 40 + 1000,
                        num_host_blocks=num_seqs * 48, num_indexer_blocks=num_seqs * 48,
                        max_model_len=block_size * pages, index_topk=2048,
                        hot_buffer_size=4096, max_num_seqs=num_seqs,
                        max_num_batched_tokens=16384)
    sched = Scheduler(cfg)
    rng = random.Random(seed)
    for i in range(num_seqs):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1500, 2500))]
        sched.add(Request(f"req-{i}", prompt, max_tokens=400, max_len=len(prompt) + 400))
    acks, before, after, host_read = [], [], [], 0
    for seq in range(steps):
        plan = sched.schedule(acks)
        acks = [plan.mirrors.copy_id] if len(plan.mirrors) else []
        ids = [rng.randrange(1000) for s in plan.seqs for _ in range(s.num_tokens)]
        if all(s.num_tokens == 1 for s in plan.seqs):
            before.append(wire_bytes("execute", plan, ids))
            after.append(wire_bytes("execute", plan_message(plan, ids, seq)))
            host_read = max(host_read, sum(s.host_read for s in plan.seqs))
        sched.update(plan, [1 for s in plan.seqs if s.sample])
    return {"decode_steps": len(before), "batch": len(plan.seqs), "host_read": host_read,
            "table_bytes": table_bytes(plan), "before": sum(before) / len(before),
            "after": sum(after) / len(after), "after_max": max(after)}



def tiny_pool(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
                num_gpu_blocks=30, hot_buffer_size=32, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, **base)


def sha1(t: torch.Tensor) -> str:
    return hashlib.sha1(pool_bytes(t).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("arch,kv", [("dsv32", "bf16"), ("glm", "bf16"), ("dsv32", "fp8")])
def test_tp2_greedy_matches_tp1_under_forced_spills_with_one_shared_host_pool(arch, kv, request):
    path = request.getfixturevalue(f"{arch}_path")
    batch = prompts(8, 20, 120, seed=10)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(4, 30),
                             ignore_eos=True) for i in range(len(batch))]
    ref = tiny_pool(path, kv_cache_dtype=kv)
    assert ref._tp is None and type(ref.runner) is ModelRunner     # TP=1: no process, as before
    want = [o.outputs[0].token_ids for o in ref.generate(batch, params)]

    llm = tiny_pool(path, tensor_parallel_size=2, kv_cache_dtype=kv)
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


def test_plan_messages_carry_changed_rows_only_and_rebuild_every_plan():
    """Every plan of a KV-core run with spills, host-read mode, preemptions and aborts, sent as
    a (pickled) PlanMessage: the rank's copy of the tables equals the plan's after each one,
    and the tables' rows travel only for the changed slots."""
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=40, num_host_blocks=100,
                        num_indexer_blocks=100, max_model_len=64, index_topk=4,
                        hot_buffer_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    sim = Simulation(cfg, seed=5)
    rng = random.Random(5)
    rank = RankTables(1)
    sent = aborts = 0
    for _ in range(40):
        sim.add([rng.randrange(50) for _ in range(rng.randrange(5, 40))], rng.randrange(1, 20))
    while sim.scheduler.has_unfinished:
        running = sim.scheduler.running
        if running and rng.random() < 0.05:
            sim.preempt(rng.choice(running).req_id)
        if running and rng.random() < 0.03:
            sim.abort(rng.choice(running).req_id)
            aborts += 1
        plan = sim.scheduler.schedule(sim.acks)
        sim.acks = sim.worker.execute(plan)
        if plan is None:
            continue
        ids = list(range(sum(s.num_tokens for s in plan.seqs)))
        msg = ForkingPickler.loads(ForkingPickler.dumps(plan_message(plan, ids, sent)))
        assert isinstance(msg, PlanMessage) and msg.input_ids == ids
        assert (msg.shapes is not None) == (sent == 0)
        for name, rows in zip(TABLES, msg.rows):
            assert getattr(msg.plan, f"{name}_block_table") is None
            assert (0 if rows is None else len(rows)) == getattr(plan.changed_rows, name).size
        got = rank.apply(msg)
        sent += 1
        # (the KV core's tables are live arrays: snapshot what this plan carried)
        last = {n: table_sha1(getattr(plan, f"{n}_block_table")) for n in TABLES}
        for name in TABLES:
            assert np.array_equal(getattr(got, f"{name}_block_table"),
                                  getattr(plan, f"{name}_block_table")), (sent, name)
        assert got.seqs == plan.seqs and got.step_id == plan.step_id
        tokens = [rng.randrange(50) for s in plan.seqs if s.sample]
        sim.finished += sim.scheduler.update(plan, tokens).finished
    st = sim.stats()
    assert st["host_read_switches"] > 0 and st["spilled_pages"] > 0
    assert st["num_preempted"] > 0 and aborts > 0
    assert rank.applied == sent
    assert rank.digest() == last


def test_a_plan_out_of_order_is_an_error():
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=40, num_host_blocks=100,
                        num_indexer_blocks=100, max_model_len=64, index_topk=4,
                        hot_buffer_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    sim = Simulation(cfg, seed=1)
    sim.add(list(range(30)), 5)
    plans = []
    for _ in range(3):
        plan = sim.scheduler.schedule(sim.acks)
        sim.acks = sim.worker.execute(plan)
        plans.append(plan_message(plan, [0] * sum(s.num_tokens for s in plan.seqs),
                                  len(plans)))
        sim.scheduler.update(plan, [1 for s in plan.seqs if s.sample])
    rank = RankTables(1)
    with pytest.raises(PlanOrderError, match=r"rank 1 received plan #1 .* expected plan #0"):
        rank.apply(plans[1])                 # the first plan (and its shapes) never came
    rank.apply(plans[0])
    with pytest.raises(PlanOrderError, match=r"received plan #2 .* expected plan #1: every "
                                             r"rank must execute every plan, in order"):
        rank.apply(plans[2])                 # a plan skipped
    rank.apply(plans[1])
    with pytest.raises(PlanOrderError, match="received plan #1"):
        rank.apply(plans[1])                 # a plan repeated


def test_plan_message_is_far_below_the_tables_at_production_size():
    """256 requests x 1024 pages: the four tables are ~3.2 MB, a decode step's message tens of
    KB (the batch, its mirror row lists and a few changed table rows)."""
    m = decode_message_bytes(steps=60)
    assert m["decode_steps"] >= 20 and m["batch"] >= 200
    assert m["before"] > m["table_bytes"] > 3_000_000
    assert m["after_max"] < m["table_bytes"] / 20


def test_tp2_rank_tables_equal_rank_0s_after_spills_preemptions_and_aborts(dsv32_path):
    """Through the real engine (gloo): every message after the first carries far fewer bytes
    of table rows than the tables, and rank 1's tables equal the last plan's, having applied
    every plan rank 0 sent."""
    llm = tiny_pool(dsv32_path, tensor_parallel_size=2)
    try:
        runner = llm.runner
        sends, last, executed = [], {}, []
        real_send, real_execute = llm._tp.send, runner.execute

        def send(*cmd):                  # bytes on the wire, bytes of table rows
            if cmd[0] == "execute":
                sends.append((wire_bytes(*cmd), sum(r.nbytes for r in cmd[1].rows
                                                    if r is not None)))
            real_send(*cmd)

        def execute(plan, input_ids):    # the tables as this plan carried them
            executed.append(plan.step_id)
            last.update({n: getattr(plan, f"{n}_block_table").copy() for n in TABLES})
            return real_execute(plan, input_ids)

        llm._tp.send = send
        runner.execute = execute
        rng = random.Random(4)
        live, aborts, preempts = [], 0, 0
        for p in prompts(16, 20, 120, seed=4):
            live.append(llm.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True,
                                                          max_tokens=rng.randrange(4, 40))))
        while llm.has_unfinished_requests():
            running = llm.scheduler.running
            if running and rng.random() < 0.08 and llm.scheduler.preempt(
                    rng.choice(running).req_id):
                preempts += 1
            if running and rng.random() < 0.04:
                llm.abort(rng.choice(running).req_id)
                aborts += 1
            llm.step()
        s = llm.stats()
        assert s["spilled_pages"] > 0 and s["host_read_switches"] > 0
        assert preempts > 0 and aborts > 0
        (w1,) = llm.tp_worker_info(digest=True)
        assert w1["plans_applied"] == runner.plans_sent == len(sends) == len(executed)
        assert w1["tables_sha1"] == {n: table_sha1(t) for n, t in last.items()}
        full = sum(t.nbytes for t in last.values())
        rows_bytes = [b for _, b in sends[1:]]
        assert sum(rows_bytes) < 0.25 * full * len(rows_bytes)
        assert min(rows_bytes) == 0           # steps that changed no row send none
    finally:
        llm.shutdown()


if __name__ == "__main__":
    for gpu_blocks in (None, 8000):
        m = decode_message_bytes(steps=400, num_gpu_blocks=gpu_blocks)
        print(f"num_gpu_blocks={gpu_blocks or 'ample'}: {m['decode_steps']} decode steps of "
              f"{m['batch']} requests ({m['host_read']} host-read); tables "
              f"{m['table_bytes'] / 1e6:.2f} MB; execute message per step: before "
              f"{m['before'] / 1e6:.2f} MB, after {m['after'] / 1e3:.1f} KB mean, "
              f"{m['after_max'] / 1e3:.1f} KB max ({m['before'] / m['after']:.0f}x smaller)")
