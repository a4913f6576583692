"""Prefill/decode disaggregation over NIXL (issue 23), engine level: two engines in one
process, real NIXL over UCX on loopback; greedy outputs equal a colocated run."""

from __future__ import annotations

import socket
import time

import pytest
from workload import prompts, tokens

from hisparse import LLM, SamplingParams

pytest.importorskip("nixl_cu13")
# NIXL listeners on free ports: these run on one pytest-xdist worker, one at a time
pytestmark = pytest.mark.xdist_group("nixl")

N_OUT = 12


_ENGINES: list[LLM] = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    """Every engine of a test is shut down after it (its NIXL agent and listener go too)."""
    yield
    while _ENGINES:
        _ENGINES.pop().shutdown()


def engine(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
                num_gpu_blocks=60, hot_buffer_size=32, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    llm = LLM(path, **base)
    _ENGINES.append(llm)
    return llm


def greedy(n=N_OUT, kv=None):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=kv)


def prefill(p, batch):
    outs = p.generate(batch, greedy(kv={"do_remote_decode": True}))
    return [o.kv_transfer_params for o in outs], [o.outputs[0].token_ids for o in outs]


def poison(llm):
    """Random bytes in every tier: rows the transfer failed to land would change outputs."""
    c = llm.caches
    for t in (c.arena, c.indexer, c.host, c.host_indexer):
        t.normal_()


def wait_released(p, n):
    for _ in range(500):
        p.service_kv_transfer()
        if not p.disagg.held:
            break
        time.sleep(0.01)
    assert p.disagg.metrics.released == n


def assert_pools_full(llm):
    s = llm.stats()
    cfg = llm.kv_config
    assert (s["free_gpu_blocks"], s["free_host_blocks"], s["free_indexer_blocks"]) == (
        cfg.num_gpu_blocks, cfg.num_host_blocks, cfg.num_indexer_blocks)


