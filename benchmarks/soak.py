"""Randomized soak of the real engine: many requests through a tiny tiered pool with arrivals
over time, aborts, forced preemptions, stop ids, seeded sampling and failing requests.

Checks, at the end: every request finished exactly once with the expected reason; outputs of
completed requests equal an unconstrained (GPU-only, big pool) run of the same requests (stop
ids applied to its outputs); failing requests finished with ``finish_reason="error"`` without
disturbing the others; every pool is back to full (no leaked block).

    PYTHONPATH=. python benchmarks/soak.py        # release check: 3000 requests, all modes
    PYTHONPATH=. python benchmarks/soak.py --requests 300 --modes hisparse --seed 3 --rounds 5
    PYTHONPATH=. python benchmarks/soak.py --device cuda    # the GPU matrix (issue 21)

On CUDA (``--device cuda``) the engine under test runs the engine's CUDA defaults: bf16, CUDA
graphs, the overlapped loop, ``kv_cache_dtype="auto"`` (FP8 rows and keys at this geometry),
the ``score`` policy, over a GPU pool small enough to spill and preempt, through
:data:`GPU_MATRIX` (the modes, ``score+prefetch``, MTP with k = 1 and 2); its reference is an
eager, synchronous, unconstrained GPU-only run with the same dtype and KV format. A mismatch
names the request, the first token that differs and the engine step that produced it.

``tests/engine/test_soak.py`` runs a short version in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field

from hisparse import LLM, SamplingParams
from hisparse.bench import scratch_dir
from hisparse.config import KVCacheConfig


@dataclass
class SoakReport:
    mode: str
    requests: int
    steps: int = 0
    completed: int = 0
    aborted: int = 0
    errored: int = 0
    preemptions: int = 0
    stopped_by_stop_id: int = 0
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)


@dataclass
class _Spec:
    prompt: list[int]
    params: SamplingParams
    compare: bool            # seeded or greedy: must equal the reference
    poison: bool             # its logits turn NaN: must finish with an error
    stop_pick: float | None  # where in the reference output to take a stop id from


def _specs(n: int, rng: random.Random, vocab: int, max_prompt: int, max_tokens: int,
           poison_rate: float) -> list[_Spec]:
    shared = [[rng.randrange(2, vocab) for _ in range(rng.randrange(8, max_prompt // 2))]
              for _ in range(3)]
    specs = []
    for _ in range(n):
        length = rng.randrange(1, max_prompt)
        prompt = [rng.randrange(2, vocab) for _ in range(length)]
        if rng.random() < 0.3:                       # prefix-cache traffic
            prompt = (rng.choice(shared) + prompt)[:max_prompt]
        kind = rng.random()
        mt = rng.randrange(1, max_tokens + 1)
        ignore_eos = rng.random() < 0.8
        if kind < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=ignore_eos)
        elif kind < 0.8:
            params = SamplingParams(temperature=rng.choice([0.6, 1.0, 1.3]),
                                    top_k=rng.choice([-1, 1, 5, 50]),
                                    top_p=rng.choice([1.0, 0.9, 0.5]),
                                    seed=rng.randrange(1 << 40), max_tokens=mt,
                                    ignore_eos=ignore_eos)
        else:  # unseeded sampling: traffic only, not comparable
            params = SamplingParams(temperature=1.0, max_tokens=mt, ignore_eos=ignore_eos)
        compare = params.greedy or params.seed is not None
        stop_pick = rng.random() if compare and mt > 1 and rng.random() < 0.3 else None
        specs.append(_Spec(prompt, params, compare, rng.random() < poison_rate, stop_pick))
    return specs


def _expected(ref_tokens: list[int], stop_ids: list[int]) -> tuple[list[int], str | None]:
    for i, t in enumerate(ref_tokens):
        if t in stop_ids:
            return ref_tokens[:i + 1], "stop"
    return ref_tokens, None


def run_soak(path: str, requests: int = 300, seed: int = 0, mode: str = "hisparse",
             max_prompt: int = 60, max_tokens: int = 12, block_size: int = 8,
             num_gpu_blocks: int | None = None, abort_rate: float = 0.03,
             preempt_rate: float = 0.05, device: str = "cpu", async_scheduling: bool = True,
             dtype: str | None = None, kv_cache_dtype: str = "auto",
             hot_policy: str | None = None, num_speculative_tokens: int = 0,
             poison_rate: float = 0.02, verbose: bool = False) -> SoakReport:
    """Run one soak; raise AssertionError on any mismatch, leak or lost request.

    The reference is an unconstrained GPU-only engine, eager, with the synchronous loop (same
    dtype and KV format); the engine under test uses ``mode`` on a tiny pool, CUDA graphs where
    the device has them, and the overlapped loop when ``async_scheduling`` (speculative decoding
    always runs the synchronous loop). ``dtype`` defaults to float32 on CPU, bfloat16 on CUDA.
    ``poison_rate``: requests whose logits turn NaN (they must finish with an error; only
    without speculative decoding, whose steps bypass the hook).
    """
    rng = random.Random(seed)
    max_len = max_prompt + max_tokens + 8 + num_speculative_tokens
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    common = dict(device=device, dtype=dtype, block_size=block_size, max_model_len=max_len,
                  max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    ref = LLM(path, mode="gpu-only", max_num_seqs=64, async_scheduling=False,
              enforce_eager=True, **common)
    vocab = ref.model_config.vocab_size
    specs = _specs(requests, rng, vocab, max_prompt, max_tokens,
                   poison_rate if not num_speculative_tokens else 0.0)

    # Reference outputs (no stop ids; they are applied to these outputs afterwards).
    if num_speculative_tokens:   # speculative sampling keeps the distribution, not the draws
        for sp in specs:
            sp.compare = sp.compare and sp.params.greedy
            sp.stop_pick = sp.stop_pick if sp.compare else None
    idx = [i for i, s in enumerate(specs) if s.compare and not s.poison]
    ref_outs = ref.generate([{"prompt_token_ids": specs[i].prompt} for i in idx],
                            [specs[i].params for i in idx])
    want: dict[int, tuple[list[int], str | None]] = {}
    for i, out in zip(idx, ref_outs):
        toks = out.outputs[0].token_ids
        s = specs[i]
        if s.stop_pick is not None and toks:
            stop = toks[int(s.stop_pick * len(toks))]
            s.params = dataclasses.replace(s.params, stop_token_ids=[stop])
            toks, reason = _expected(toks, [stop])
            want[i] = (toks, reason or out.outputs[0].finish_reason)
        else:
            want[i] = (toks, out.outputs[0].finish_reason)
    del ref

    topk = ref_topk(path)
    hot = max(2, num_speculative_tokens + 1) * topk
    if num_gpu_blocks is None:   # tiny: the smallest workable pool plus a little
        num_gpu_blocks = KVCacheConfig(
            block_size=block_size, num_gpu_blocks=1 << 30, num_host_blocks=1 << 30,
            num_indexer_blocks=1 << 30, max_model_len=max_len, index_topk=hot // 2,
            hot_buffer_size=hot, max_num_batched_tokens=common["max_num_batched_tokens"],
            mode=mode).min_gpu_blocks + 4
    extra = {"hot_policy": hot_policy} if hot_policy else {}
    if num_speculative_tokens:
        extra["num_speculative_tokens"] = num_speculative_tokens
    llm = LLM(path, mode=mode, max_num_seqs=8, hot_buffer_size=hot, host_pool_gib=0.05,
              num_gpu_blocks=num_gpu_blocks, async_scheduling=async_scheduling, **extra,
              **common)
    poison_ids: set[str] = set()
    real_execute = llm.runner.execute

    def execute(plan, input_ids):
        logits, acks = real_execute(plan, input_ids)
        rows = [s.req_id for s in plan.seqs if s.sample]
        bad = [r for r, rid in enumerate(rows) if rid in poison_ids]
        if bad:
            logits = logits.clone()
            logits[bad] = float("nan")
        return logits, acks

    llm.runner.execute = execute
    report = SoakReport(mode=mode, requests=requests)
    t0 = time.perf_counter()
    pending = list(range(requests))
    live: dict[str, int] = {}
    aborted: set[int] = set()
    results: dict[int, object] = {}
    token_steps: dict[int, list[int]] = {}     # per request: the step each token came from
    while pending or llm.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4) if pending else 0):
            if not pending:
                break
            i = pending.pop(0)
            rid = llm.add_request({"prompt_token_ids": specs[i].prompt}, specs[i].params)
            live[rid] = i
            if specs[i].poison:
                poison_ids.add(rid)
        if live and rng.random() < abort_rate:
            rid = rng.choice(sorted(live))
            llm.abort(rid)
            aborted.add(live.pop(rid))
            report.aborted += 1
        if llm.scheduler.running and rng.random() < preempt_rate:
            victim = rng.choice(llm.scheduler.running)
            if llm.scheduler.preempt(victim.req_id):
                report.preemptions += 1
        for out in llm.step():
            if out.request_id not in live:
                continue
            got = token_steps.setdefault(live[out.request_id], [])
            got += [report.steps] * (len(out.outputs[0].token_ids) - len(got))
            if not out.finished:
                continue
            i = live.pop(out.request_id)
            assert i not in results, f"request {out.request_id} finished twice"
            results[i] = out
        report.steps += 1
        assert report.steps < 200 * requests, "the soak does not make progress"
    report.seconds = time.perf_counter() - t0

    assert not live, f"requests never finished: {sorted(live)[:5]}"
    assert len(results) + len(aborted) == requests
    for i, out in results.items():
        c = out.outputs[0]
        s = specs[i]
        if s.poison:
            assert c.finish_reason == "error" and "non-finite" in c.error, (i, c)
            report.errored += 1
            continue
        assert c.error is None and c.finish_reason in ("stop", "length"), (i, c)
        report.completed += 1
        if i in want:
            toks, reason = want[i]
            if c.token_ids != toks:
                j = next((j for j, (a, b) in enumerate(zip(c.token_ids, toks)) if a != b),
                         min(len(c.token_ids), len(toks)))
                step = token_steps.get(i, [])[j] if j < len(token_steps.get(i, [])) else None
                raise AssertionError(
                    f"{mode}: request {i} ({s.params}, prompt of {len(s.prompt)}): output "
                    f"token {j} (engine step {step}) is {c.token_ids[j:j + 1]}, the reference's "
                    f"{toks[j:j + 1]}; got {c.token_ids}, want {toks}")
            assert c.finish_reason == reason, (i, c.finish_reason, reason)
            report.stopped_by_stop_id += bool(s.params.stop_token_ids and reason == "stop")
    st = llm.stats()
    cfg = llm.kv_config
    assert st["free_gpu_blocks"] == cfg.num_gpu_blocks, "GPU blocks leaked"
    assert st["free_indexer_blocks"] == cfg.num_indexer_blocks, "indexer blocks leaked"
    if cfg.uses_host:
        assert st["free_host_blocks"] == cfg.num_host_blocks, "host blocks leaked"
    report.stats = st
    if verbose:
        print(report)
    return report


def ref_topk(path: str) -> int:
    from hisparse.models.loader import load_config

    return load_config(path).index_topk


# The CUDA soak (issue 21): the engine's CUDA defaults in every run, plus the variants users
# turn on. (mode, extra run_soak arguments)
GPU_MATRIX: list[tuple[str, dict]] = [
    ("hisparse", {}),
    ("hisparse", {"hot_policy": "score+prefetch"}),
    ("always-host", {}),
    ("gpu-only", {}),
    ("hisparse", {"num_speculative_tokens": 1}),
    ("hisparse", {"num_speculative_tokens": 2, "hot_policy": "score+prefetch"}),
]


def gpu_soak_checkpoint(directory: str) -> str:
    """A small dense DSA model at DeepSeek's MLA / indexer geometry (so ``auto`` picks FP8 KV
    on CUDA) with an MTP layer; top-k 32, so prompts of up to 160 tokens are sparse."""
    from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

    geo = dict(PRODUCTION_GEOMETRY, index_topk=32)
    return make_random_checkpoint(directory, "deepseek_v32", seed=21, hidden_size=256,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  q_lora_rank=128, num_hidden_layers=3,
                                  first_k_dense_replace=100, num_nextn_predict_layers=1, **geo)


def _line(seed: int, label: str, rep: SoakReport) -> str:
    st = rep.stats
    return (f"seed {seed} {label:<32} {rep.requests} requests in {rep.seconds:.1f} s "
            f"({rep.steps} steps): {rep.completed} completed, {rep.aborted} aborted, "
            f"{rep.errored} errored, {rep.preemptions} preemptions, {rep.stopped_by_stop_id} "
            f"stop-id stops; kv {st.get('kv_cache_dtype')}, spilled {st['spilled_pages']}, "
            f"host-read switches {st.get('host_read_switches')}, hot misses {st['hot_misses']}, "
            f"prefix hit tokens {st['prefix_hit_tokens']} ({st['host_prefix_hit_tokens']} from "
            f"host); pools "
            "full, outputs equal the reference")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random one)")
    p.add_argument("--requests", type=int, default=None,
                   help="per run (default 3000 on CPU, 400 per GPU_MATRIX entry on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="seeds seed..seed+rounds-1")
    p.add_argument("--modes", nargs="+", default=["hisparse", "always-host", "gpu-only"],
                   help="CPU runs (CUDA runs GPU_MATRIX)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (tiny models: more threads only contend)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    path = a.model
    if path is None and cuda:
        path = gpu_soak_checkpoint(scratch_dir("hisparse-soak-"))
    elif path is None:
        from hisparse.models.random_checkpoint import make_random_checkpoint
        path = make_random_checkpoint(scratch_dir("hisparse-soak-"),
                                      "deepseek_v32", seed=11, index_topk=16,
                                      num_hidden_layers=3)
    runs = GPU_MATRIX if cuda else [(m, {}) for m in a.modes]
    requests = a.requests or (400 if cuda else 3000)
    shape = dict(max_prompt=160, max_tokens=16, block_size=16) if cuda else {}
    for r in range(a.rounds):
        for j, (mode, extra) in enumerate(runs):
            seed = a.seed + r * len(runs) + j
            rep = run_soak(path, requests=requests, seed=seed, mode=mode, device=a.device,
                           **shape, **extra)
            label = mode + "".join(f" {k}={v}" for k, v in extra.items())
            print(_line(seed, label, rep), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
