"""Drive the scheduler and KV core with the fake worker and check the invariants of DESIGN.md §4.

Used by the property tests and by ``hisparse simulate`` (a model-free tour of the KV core:
:func:`simulate_workload`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from hisparse.config import ACTIVE_TAIL_PAGES, KVCacheConfig, Mode, cdiv
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler
from hisparse.kv.plan import page_rows
from hisparse.worker.fake_worker import FakeWorker

_MOD = (1 << 61) - 1


class PrefixKeys:
    """Row key of position ``p`` = rolling hash of ``tokens[:p + 1]`` (shared prefixes agree)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.cache: dict[str, list[int]] = {}

    def register(self, req_id: str, token_ids: list[int]) -> None:
        self.tokens[req_id] = token_ids
        self.cache[req_id] = []

    def __call__(self, req_id: str, positions: np.ndarray) -> np.ndarray:
        toks, keys = self.tokens[req_id], self.cache[req_id]
        need = int(positions.max()) + 1 if len(positions) else 0
        h = keys[-1] if keys else 0
        for tok in toks[len(keys):need]:
            h = (h * 1_000_003 + tok + 1) % _MOD
            keys.append(h)
        return np.asarray(keys, dtype=np.int64)[positions]


@dataclass
class SimResult:
    steps: int
    finished: int
    stats: dict