@pytest.mark.parametrize("decode_gpu_blocks", [60, 16])
def test_prefill_to_decode_equals_colocated(dsv32_path, decode_gpu_blocks):
    batch = prompts(6, 20, 110, seed=3)
    want = tokens(engine(dsv32_path).generate(batch, greedy()))
    p = engine(dsv32_path, kv_role="prefill")
    d = engine(dsv32_path, kv_role="decode", num_gpu_blocks=decode_gpu_blocks)
    poison(d)
    params, first = prefill(p, batch)
    assert all(len(f) == 1 for f in first)
    assert [f[0] for f in first] == [w[0] for w in want]
    outs = d.generate(batch, [greedy(kv=kv) for kv in params])
    assert tokens(outs) == want
    m = d.disagg.metrics
    assert m.requests == len(batch) and m.failures == 0 and m.bytes > 0
    if decode_gpu_blocks == 60:
        assert m.rows_gpu == sum(len(b["prompt_token_ids"]) for b in batch)
    else:
        assert m.rows_host > 0 and d.stats()["host_read_switches"] > 0
        assert d.stats()["hot_misses"] > 0
    wait_released(p, len(batch))
    assert_pools_full(p)
    assert_pools_full(d)
    # The landed rows and keys reached the decode's host pool and their hashes were published
    # (I3): the same prompts, colocated on the decode instance, hit its prefix cache.
    hits = d.stats()["prefix_hit_tokens"]
    assert tokens(d.generate(batch, greedy())) == want
    assert d.stats()["prefix_hit_tokens"] - hits >= sum(
        (len(b["prompt_token_ids"]) - 1) // 8 * 8 for b in batch)
    assert_pools_full(d)


@pytest.fixture(scope="module")
def small_batch():
    return prompts(3, 20, 60, seed=5)


@pytest.fixture(scope="module")
def colocated(dsv32_path, small_batch):
    return tokens(engine(dsv32_path).generate(small_batch, greedy()))


@pytest.mark.parametrize("failure,policy", [("hash", "recompute"), ("dead-prefill", "recompute"),
                                            ("timeout", "recompute"), ("hash", "fail")])
def test_failed_load_recomputes_or_fails_and_leaks_nothing(dsv32_path, small_batch, colocated,
                                                            failure, policy):
    p = engine(dsv32_path, kv_role="prefill", kv_hold_timeout_s=0.5)
    d = engine(dsv32_path, kv_role="decode", kv_load_failure=policy, kv_load_timeout_s=0.5)
    params, _ = prefill(p, small_batch)
    # the ports the loads are sent to stay held by this test (a port given back to the kernel
    # can go to another test process's listener at once, which would then answer)
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if failure == "hash":
        params = [dict(kv, compat_hash="0" * 32) for kv in params]
    elif failure == "timeout":      # a listener that never answers: the handshake times out
        held.bind(("127.0.0.1", 0))
        held.listen(16)
        params = [dict(kv, remote_port=held.getsockname()[1]) for kv in params]
    else:                           # the prefill is gone and its port refuses connections
        p.shutdown()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", params[0]["remote_port"]))
        except OSError:             # still closing: nobody else can have it either
            pass
    try:
        outs = d.generate(small_batch, [greedy(kv=kv) for kv in params])
    finally:
        held.close()
    assert d.disagg.metrics.failures == len(small_batch) and d.disagg.metrics.requests == 0
    if policy == "recompute":
        assert tokens(outs) == colocated
    else:
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "error" and c.token_ids == [] and c.error
            want = "hash mismatch" if failure == "hash" else "timed out"
            assert want in c.error, c.error
    assert_pools_full(d)
    if failure != "dead-prefill":   # the decode never read: the prefill's timeout frees them
        time.sleep(0.6)
        p.service_kv_transfer()
        assert p.disagg.metrics.expired == len(small_batch) and not p.disagg.held
        assert_pools_full(p)


def test_bad_kv_transfer_params_are_refused(dsv32_path, small_batch):
    d = engine(dsv32_path, kv_role="decode")
    ids = small_batch[0]
    with pytest.raises(ValueError, match="do_remote_decode needs an instance"):
        d.add_request(ids, greedy(kv={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="remote_block_ids"):
        d.add_request(ids, greedy(kv={"do_remote_prefill": True}))
    with pytest.raises(ValueError, match="kv_role"):
        engine(dsv32_path).add_request(ids, greedy(kv={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="kv_role must be"):
        engine(dsv32_path, kv_role="both")
    with pytest.raises(ValueError, match="host tier"):
        engine(dsv32_path, kv_role="decode", mode="gpu-only")
    assert not d.has_unfinished_requests()


def test_abort_while_loading_and_a_one_token_decode(dsv32_path, small_batch, colocated):
    p = engine(dsv32_path, kv_role="prefill")
    d = engine(dsv32_path, kv_role="decode")
    params, _ = prefill(p, small_batch[:2])
    rid = d.add_request(small_batch[0], greedy(kv=params[0]))
    d.step()                                    # admitted: waiting for remote KV
    assert rid in d.scheduler.loading
    d.abort(rid)
    while d.has_unfinished_requests():          # the load ends (cancelled), then its blocks
        d.step()
    assert_pools_full(d)
    assert d.disagg.metrics.failures == 0
    # max_tokens=1: the prefill's first token is the whole answer
    out = d.generate([small_batch[1]], greedy(n=1, kv=params[1]))[0]
    assert out.outputs[0].token_ids == [colocated[1][0]] and out.outputs[0].finish_reason == \
        "length"
    assert_pools_full(d)
    d.service_kv_transfer()     # the aborted load's notice, once the handshake is done
    wait_released(p, 2)
    assert_pools_full(p)


def test_decode_prefix_hits_are_not_pulled(dsv32_path, small_batch, colocated):
    p = engine(dsv32_path, kv_role="prefill")
    d = engine(dsv32_path, kv_role="decode")
    assert tokens(d.generate(small_batch, greedy())) == colocated   # publishes the prompts
    params, _ = prefill(p, small_batch)
    outs = d.generate(small_batch, [greedy(kv=kv) for kv in params])
    assert tokens(outs) == colocated
    m = d.disagg.metrics
    n_rows = sum(len(b["prompt_token_ids"]) for b in small_batch)
    assert m.prefix_hit_rows == sum((len(b["prompt_token_ids"]) - 1) // 8 * 8
                                    for b in small_batch)
    assert m.rows_gpu + m.rows_host + m.prefix_hit_rows == n_rows
    wait_released(p, len(small_batch))
    assert_pools_full(d)
    assert_pools_full(p)


def test_min_tokens_reaches_the_prefill_as_one_token(dsv32_path, small_batch):
    """A request with min_tokens > 1 (what a client sends through the router) is prefilled
    with its one token (min_tokens capped to it, EOS still banned from that token) instead of
    failing min_tokens <= max_tokens."""
    p = engine(dsv32_path, kv_role="prefill", kv_hold_timeout_s=0.5)
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, min_tokens=5,
                        kv_transfer_params={"do_remote_decode": True})
    outs = p.generate(small_batch, sp)
    assert all(len(o.outputs[0].token_ids) == 1 and o.kv_transfer_params for o in outs)
    p.shutdown()
