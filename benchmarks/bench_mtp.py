"""MTP speculative decode throughput vs non-speculative decoding, at injected acceptance rates.

Random weights cannot give a real acceptance rate (a random MTP layer's drafts are almost never
the target's argmax), so the acceptance is *injected*: a k = 0 greedy run first records every
request's output; speculative runs then replace the MTP drafts with that known continuation,
each draft token kept right with probability ``--accept`` (else a wrong id). The MTP layer
still runs (its cost is measured), verification is the real one, and every speculative run's
outputs are checked identical to the k = 0 run (lossless). Figures are ratios against the k = 0
baseline measured in the same process.

What is measured: wall time of the decode phase (all requests admitted and prefilled first,
then timed until done) and output tokens per second; per run the realised acceptance rate, the
mean accepted length (tokens per verify step), the mean / max union of a verify group's
selections, hot-buffer misses, and how many verify steps replayed CUDA graphs. Speculative
steps run in the synchronous loop, with their CUDA graphs (verify of k + 1 tokens per request,
MTP drafts) unless ``--spec-modes`` says ``eager`` (``graph,eager`` measures both); the k = 0
baseline runs with its CUDA graphs and the overlapped loop unless ``--baseline-eager``.

    python benchmarks/bench_mtp.py                        # CUDA, tiny-but-sparse model
    python benchmarks/bench_mtp.py --geometry production --layers 4 --context 16384
    python benchmarks/bench_mtp.py --device cpu --requests 4 --context 256 --outputs 16  # smoke
    python benchmarks/bench_mtp.py --ks 2 --accepts 0.7 --spec-modes graph,eager  # graphs' gain

Every run gets its own ``LLM`` (torch's garbage collector runs between them so GPU memory and
the pinned host pool go back); the GPU pool defaults to what every request needs resident
(``--gpu-blocks`` forces pressure) and the host pool to what they need on host
(``--host-pool-gib`` overrides). Before timing, a warm-up pass runs every k once at a short
context (``--warmup-context``; default on CUDA) so no kernel compiles inside a measurement, and
each run captures its CUDA graphs before its requests. The engine is driven through its public
API (``LLM``, ``add_request``, ``step``, ``stats``); the one seam used is
``LLM.core.draft_hook``, the engine's documented test and benchmark hook for replacing MTP
drafts. ``--out`` writes every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from hisparse import LLM, SamplingParams
from hisparse.bench import scratch_dir
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint


def oracle_hook(refs: dict, accept: float, vocab: int, seed: int = 0):
    rng = random.Random(seed)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            ref = refs.get(tuple(req.prompt_token_ids))
            if ref is None:             # a warm-up request: its own MTP drafts
                new.append(dr)
                continue
            done = req.num_output_tokens + len(out)
            want = ref[done:done + len(dr)]
            new.append([t if rng.random() < accept else (t + 1) % vocab for t in want]
                       + dr[len(want):])
        return new

    return hook


def host_pool_gib(path: str, args, k: int) -> float:
    """Host pool for every request at full length (every cache layer's row and key, in the
    run's dtype)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"] + (1 if k else 0)
    elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    per_token = layers * elem * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
                              + cfg["index_head_dim"])
    pages = -(-(args.context + args.outputs + 8) // args.block_size)
    n = args.requests
    return round(n * pages * args.block_size * per_token * 1.25 / (1 << 30) + 1 / 64, 4)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _drive(llm, ids: list[str], outs: dict, until_first: bool) -> int:
    """Step; keep each request's latest output. ``until_first``: stop once every one of ``ids``
    has a token, else when nothing is left. Returns the steps taken."""
    steps = 0
    while llm.has_unfinished_requests():
        if until_first and all(i in outs for i in ids):
            break
        for o in llm.step():
            outs[o.request_id] = o
        steps += 1
    return steps


def run_one(path: str, args, k: int, prompts, params, refs=None, accept: float = 1.0,
            spec_eager: bool = False) -> dict:
    max_len = args.context + args.outputs + 8
    pages = -(-max_len // args.block_size)
    kw = dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
              max_model_len=max_len, max_num_seqs=args.requests,
              max_num_batched_tokens=args.batched_tokens, mode=args.mode,
              num_speculative_tokens=k, kv_cache_dtype=args.kv_cache_dtype,
              enforce_eager=args.baseline_eager if k == 0 else spec_eager,
              # every request resident unless --gpu-blocks forces pressure
              num_gpu_blocks=args.gpu_blocks or args.requests * (pages + 2))
    if args.mode != "gpu-only":
        kw["host_pool_gib"] = args.host_pool_gib or host_pool_gib(path, args, k)
    llm = LLM(path, **kw)
    vocab = llm.model_config.vocab_size
    if k and refs is not None:
        llm.core.draft_hook = oracle_hook(refs, accept, vocab)
    llm.capture_cuda_graphs()       # no-op when eager / on CPU
    ids = [llm.add_request(p, params) for p in prompts]
    outs: dict = {}
    _drive(llm, ids, outs, until_first=True)     # prefill: every request has its first token
    _sync(args.device)
    n0 = sum(len(outs[i].outputs[0].token_ids) for i in ids)
    t0 = time.perf_counter()
    steps = _drive(llm, ids, outs, until_first=False)
    _sync(args.device)
    dt = time.perf_counter() - t0
    for i in ids:
        if not outs[i].finished or outs[i].outputs[0].finish_reason == "error":
            raise RuntimeError(f"request {i} failed: {outs[i].outputs[0].error}")
    toks = [list(outs[i].outputs[0].token_ids) for i in ids]
    n1 = sum(len(t) for t in toks)
    s = llm.stats()
    spec_graphs = getattr(llm.runner, "spec_graphs", None)
    res = dict(k=k, accept_injected=accept if k else None,
               spec_mode=("eager" if spec_eager else "graph") if k else None,
               graph_verify_steps=spec_graphs.replays["verify"] if spec_graphs else 0,
               decode_s=round(dt, 4), steps=steps,
               decode_tok_s=round((n1 - n0) / dt, 1), hot_misses=s["hot_misses"],
               spec_acceptance_rate=round(s["spec_acceptance_rate"], 3),
               spec_mean_accepted_length=round(s["spec_mean_accepted_length"], 3),
               spec_union_size_mean=round(s["spec_union_size_mean"], 1),
               spec_union_size_max=s["spec_union_size_max"],
               spec_draft_tokens=s["spec_draft_tokens"])
    llm.shutdown()      # frees the model, caches and graphs
    return res, toks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8"], default="bf16",
                   help="KV format (default bf16: the format the recorded runs used)")
    p.add_argument("--geometry", choices=["tiny", "production"], default="tiny",
                   help="tiny dims, or DeepSeek-V3.2's attention / indexer dims")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--topk", type=int, default=None, help="index_topk (default: geometry's)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--outputs", type=int, default=128)
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--accepts", default="0.0,0.5,0.7,0.9,1.0")
    p.add_argument("--mode", default="hisparse")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="GPU pool (blocks); small values force spills and host reads")
    p.add_argument("--host-pool-gib", type=float, default=None,
                   help="default: what every request needs at full length")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--baseline-eager", action="store_true",
                   help="k = 0 without CUDA graphs (compare eager with eager)")
    p.add_argument("--spec-modes", default="graph",
                   help="comma list of graph (CUDA graphs) / eager: how k > 0 runs")
    p.add_argument("--checkpoint", default=None, help="reuse a checkpoint with MTP layers")
    p.add_argument("--warmup", dest="warmup", action="store_true", default=None,
                   help="untimed pass over every k first (default on CUDA)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--warmup-context", type=int, default=512)
    p.add_argument("--out", default=None, help="write every row as JSON to this file")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.device.startswith("cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (--device cpu for the smoke run)")
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    accepts = [float(x) for x in args.accepts.split(",") if x.strip()]
    modes = [m.strip() for m in args.spec_modes.split(",") if m.strip()]
    if not modes or any(m not in ("graph", "eager") for m in modes):
        p.error(f"--spec-modes: comma list of graph / eager, got {args.spec_modes!r}")

    path = args.checkpoint
    if path is None:
        over = dict(PRODUCTION_GEOMETRY) if args.geometry == "production" else {}
        over["index_topk"] = args.topk or over.get("index_topk", 64)
        path = make_random_checkpoint(scratch_dir("bench_mtp_"), "deepseek_v32",
                                      seed=0, num_hidden_layers=args.layers,
                                      num_nextn_predict_layers=1,
                                      max_position_embeddings=args.context + args.outputs + 64,
                                      save_dtype="bfloat16", **over)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 300) for _ in range(args.context)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.outputs, ignore_eos=True)
    if args.warmup:     # same batch, short prompts: compile every kernel before timing
        t = time.perf_counter()
        wargs = argparse.Namespace(**{**vars(args), "context": min(args.context,
                                                                   args.warmup_context),
                                      "outputs": min(args.outputs, 8)})
        wp = [{"prompt_token_ids": pr["prompt_token_ids"][:wargs.context]} for pr in prompts]
        wparams = SamplingParams(temperature=0.0, max_tokens=wargs.outputs, ignore_eos=True)
        run_one(path, wargs, 0, wp, wparams)
        for k in ks:
            for m in modes:
                run_one(path, wargs, k, wp, wparams, spec_eager=m == "eager")
        print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    base, ref = run_one(path, args, 0, prompts, params)
    refs = {tuple(pr["prompt_token_ids"]): r for pr, r in zip(prompts, ref)}
    rows = [base]
    print(json.dumps(base), flush=True)
    for k in ks:
        for a in accepts:
            for m in modes:
                res, toks = run_one(path, args, k, prompts, params, refs, a,
                                    spec_eager=m == "eager")
                res["lossless"] = toks == ref
                res["speedup_vs_k0"] = round(res["decode_tok_s"] / base["decode_tok_s"], 3)
                rows.append(res)
                print(json.dumps(res), flush=True)
    ok = all(r.get("lossless", True) for r in rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=vars(args), rows=rows, ok=ok), f, indent=1)
    cols = ["k", "accept_injected", "spec_mode", "graph_verify_steps", "decode_tok_s",
            "speedup_vs_k0", "spec_acceptance_rate",
            "spec_mean_accepted_length", "spec_union_size_mean", "hot_misses", "lossless"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