class Simulation:
    """A scheduler, its KV core and a fake worker, with token "sampling" from a seeded RNG."""

    def __init__(self, cfg: KVCacheConfig, num_layers: int = 2, seed: int = 0,
                 max_delay: int = 3, vocab: int = 50) -> None:
        self.cfg = cfg
        self.scheduler = Scheduler(cfg)
        self.keys = PrefixKeys()
        self.worker = FakeWorker(cfg, self.keys, num_layers=num_layers, max_delay=max_delay,
                                 seed=seed)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.acks: list[int] = []
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self._next_id = 0
        # Disaggregation: loads in flight (they land at the next step) and those to fail.
        self._loads: list = []
        self._failing: set[str] = set()

    @property
    def kv(self):
        return self.scheduler.kv

    def add(self, prompt: list[int], max_tokens: int) -> Request:
        req_id = f"r{self._next_id}"
        self._next_id += 1
        max_len = min(len(prompt) + max_tokens, self.cfg.max_model_len)
        req = Request(req_id, list(prompt), max_tokens=max_tokens, max_len=max_len)
        self.keys.register(req_id, req.token_ids)
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def add_remote(self, prompt: list[int], max_tokens: int, fail: bool = False) -> Request:
        """A decode request whose prompt a "prefill instance" computed: its rows land one step
        after admission (or its load fails, and the prompt is recomputed)."""
        from hisparse.kv.transfer_plan import RemotePrefill

        req_id = f"r{self._next_id}"
        self._next_id += 1
        max_len = min(len(prompt) + max_tokens, self.cfg.max_model_len)
        req = Request(req_id, list(prompt), max_tokens=max_tokens, max_len=max_len)
        first = self.rng.randrange(self.vocab)
        req.remote_prefill = RemotePrefill(
            engine_id="prefill", request_id=req_id, host="-", port=1,
            host_blocks=tuple(range(cdiv(len(prompt), self.cfg.block_size))),
            num_tokens=len(prompt), first_token=first, compat_hash="-", layout={})
        req.token_ids.append(first)
        self.keys.register(req_id, req.token_ids)
        self.requests[req_id] = req
        self.scheduler.add(req)
        if fail:
            self._failing.add(req_id)
        return req

    def _finish_loads(self) -> None:
        loads, self._loads = self._loads, []
        for job in loads:
            ok = job.req_id not in self._failing
            req = self.scheduler.loading[job.req_id]
            if ok and not req.finished:
                self.worker.land(job, job.req_id)
            done = self.scheduler.load_finished(job.req_id, ok, recompute=True)
            if done is not None:
                self.finished.append(done)

    def step(self) -> bool:
        """One engine step; False when nothing was scheduled."""
        self._finish_loads()
        plan = self.scheduler.schedule(self.acks)
        self._loads += self.scheduler.take_loads()
        self.acks = self.worker.execute(plan)
        if plan is None:
            return False
        tokens = [self.rng.randrange(self.vocab) for s in plan.seqs if s.sample]
        self.finished += self.scheduler.update(plan, tokens).finished
        return True

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def finish(self, req_id: str) -> None:
        self.scheduler.finish(req_id)

    def preempt(self, req_id: str) -> None:
        self.scheduler.preempt(req_id)

    def run_to_completion(self, max_steps: int = 100_000, check: bool = False) -> SimResult:
        steps = 0
        while self.scheduler.has_unfinished and steps < max_steps:
            progressed = self.step()
            steps += 1
            if check:
                self.check_invariants()
            if (not progressed and not self.worker.in_flight and not self.acks
                    and not self._loads and self.scheduler.has_unfinished):
                raise RuntimeError("scheduler is stuck: nothing scheduled, nothing in flight")
        self.settle()
        return SimResult(steps, len(self.finished), self.stats())

    def settle(self) -> None:
        """Complete in-flight copies and apply their acknowledgements."""
        self.scheduler.kv.apply_acks(self.acks + self.worker.drain())
        self.acks = []

    def stats(self) -> dict:
        s = vars(self.kv.stats).copy()
        s.update(hot_hits=self.worker.hot_hits, hot_misses=self.worker.hot_misses,
                 num_preempted=self.scheduler.num_preempted,
                 peak_running=self.scheduler.peak_running)
        return s

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        kv, block_size = self.kv, self.cfg.block_size
        for pool in (kv.gpu_pool, kv.host_pool, kv.indexer_pool):
            if pool is not None:
                pool.check_consistency()
        for req in kv.requests.values():
            n = req.num_computed
            positions = np.arange(n, dtype=np.int64)
            # I1: every computed row reads back, from where the tables say.
            got = self.worker.read_back(req.resident, req.host, positions)
            want = self.worker.expected(req.req_id, positions)
            if not torch.equal(got, want):
                bad = (got != want).any(0).nonzero().flatten()[:5].tolist()
                raise AssertionError(f"I1: {req.req_id} rows {bad} unreadable "
                                     f"(durable={req.num_durable}, computed={n})")
            num_pages = cdiv(n, block_size)
            for p in range(max(0, num_pages - ACTIVE_TAIL_PAGES), num_pages):
                # I4: the last pages are pinned GPU pages. One exception (issue 14): a host-only
                # prefix hit used in place (never restored, so never given a GPU block) may be
                # among them; it is fully durable (published), no step writes it again, and
                # reads go through the staging area (prefill) or the hot buffer (decode). An
                # unpinned page (p < pinned_start, block id kept) is still caught.
                block = int(req.resident[p])
                if block < 0 and (p + 1) * block_size <= req.num_durable:
                    continue
                # Disaggregation: a full prompt page whose rows were pulled into the host pool
                # (never a GPU page; no step writes it again; read through the hot buffer).
                if block < 0 and req.remote and (p + 1) * block_size <= req.prompt_len:
                    continue
                if block < 0 or p < req.pinned_start or kv.gpu_pool.ref_counts[block] == 0:
                    raise AssertionError(f"I4: {req.req_id} tail page {p} not pinned")
            if not req.host_backed:
                # GPU-held: every page of its full length pinned on GPU; on host only the
                # prefix hits it claimed at admission (durable and published, never more)
                hits = req.num_published
                if (req.host_read or req.pending or req.pinned_start
                        or req.num_durable != hits * block_size
                        or (req.host[:hits] < 0).any() or (req.host[hits:] >= 0).any()
                        or (req.resident[:req.num_pages] < 0).any()):
                    raise AssertionError(f"{req.req_id}: GPU-held but not all on GPU")
            if req.host_read:
                # I5: GPU footprint = tail pages + dirty pages + hot blocks.
                for p in range(req.pinned_start, num_pages - ACTIVE_TAIL_PAGES):
                    if req.resident[p] >= 0 and (p + 1) * block_size <= req.num_durable:
                        raise AssertionError(f"I5: {req.req_id} holds clean page {p}")
                if len(req.hot_blocks) != self.cfg.hot_blocks_per_request:
                    raise AssertionError(f"I5: {req.req_id} host-read without hot blocks")
            elif req.decoding and (req.pinned_start > 0 or (req.resident[:num_pages] < 0).any()):
                # Unpinned pages (below pinned_start) count too: their blocks may be reused.
                raise AssertionError(f"{req.req_id}: host-only pages outside host-read mode")
        self._check_block_owners()
        self._check_host_owners()
        self._check_published()

    def _check_host_owners(self) -> None:
        """Every host block reference has a holder: a page of a live or draining request (a
        GPU-held one holds only its prefix hits), or a failed load's quarantine (counted, not
        listed); a queued restore reads a held host block into a held GPU block."""
        kv = self.kv
        if kv.host_pool is None:
            return
        holders = [0] * kv.host_pool.num_blocks
        for req in list(kv.requests.values()) + list(kv.draining.values()):
            for p in range(req.num_pages):
                if req.host_backed or req.host[p] >= 0:
                    holders[req.host[p]] += 1
        extra = [r - h for h, r in zip(holders, kv.host_pool.ref_counts)]
        if min(extra) < 0 or sum(extra) != kv.quarantined_blocks:
            bad = [b for b, e in enumerate(extra) if e][:5]
            raise AssertionError(f"host blocks {bad}: holders and ref counts disagree")
        for host_block, gpu_block in kv._restore_pages:
            if kv.host_pool.ref_counts[host_block] == 0 or kv.gpu_pool.ref_counts[gpu_block] == 0:
                raise AssertionError(f"restore {host_block} -> {gpu_block} of an unheld block")

    def _check_block_owners(self) -> None:
        """Every GPU block reference has exactly one holder: a pinned page or a hot block of a
        live or draining request (a hot block is never also someone's page)."""
        kv = self.kv
        holders = [0] * kv.gpu_pool.num_blocks
        for req in list(kv.requests.values()) + list(kv.draining.values()):
            for p in range(req.pinned_start, req.num_pages):
                if req.resident[p] >= 0:
                    holders[req.resident[p]] += 1
            for block in req.hot_blocks:
                holders[block] += 1
        if holders != kv.gpu_pool.ref_counts:
            bad = [b for b, (h, r) in enumerate(zip(holders, kv.gpu_pool.ref_counts)) if h != r]
            raise AssertionError(f"GPU blocks {bad[:5]}: holders and ref counts disagree")
        for req in kv.requests.values():
            live_pages = set(req.resident[:cdiv(req.num_computed, self.cfg.block_size)].tolist())
            for other in kv.requests.values():
                if live_pages & set(other.hot_blocks):
                    raise AssertionError(f"{req.req_id} reads a page that is "
                                         f"{other.req_id}'s hot block")

    def _check_published(self) -> None:
        """I3: a published host block holds the durable rows of its prefix."""
        kv, block_size = self.kv, self.cfg.block_size
        if kv.host_pool is None:
            return
        expected: dict[int, tuple[str, int]] = {}
        for req in self.requests.values():
            num_pages = len(req.token_ids) // block_size
            for p, h in enumerate(kv.prefix.page_hashes(req.token_ids, num_pages)):
                expected.setdefault(h, (req.req_id, p))
        # one comparison per request over all the blocks published from its pages
        by_req: dict[str, tuple[list[int], list[int]]] = {}
        for h, block in kv.host_pool.hash_to_block.items():
            req_id, page = expected[h]
            pages, blocks = by_req.setdefault(req_id, ([], []))
            pages.append(page)
            blocks.append(block)
        for req_id, (pages, blocks) in by_req.items():
            positions = page_rows(pages, block_size)
            rows = torch.from_numpy(page_rows(blocks, block_size))
            want = self.worker.expected(req_id, positions)
            for pool, what in ((self.worker.host, "published before durable"),
                               (self.worker.host_indexer, "indexer keys not durable")):
                bad = (pool[:, rows] != want).any(0).nonzero().flatten()
                if len(bad):
                    raise AssertionError(f"I3: host block {blocks[int(bad[0]) // block_size]} "
                                         f"{what}")

    def check_all_free(self) -> None:
        """I2: with every request gone and copies settled, every pool is whole again."""
        kv = self.kv
        for pool in (kv.gpu_pool, kv.host_pool, kv.indexer_pool):
            if pool is not None and pool.num_free != pool.num_blocks:
                raise AssertionError(f"I2: {pool.name} pool leaks "
                                     f"{pool.num_blocks - pool.num_free} blocks")
        if kv.draining or kv.requests or (kv.hot_table >= 0).any():
            raise AssertionError("I2: requests still hold KV")


