"""Stateful property test of the KV core against the fake worker (DESIGN.md §4, I1-I6).

Random add / step / stop / abort / preempt / prefix-sharing sequences, with GPU pools small
enough that host-read mode, reclaim, block reuse and preemption all happen, and acknowledgements
that arrive 0-3 steps late and out of order. After every rule, every computed row must read back
from where the tables say it is; at the end every pool must be whole again.
"""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hisparse.config import KVCacheConfig
from hisparse.engine.simulate import Simulation


class KVCoreMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["hisparse", "always-host", "gpu-only"]),
                block_size=st.sampled_from([2, 4, 8]),
                gpu_slack=st.integers(0, 12), seed=st.integers(0, 2**16),
                watermark=st.sampled_from([None, 0, 3]),
                host_requests=st.sampled_from([1, 3]))
    def setup(self, mode, block_size, gpu_slack, seed, watermark, host_requests):
        max_model_len = 12 * block_size
        hot = 2 * block_size
        chunk = 2 * block_size
        base = max(max_model_len // block_size, hot // block_size + 2 + chunk // block_size + 1)
        self.cfg = KVCacheConfig(
            block_size=block_size, num_gpu_blocks=base + gpu_slack,
            # one max-length request's host blocks: hisparse admits the others GPU-held
            num_host_blocks=host_requests * max_model_len // block_size + gpu_slack,
            num_indexer_blocks=2 * max_model_len // block_size + gpu_slack,
            max_model_len=max_model_len, index_topk=block_size, hot_buffer_size=hot,
            max_num_seqs=6, max_num_batched_tokens=chunk, mode=mode, watermark_blocks=watermark)
        self.sim = Simulation(self.cfg, seed=seed)
        self.rng = random.Random(seed)
        self.prompts: list[list[int]] = []

    @rule(length=st.integers(1, 60), max_tokens=st.integers(1, 40),
          share=st.integers(0, 100), vocab=st.sampled_from([3, 50]))
    def add_request(self, length, max_tokens, share, vocab):
        limit = self.cfg.max_model_len - 1
        prompt = []
        if self.prompts and share > 30:  # prefix hit on an earlier prompt
            prev = self.rng.choice(self.prompts)
            prompt = prev[:min(len(prev), share * len(prev) // 100)]
        prompt = (prompt + [self.rng.randrange(vocab) for _ in range(length)])[:limit]
        self.prompts.append(prompt)
        self.sim.add(prompt, max_tokens)

    @precondition(lambda self: self.cfg.mode != "gpu-only")
    @rule(length=st.integers(1, 60), max_tokens=st.integers(1, 40), share=st.integers(0, 100),
          fail=st.integers(0, 4))
    def add_remote(self, length, max_tokens, share, fail):
        """Disaggregation: a decode request whose prompt rows are pulled (or fail to be)."""
        limit = self.cfg.max_model_len - 2
        prompt = []
        if self.prompts and share > 30:
            prev = self.rng.choice(self.prompts)
            prompt = prev[:min(len(prev), share * len(prev) // 100)]
        prompt = (prompt + [self.rng.randrange(50) for _ in range(length)])[:limit]
        self.prompts.append(prompt)
        self.sim.add_remote(prompt, max_tokens, fail=fail == 0)

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for i in range(n):
            self.sim.step()
            if i < n - 1:       # after the last one: the invariant below
                self.sim.check_invariants()

    def _running(self):
        return self.sim.scheduler.running

    @precondition(lambda self: self._running())
    @rule(pick=st.integers(0, 1000))
    def stop(self, pick):
        req = self._running()[pick % len(self._running())]
        self.sim.finish(req.req_id)

    @precondition(lambda self: self.sim.requests)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        ids = sorted(self.sim.requests)
        self.sim.abort(ids[pick % len(ids)])

    @precondition(lambda self: self._running())
    @rule(pick=st.integers(0, 1000))
    def preempt(self, pick):
        req = self._running()[pick % len(self._running())]
        self.sim.preempt(req.req_id)

    @invariant()
    def tables_read_back(self):
        if hasattr(self, "sim"):
            self.sim.check_invariants()

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        self.sim.run_to_completion(max_steps=5000, check=True)
        self.sim.check_all_free()


KVCoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCore = KVCoreMachine.TestCase
