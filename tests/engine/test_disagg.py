"""Prefill/decode disaggregation over NIXL (issue 23), engine level: two engines in one
process, real NIXL over UCX on loopback; greedy outputs equal a colocated run."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
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


def poison(llm, nan=False):
    """Random values in every tier: rows the transfer failed to land would change outputs.
    ``nan``: NaN instead, which also catches masked reads of rows nobody wrote (0 * NaN)."""
    c = llm.caches
    for t in (c.arena, c.indexer, c.host, c.host_indexer):
        t.fill_(float("nan")) if nan else t.normal_()


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


@pytest.fixture(scope="module")
def six_prompts(dsv32_path):
    """Six prompts and their colocated greedy outputs (both pool sizes below)."""
    batch = prompts(6, 20, 110, seed=3)
    return batch, tokens(engine(dsv32_path).generate(batch, greedy()))


@pytest.mark.parametrize("decode_gpu_blocks", [60, 16])
def test_prefill_to_decode_equals_colocated(dsv32_path, six_prompts, decode_gpu_blocks):
    batch, want = six_prompts
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
    # NaN: the recomputes get blocks freed by the failed loads in another order, and a -1 pad
    # of the attention reads a block 0 nobody has written yet (the timeout-recompute flake:
    # greedy outputs empty, "non-finite logits", with caches holding a previous test's NaN)
    poison(d, nan=True)
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


def test_reads_ending_after_the_prefills_hold_are_refused(dsv32_path, small_batch, colocated,
                                                          monkeypatch):
    """The prefill's params say until when it holds the blocks (``remote_hold_until``); rows
    whose READs end later (here: every READ, the margin made larger than the hold once they
    ended) may have been overwritten, so the load fails and the request recomputes; nothing
    is quarantined (the READs ended); pools full on both sides."""
    from hisparse.worker import kv_transfer

    p = engine(dsv32_path, kv_role="prefill")
    d = engine(dsv32_path, kv_role="decode")
    params, _ = prefill(p, small_batch)
    assert all(kv["remote_hold_until"] > time.time() + 60 for kv in params)   # default 120 s
    agent = d.disagg.agent
    post = agent._post_reads

    def post_and_finish(load):
        post(load)
        while any(agent.agent.check_xfer_state(h) != "DONE" for h in load.handles):
            time.sleep(0.001)
        monkeypatch.setattr(kv_transfer, "HOLD_MARGIN_S", 1e6)

    monkeypatch.setattr(agent, "_post_reads", post_and_finish)
    outs = d.generate(small_batch, [greedy(kv=kv) for kv in params])
    assert tokens(outs) == colocated
    m = d.disagg.metrics
    assert m.failures == len(small_batch) and m.requests == 0 and m.stalled == 0
    assert_pools_full(d)
    # a failed load tells the prefill, which frees the prompt's blocks at once
    deadline = time.monotonic() + 10
    while p.disagg.held and time.monotonic() < deadline:
        p.service_kv_transfer()
        d.service_kv_transfer()
        time.sleep(0.05)
    assert not p.disagg.held
    assert_pools_full(p)
    with pytest.raises(ValueError, match="remote_hold_until"):
        d.add_request(small_batch[0], greedy(kv=dict(params[0], remote_hold_until="soon")))


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


def test_remote_first_token_that_ends_the_request_decodes_nothing(dsv32_path, small_batch,
                                                                   colocated):
    """A first token of EOS (or a stop token) from the prefill finishes the decode request
    when its load lands: no decode step runs for it; with ignore_eos it decodes on."""
    p = engine(dsv32_path, kv_role="prefill")
    d = engine(dsv32_path, kv_role="decode")
    eos = 1     # the random checkpoint's eos_token_id
    forced = p.generate(small_batch[:1], SamplingParams(
        temperature=0.0, max_tokens=N_OUT, logit_bias={eos: 100.0},
        kv_transfer_params={"do_remote_decode": True}))[0]
    assert forced.outputs[0].token_ids == [eos]
    params, _ = prefill(p, small_batch[1:3])
    executed = []
    execute = d.runner.execute
    d.runner.execute = lambda plan, ids: executed.append(len(plan.seqs)) or execute(plan, ids)
    outs = d.generate(small_batch[:2], [
        SamplingParams(temperature=0.0, max_tokens=N_OUT,
                       kv_transfer_params=forced.kv_transfer_params),
        SamplingParams(temperature=0.0, max_tokens=N_OUT, stop_token_ids=[colocated[1][0]],
                       kv_transfer_params=params[0])])
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == [
        ([eos], "stop"), ([colocated[1][0]], "stop")]
    assert executed == [] and d.disagg.metrics.requests == 2
    assert_pools_full(d)
    # control: the same kind of load with nothing that stops it decodes (the hook counts)
    out = d.generate([small_batch[2]], greedy(kv=params[1]))[0]
    assert out.outputs[0].token_ids == colocated[2] and executed
    assert_pools_full(d)
    wait_released(p, 3)
    assert_pools_full(p)


def test_wrong_peer_at_the_address_is_refused(dsv32_path, small_batch, colocated):
    """The instance answering at ``remote_host:remote_port`` must be the engine the params name
    (another instance there: refused) with our compatibility hash (another model, block size
    or KV format: refused), before a byte is read; the requests recompute or fail."""
    p = engine(dsv32_path, kv_role="prefill", kv_hold_timeout_s=1.0)
    other = engine(dsv32_path, kv_role="prefill")                   # same model and format
    other_format = engine(dsv32_path, kv_role="prefill", block_size=16)
    d = engine(dsv32_path, kv_role="decode")
    poison(d)
    params, _ = prefill(p, small_batch)
    at_other = [dict(kv, remote_port=other.disagg.port) for kv in params]
    # a stale route: the params name the instance there, but it serves another KV format
    other_hash = [dict(kv, remote_port=other_format.disagg.port,
                       remote_engine_id=other_format.disagg.engine_id) for kv in params]
    outs = d.generate(small_batch, [greedy(kv=kv) for kv in at_other])
    assert tokens(outs) == colocated
    assert d.disagg.metrics.failures == len(small_batch) and d.disagg.metrics.requests == 0
    d_fail = engine(dsv32_path, kv_role="decode", kv_load_failure="fail")
    for kvs, want in ((at_other, f"is engine {other.disagg.engine_id!r}, not "
                                 f"{p.disagg.engine_id!r}"),
                      (other_hash, "compatibility hash mismatch at the handshake")):
        for o in d_fail.generate(small_batch, [greedy(kv=kv) for kv in kvs]):
            c = o.outputs[0]
            assert c.finish_reason == "error" and c.token_ids == [] and want in c.error, c.error
    assert d_fail.disagg.metrics.requests == 0
    assert_pools_full(d)
    assert_pools_full(d_fail)
    # nothing reached p: its held prompts go at their timeout; the others held nothing
    time.sleep(1.1)
    p.service_kv_transfer()
    assert p.disagg.metrics.expired == len(small_batch) and not p.disagg.held
    assert_pools_full(p)
    assert other.disagg.metrics.released == 0 and other_format.disagg.metrics.released == 0


PROC_ENGINE = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192,
                   max_num_seqs=8, num_gpu_blocks=60, hot_buffer_size=32, host_pool_gib=0.02,
                   max_num_batched_tokens=64,
                   # longer than the stall: the decode's 2 s load timeout, not the hold, ends
                   # the stalled loads, and the resumed prefill frees its prompts on the
                   # decode's notices (not at its timeout)
                   kv_hold_timeout_s=30.0)


class PrefillProcess:
    """A prefill instance in a child process (tests/engine/disagg_prefill_proc.py) that the
    test stops, resumes and kills. UCX over TCP only: a READ then needs the prefill's own
    progress, so a stopped prefill holds the decode's READ in flight (shared-memory
    transports would complete it without the peer)."""

    def __init__(self, path, batch):
        env = dict(os.environ, PYTHONPATH=os.getcwd(), UCX_TLS="tcp", OMP_NUM_THREADS="1")
        script = os.path.join(os.path.dirname(__file__), "disagg_prefill_proc.py")
        self.proc = subprocess.Popen([sys.executable, script], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.proc.stdin.write(json.dumps({"path": str(path), "engine": PROC_ENGINE,
                                          "prompts": batch}) + "\n")
        self.proc.stdin.flush()
        self.params = self.wait_for("PARAMS")

    def _read(self):
        for line in self.proc.stdout:
            for word in ("PARAMS", "STATUS"):
                if line.startswith(word + " "):
                    self.lines.put((word, json.loads(line[len(word) + 1:])))

    def wait_for(self, word, want=None, timeout=120.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, value = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"the prefill process sent no {word} {want or ''}; rc "
                                     f"{self.proc.poll()}") from None
            if got == word and (want is None or value == want):
                return value

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def region_blocks(agent, caches):
    """Each registered region of the decode's caches as uint8 ``[layers, blocks, bytes]``."""
    out = {}
    for region, t in (("host", caches.host), ("host_indexer", caches.host_indexer)):
        lay = agent.layouts[region]
        out[region] = t.view(torch.uint8).reshape(lay.num_layers, lay.num_blocks, -1)
    return out


