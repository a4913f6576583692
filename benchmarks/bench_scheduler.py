"""Host (CPU) time per decode step at large batches of host-read requests, without a GPU.

Two measurements:

- ``--what scheduler`` (the original one): ``Scheduler.schedule`` (acks, page allocation,
  reclaim, StepPlan with mirror rows) plus ``Scheduler.update`` per pure decode step; no
  worker, acks one step late.
- ``--what engine`` (the default): the real engine step path, ``LLM.step()`` over
  ``EngineCore`` with async scheduling, with a worker that does only the worker's host work
  (:class:`HostPathRunner`: the real ``StepState`` staging of the plan and the token inputs on
  CPU tensors, constant logits, mirrors acknowledged one step late). Per decode step it reports
  the milliseconds of each phase: ``schedule`` (``Scheduler.schedule``, plan included),
  ``stage_plan`` and ``stage_tokens`` (``StepState``), ``sampling`` (``SamplingTensors.build``
  and ``sample_tensor`` on tiny logits), ``update`` (``Scheduler.update``), ``outputs``
  (``OutputBuilder.build`` of every streamed request) and ``other`` (the rest of ``LLM.step()``:
  input ids, the engine loop).

Targets: scheduler + plan + sampling <= 1 ms per step at 256 host-read requests.

    PYTHONPATH=. python benchmarks/bench_scheduler.py [--what engine|scheduler] [--requests 147]
        [--context 32768] [--steps 300] [--mode hisparse] [--no-gc-freeze]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict, deque

import torch

from hisparse.config import KVCacheConfig, cdiv
from hisparse.engine import core as engine_core
from hisparse.engine.core import EngineCore
from hisparse.engine.llm import LLM
from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.startup import EngineParts
from hisparse.kv.plan import StepPlan
from hisparse.ops import switches
from hisparse.worker.step_state import StepState

VOCAB = 64


def make_config(requests: int, context: int, block_size: int, steps: int, mode: str,
                max_num_seqs: int | None = None) -> KVCacheConfig:
    """A KV config whose GPU pool is far smaller than the working set: every request ends in
    host-read mode (``mode="hisparse"``)."""
    # Early requests decode while later ones prefill: leave room for those tokens.
    max_len = context + 4096 + steps
    pages = cdiv(max_len, block_size)
    hot_blocks = cdiv(4096, block_size)
    gpu_blocks = max(pages + 64, requests * (hot_blocks + 4) + 2 * pages) \
        if mode != "gpu-only" else requests * pages
    return KVCacheConfig(block_size=block_size, num_gpu_blocks=gpu_blocks,
                         num_host_blocks=requests * pages, num_indexer_blocks=requests * pages,
                         max_model_len=max_len, index_topk=2048, hot_buffer_size=4096,
                         max_num_seqs=max_num_seqs or requests, max_num_batched_tokens=16384,
                         mode=mode)


def prompt(i: int, context: int) -> list[int]:
    return [(i * 7919 + j) % 32000 for j in range(context)]


def summary(times: list[float]) -> dict:
    return dict(median=round(1e3 * statistics.median(times), 3),
                p99=round(1e3 * sorted(times)[max(int(0.99 * len(times)) - 1, 0)], 3),
                max=round(1e3 * max(times), 3), mean=round(1e3 * statistics.fmean(times), 3))


class GCMonitor:
    """Cyclic-GC collections while active (``gc.callbacks``): count, total and longest pause per
    generation."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = defaultdict(list)
        self._t = 0.0

    def __enter__(self) -> GCMonitor:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t)

    def report(self) -> dict:
        return {f"gen{g}": dict(count=len(self.pauses[g]),
                                total_ms=round(1e3 * sum(self.pauses[g]), 1),
                                max_ms=round(1e3 * max(self.pauses[g], default=0.0), 2))
                for g in range(3)}