def shared_prefix_prompts(rng: random.Random, num_requests: int, max_len: int) -> list[list[int]]:
    """A system prompt of ``max_len // 4`` tokens shared by every request, then a random tail."""
    system_prompt = [rng.randrange(1000) for _ in range(max_len // 4)]
    return [system_prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, max_len // 2))]
            for _ in range(num_requests)]


def simulate_workload(mode: Mode | str, *, requests: int = 32, max_len: int = 512,
                      block_size: int = 16, gpu_blocks: int = 96, seed: int = 0,
                      check: bool = False) -> dict:
    """Run the ``hisparse simulate`` workload (:func:`shared_prefix_prompts`, each request
    generating up to ``max_len``) in one mode; every row is read back and checked, and every
    pool must be whole at the end. Returns steps, finished and the counters of
    :meth:`Simulation.stats`."""
    cfg = KVCacheConfig(block_size=block_size, num_gpu_blocks=gpu_blocks,
                        num_host_blocks=requests * max_len // block_size + 64,
                        num_indexer_blocks=requests * max_len // block_size,
                        max_model_len=max_len, index_topk=block_size * 2,
                        max_num_seqs=requests, max_num_batched_tokens=256, mode=mode)
    sim = Simulation(cfg, seed=seed)
    for prompt in shared_prefix_prompts(random.Random(seed), requests, max_len):
        sim.add(prompt, max_len - len(prompt))
    res = sim.run_to_completion(check=check)
    sim.check_all_free()
    return dict(steps=res.steps, finished=res.finished, **res.stats)