def read_targets(agent):
    """The host blocks the quarantined loads' READs target (rows and keys alike)."""
    return np.concatenate([ld.job.read_targets() for ld in agent._quarantine])


@pytest.mark.parametrize("event,policy", [("kill", "recompute"), ("kill", "fail"),
                                          ("stall", "recompute"), ("stall", "fail")])
def test_prefill_stopped_or_killed_mid_read(dsv32_path, small_batch, colocated, monkeypatch,
                                            event, policy):
    """The prefill process is stopped just as the decode posts its READs; the test sees every
    READ in flight, then kills the prefill (the READs fail: every request finishes,
    recomputed or with a clear error) or leaves it stopped (the loads time out with their
    READs in flight: every request finishes the same way, in fresh blocks, while the blocks
    the READs target stay quarantined, out of the pools). Then the stopped prefill resumes:
    its late READs land in the quarantined blocks and nowhere else, the blocks come back and
    the decode's pools are full; the prefill frees its prompts on the decode's notices (with
    ``fail``: the decode shuts down first, and nothing lands after)."""
    prefill_proc = PrefillProcess(dsv32_path, small_batch)
    try:
        monkeypatch.setenv("UCX_TLS", "tcp")
        # stalled: a small GPU pool, so some loads stay in the host tier (no GPU restore)
        d = engine(dsv32_path, kv_role="decode", kv_load_failure=policy, kv_load_timeout_s=2.0,
                   num_gpu_blocks=22 if event == "stall" else 60)
        poison(d)
        agent = d.disagg.agent
        post, poll = agent._post_reads, agent.poll
        seen = {"posted": 0, "in_flight_polls": 0, "ended": []}

        def stop_then_post(load):
            if not seen["posted"]:
                prefill_proc.signal(signal.SIGSTOP)
            seen["posted"] += 1
            post(load)

        def watch(*a):
            loads = list(agent._loads.values())
            if (seen["posted"] == len(small_batch) and len(loads) == len(small_batch)
                    and not seen["ended"] and seen["in_flight_polls"] < 20):
                states = [agent.agent.check_xfer_state(h) for ld in loads for h in ld.handles]
                assert states and all(s == "PROC" for s in states), states
                seen["in_flight_polls"] += 1
                if seen["in_flight_polls"] == 20 and event == "kill":
                    prefill_proc.signal(signal.SIGKILL)
            ended = poll(*a)
            seen["ended"] += ended
            return ended

        monkeypatch.setattr(agent, "_post_reads", stop_then_post)
        monkeypatch.setattr(agent, "poll", watch)
        outs = d.generate(small_batch, [greedy(kv=kv) for kv in prefill_proc.params])
        assert seen["in_flight_polls"] == 20
        assert len(seen["ended"]) == len(small_batch)
        m = d.disagg.metrics
        assert m.failures == len(small_batch) and m.requests == 0
        want = "died or dropped the connection" if event == "kill" else "timed out after 2 s " \
            "in state 'reading'"
        assert all(want in err for _, err in seen["ended"]), seen["ended"]
        if policy == "recompute":
            assert tokens(outs) == colocated
        else:
            for o in outs:
                c = o.outputs[0]
                assert c.finish_reason == "error" and c.token_ids == [] and want in c.error
        if event == "kill":
            assert m.stalled == 0
            assert_pools_full(d)
            return
        # still stopped: the READs are in flight and their blocks out of the pools
        s, cfg = d.stats(), d.kv_config
        targets = read_targets(agent)
        n = len(targets)
        assert m.stalled == m.quarantined_loads == len(small_batch)
        assert n and s["kv_transfer_quarantined_blocks"] == n
        assert (cfg.num_gpu_blocks - s["free_gpu_blocks"], cfg.num_host_blocks
                - s["free_host_blocks"], cfg.num_indexer_blocks - s["free_indexer_blocks"]) == (
            0, n, 0)
        d.service_kv_transfer()
        assert d.stats()["kv_transfer_quarantined_blocks"] == n
        # every block of the three regions gets a marker: the late READs' targets one, every
        # other block another; only the targets may change once the prefill resumes
        regions = region_blocks(agent, d.caches)
        others = {}
        for region, t in regions.items():
            t.fill_(0xCD)
            t[:, targets] = 0xAB
            others[region] = np.setdiff1d(np.arange(t.shape[1]), targets)
        if policy == "fail":
            # the decode shuts down with the READs in flight: its NIXL agent goes first, and
            # nothing lands in its caches (held here) once the prefill resumes
            d.shutdown()
            prefill_proc.signal(signal.SIGCONT)
            time.sleep(1.0)     # the resumed READs land within milliseconds (recompute case)
            for region, t in regions.items():
                assert bool((t[:, targets] == 0xAB).all()), region
                assert bool((t[:, others[region]] == 0xCD).all()), region
            return
        prefill_proc.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while d.stats()["kv_transfer_quarantined_blocks"] and time.monotonic() < deadline:
            d.service_kv_transfer()
            time.sleep(0.02)
        assert d.stats()["kv_transfer_quarantined_blocks"] == 0 and m.quarantined_loads == 0
        assert_pools_full(d)
        for region, t in regions.items():
            assert bool((t[:, others[region]] == 0xCD).all()), region
            assert bool((t[:, targets] != 0xAB).any()), region    # the READs landed
        prefill_proc.wait_for("STATUS", {"held": 0, "pools_full": True}, timeout=30)
    finally:
        prefill_proc.close()