# ---------------------------------------------------------------------- scheduler only
def run(requests: int, context: int, block_size: int, steps: int, mode: str) -> dict:
    cfg = make_config(requests, context, block_size, steps, mode)
    max_len = cfg.max_model_len
    sched = Scheduler(cfg)
    for i in range(requests):
        sched.add(Request(f"r{i}", prompt(i, context), max_tokens=max_len - context,
                          max_len=max_len))
    acks: list[int] = []
    t0 = time.perf_counter()
    prefill_steps = 0
    while sched.waiting or any(r.num_uncomputed > 1 for r in sched.running):
        plan = sched.schedule(acks)
        acks = [plan.step_id]
        sched.update(plan, [1 for s in plan.seqs if s.sample])
        prefill_steps += 1
    setup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = sched.schedule(acks)
        sched.update(plan, [1 for s in plan.seqs if s.sample])
        times.append(time.perf_counter() - t)
        acks = [plan.step_id]
        assert len(plan.seqs) == requests, "every request decodes each step"
    kv = sched.kv
    host_read = sum(r.host_read for r in kv.requests.values())
    s = summary(times)
    return dict(what="scheduler", mode=mode, requests=requests, context=context,
                block_size=block_size, gpu_blocks=cfg.num_gpu_blocks,
                host_read_requests=host_read, steps=steps, setup_s=round(setup_s, 2),
                prefill_steps=prefill_steps, step_ms_median=s["median"], step_ms_p99=s["p99"],
                step_ms_mean=s["mean"])