@pytest.mark.parametrize("mode", ["always-host", "hisparse"])
def test_stalled_prefill_with_a_small_decode_pool_and_an_abort(dsv32_path, small_batch,
                                                               colocated, monkeypatch, mode):
    """A stopped prefill, a decode host pool too small for the recomputes beside the
    quarantined blocks (it holds the three loads' blocks and no more), and a request aborted
    with its READs in flight: the abort quarantines its blocks at once; the others time out
    and recompute. ``always-host``: a request that cannot be scheduled beside the quarantine
    fails after the load timeout with a clear error instead of waiting forever (or stopping
    the engine); ``hisparse``: the recomputes run GPU-held (all pages on GPU, no host blocks)
    beside the quarantine and give the colocated tokens. The prefill is killed: its READs
    fail, the quarantined blocks come back, the pools are full and serve the same prompts."""
    sizing = engine(dsv32_path)
    bs = sizing.kv_config.block_size
    pages = [-(-(len(b["prompt_token_ids"]) + N_OUT) // bs) for b in small_batch]
    block_bytes = bs * sizing.caches.geo.bytes_per_token
    prefill_proc = PrefillProcess(dsv32_path, small_batch)
    try:
        monkeypatch.setenv("UCX_TLS", "tcp")
        d = engine(dsv32_path, kv_role="decode", kv_load_timeout_s=2.0, num_gpu_blocks=16,
                   host_pool_gib=(sum(pages) + 0.5) * block_bytes / 2**30, mode=mode)
        assert d.kv_config.num_host_blocks == sum(pages)
        agent = d.disagg.agent
        post = agent._post_reads

        def stop_then_post(load):
            if not agent.metrics.stalled and not any(ld.handles for ld in agent._loads.values()):
                prefill_proc.signal(signal.SIGSTOP)
            post(load)

        monkeypatch.setattr(agent, "_post_reads", stop_then_post)
        rids = [d.add_request(b, greedy(kv=kv)) for b, kv in zip(small_batch,
                                                                  prefill_proc.params)]
        outs = {}

        def step():
            for o in d.step():
                if o.finished:
                    outs[o.request_id] = o

        deadline = time.monotonic() + 30
        while (len(agent._loads) < 3 or not all(ld.handles for ld in agent._loads.values())) \
                and time.monotonic() < deadline:
            step()
        d.abort(rids[2])
        step()
        assert agent.metrics.stalled == 1 and agent.metrics.failures == 0   # the abort
        while d.has_unfinished_requests():
            step()
        m = d.disagg.metrics
        assert m.stalled == 3 and m.failures == 2 and m.requests == 0
        assert set(outs) == set(rids[:2])
        # the 3 quarantined loads' prompt pages leave neither recompute host room to run
        for i, r in enumerate(rids[:2]):
            c = outs[r].outputs[0]
            if mode == "hisparse":
                assert c.finish_reason == "length" and c.token_ids == colocated[i], c.error
                continue
            assert c.finish_reason == "error" and c.token_ids == [], (c.finish_reason, c.error)
            assert "cannot be scheduled" in c.error and "quarantined" in c.error, c.error
        if mode == "hisparse":
            assert d.stats()["gpu_held_admissions"] >= 2
        assert d.stats()["kv_transfer_quarantined_blocks"] > 0
        prefill_proc.signal(signal.SIGKILL)     # the READs fail: the blocks come back
        deadline = time.monotonic() + 30
        while d.stats()["kv_transfer_quarantined_blocks"] and time.monotonic() < deadline:
            d.service_kv_transfer()
            time.sleep(0.02)
        assert_pools_full(d)
        assert tokens(d.generate(small_batch, greedy())) == colocated
        assert_pools_full(d)
    finally:
        prefill_proc.close()