# ---------------------------------------------------------------------- the engine step path
class HostPathRunner:
    """The worker's host side of a step, on CPU tensors: the real :class:`StepState` stages
    the plan (changed table rows, resets, copy row lists) and the token inputs; the forward is
    constant logits ``[sampled, VOCAB]``; the plan's mirrors are acknowledged at the next
    call. Implements the part of ``ModelRunner``'s interface that ``EngineCore`` uses."""

    def __init__(self, cfg: KVCacheConfig) -> None:
        self.device = torch.device("cpu")
        self.inputs = StepState(cfg, self.device,
                                max(cfg.max_num_batched_tokens, cfg.max_num_seqs))
        self.in_flight: deque[int] = deque()
        self.logits = torch.zeros(cfg.max_num_seqs, VOCAB)
        self.logits[:, 1] = 1.0

    def execute(self, plan: StepPlan, input_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        self.inputs.stage_plan(plan)
        _, num_sampled = self.inputs.stage_tokens(plan.seqs, input_ids)
        acks = self.drain()
        if len(plan.mirrors):
            self.in_flight.append(plan.mirrors.copy_id)
        return self.logits[:num_sampled], acks

    def commit_sampled(self, tokens: torch.Tensor) -> None:
        self.inputs.commit_sampled(tokens)

    def drain(self) -> list[int]:
        done = list(self.in_flight)
        self.in_flight.clear()
        return done


class PhaseTimer:
    """Wall time per named phase, accumulated until :meth:`take`."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        acc = self.acc

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[name] += time.perf_counter() - t
        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


def engine_llm(cfg: KVCacheConfig, runner: HostPathRunner, gc_freeze: bool = True) -> LLM:
    """An ``LLM`` adopting a scheduler and ``runner``, without a model: the step path
    (``LLM.step`` -> ``EngineCore.step``, output building) is the engine's own code; only the
    start-up (checkpoint, caches) is skipped."""
    scheduler = Scheduler(cfg)
    core = EngineCore(scheduler, runner, frozenset(), async_scheduling=True,
                      gc_freeze=gc_freeze)
    llm = LLM.__new__(LLM)
    llm._adopt(EngineParts(model_dir="", device=torch.device("cpu"), tensor_parallel_size=1,
                           model_config=None, max_model_len=cfg.max_model_len, kv_config=cfg,
                           model=None, caches=None, runner=runner, scheduler=scheduler,
                           core=core, disagg=None, tokenizer=None,
                           switches=switches.current()))
    return llm


def run_engine(requests: int, context: int, block_size: int, steps: int, mode: str,
               max_num_seqs: int | None = None, profile: str | None = None,
               gc_freeze: bool = True) -> dict:
    cfg = make_config(requests, context, block_size, steps, mode, max_num_seqs)
    runner = HostPathRunner(cfg)
    llm = engine_llm(cfg, runner, gc_freeze)
    sched = llm.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_model_len - context,
                            ignore_eos=True)
    for i in range(requests):
        llm._table.enqueue(None, prompt(i, context), params, f"r{i}")
    t0 = time.perf_counter()
    prefill_steps = 0
    while sched.waiting or any(r.num_uncomputed > 1 for r in sched.running):
        llm.step()
        prefill_steps += 1
    for _ in range(3):      # settle: every request decoding, the overlapped loop primed
        llm.step()
    setup_s = time.perf_counter() - t0

    timer = PhaseTimer()
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update = timer.wrap("update", sched.update)
    runner.inputs.stage_plan = timer.wrap("stage_plan", runner.inputs.stage_plan)
    runner.inputs.stage_tokens = timer.wrap("stage_tokens", runner.inputs.stage_tokens)
    llm._outputs.build = timer.wrap("outputs", llm._outputs.build)
    real_sampling = (engine_core.sampling.SamplingTensors.build,
                     engine_core.sampling.sample_tensor)
    engine_core.sampling.SamplingTensors.build = timer.wrap("sampling", real_sampling[0])
    engine_core.sampling.sample_tensor = timer.wrap("sampling", real_sampling[1])
    phases: dict[str, list[float]] = defaultdict(list)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    monitor = GCMonitor()
    try:
        monitor.__enter__()
        for _ in range(steps):
            t = time.perf_counter()
            outs = llm.step()
            total = time.perf_counter() - t
            assert len(outs) == requests, "every request streams a token each step"
            acc = timer.take()
            for name, v in acc.items():
                phases[name].append(v)
            phases["other"].append(total - sum(acc.values()))
            phases["total"].append(total)
    finally:
        monitor.__exit__()
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        engine_core.sampling.SamplingTensors.build, engine_core.sampling.sample_tensor = \
            real_sampling
    kv = sched.kv
    host_read = sum(r.host_read for r in kv.requests.values())
    order = ("schedule", "stage_plan", "stage_tokens", "sampling", "update", "outputs",
             "other", "total")
    return dict(what="engine", mode=mode, gc_freeze=gc_freeze, requests=requests,
                context=context,
                block_size=block_size, max_num_seqs=cfg.max_num_seqs,
                gpu_blocks=cfg.num_gpu_blocks, host_read_requests=host_read, steps=steps,
                setup_s=round(setup_s, 2), prefill_steps=prefill_steps,
                table_rows_uploaded_per_step=None if not steps else round(
                    runner.inputs.rows_uploaded / (prefill_steps + 3 + steps), 2),
                ms_per_step={name: summary(phases[name]) for name in order},
                gc_during_steps=monitor.report(), gc_frozen_objects=gc.get_freeze_count())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=("engine", "scheduler"), default="engine")
    p.add_argument("--requests", type=int, default=None,
                   help="default: 147 (engine), 256 (scheduler)")
    p.add_argument("--context", type=int, default=None,
                   help="default: 32768 (engine), 65536 (scheduler)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="default: 300 (engine), 500")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --requests")
    p.add_argument("--mode", default="hisparse")
    p.add_argument("--profile", default=None, help="engine: write cProfile stats here")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="engine: LLM(gc_freeze=False), the collector walks every request")
    a = p.parse_args()
    if a.what == "scheduler":
        print(json.dumps(run(a.requests or 256, a.context or 65536, a.block_size,
                             a.steps or 500, a.mode)))
    else:
        print(json.dumps(run_engine(a.requests or 147, a.context or 32768, a.block_size,
                                    a.steps or 300, a.mode, a.max_num_seqs, a.profile,
                                    gc_freeze=not a.no_gc_freeze)))


if __name__ == "__main__":
    main()
