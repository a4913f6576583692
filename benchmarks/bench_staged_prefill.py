"""Staged prefill (issue 14): a prompt four times larger than the GPU KV budget, prefilled through
the staging area, against GPU-only with enough GPU memory for the whole prompt, in one run.

One request per mode, same prompt, same dummy weights (``torch.manual_seed`` before each
``LLM``):

- ``gpu-only``: ``num_gpu_blocks`` = the prompt's pages (everything resident); the baseline.
- ``hisparse`` / ``always-host``: ``num_gpu_blocks`` = ``--gpu-fraction`` of the prompt (default a
  quarter; raised to the engine's minimum if smaller, reported as ``budget_clamped``). The prompt's
  clean pages are released while it prefills and later chunks read their selected host-only
  history rows through the staging area (``ops.stage``: zero-copy from the pinned pool).

Reported per mode: time to first token (TTFT) of a ``max_tokens=--gen-tokens`` greedy request,
taken when its first token is returned (CUDA synchronized), prefill tok/s = context / TTFT and
the ratio against GPU-only measured in the same process; ``staged_rows`` / ``staged_bytes`` /
``staged_chunks``, ``spilled_pages``, ``h2d_bytes`` (deltas of ``LLM.stats()`` over the
request); the peak GPU blocks in use (``num_gpu_blocks - free_gpu_blocks`` polled after every
step: ``stats()`` synchronizes, which costs a few ms per multi-second prefill chunk; turn it off
with ``--no-track-blocks``); and the first greedy tokens, asserted equal to GPU-only's
(losslessness: the exit code is 1 when they differ or a staged mode staged nothing).

Model: the decode benchmark's DeepSeek-V3.2-shaped config (``hisparse.bench.decode``:
``model_shape_config``; ``--model-shape tp8-stand-in`` = one TP-8 rank's attention / indexer with
dense MLPs), ``--layers`` deep, ``load_format="dummy"``, bf16. The real indexer runs on random
weights, so its top-k selections are arbitrary (not a real model's locality): that is fine for
prefill cost — every staged token still selects ``index_topk`` rows over its whole history, so the
number of distinct rows a chunk stages is if anything larger than with real attention. Only the
public engine API is used (``LLM``, ``add_request``, ``step``, ``stats``).

Before timing, every mode runs once at a small context (``--warmup-context``; staged modes at
their minimum GPU pool so staging kernels compile too). Default on CUDA, off on CPU.

    python benchmarks/bench_staged_prefill.py                         # H200: 128k, 4 layers
    python benchmarks/bench_staged_prefill.py --context 65536 --staging-rows 65536
    python benchmarks/bench_staged_prefill.py --device cpu --context 2048 --layers 2   # smoke

``--device cpu`` defaults to ``--geometry tiny`` (small hidden size, vocab, heads and top-k) so
the whole comparison runs in seconds. ``--kv-cache-dtype fp8`` stages 656-B rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from hisparse.bench import scratch_dir

TINY_GEOMETRY = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, q_lora_rank=64,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, index_n_heads=32, index_head_dim=32, index_topk=64,
)
MODES = ("gpu-only", "hisparse", "always-host")


def write_model(args) -> tuple[str, dict]:
    """config.json of the benchmark model in a temporary directory; returns (path, config)."""
    from hisparse.bench.decode import model_shape_config

    cfg = model_shape_config(args.model_shape, args.layers)
    if args.geometry == "tiny":
        cfg.update(TINY_GEOMETRY)
        cfg.pop("quantization_config", None)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0),
                                         args.context + args.gen_tokens + 64)
    path = scratch_dir("hisparse-staged-prefill-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path, cfg


def kv_token_bytes(cfg: dict, kv_cache_dtype: str) -> int:
    """Host-pool bytes per token (every layer's MLA row + indexer key; an upper bound)."""
    rank, rope, idx = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    if kv_cache_dtype == "fp8":
        from hisparse.ops import index_key_bytes, mla_row_bytes
        row, key = mla_row_bytes(rank, rope), index_key_bytes(idx)
    else:
        row, key = (rank + rope) * 2, idx * 2
    return cfg["num_hidden_layers"] * (row + key)


def min_gpu_blocks(mode: str, cfg: dict, max_len: int, args) -> int:
    """The engine's smallest workable GPU pool for this request shape (its own rule)."""
    from hisparse.config import KVCacheConfig

    big = 1 << 40
    return KVCacheConfig(block_size=args.block_size, num_gpu_blocks=big, num_host_blocks=big,
                         num_indexer_blocks=big, max_model_len=max_len,
                         index_topk=cfg["index_topk"], max_num_seqs=1,
                         max_num_batched_tokens=args.chunk, mode=mode,
                         staging_rows=args.staging_rows).min_gpu_blocks


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_llm(path: str, cfg: dict, mode: str, context: int, args, fraction: float):
    """(llm, num_gpu_blocks, clamped) for one mode at ``context`` tokens."""
    from hisparse import LLM

    max_len = context + args.gen_tokens
    pages = -(-max_len // args.block_size)
    clamped = False
    kw = {}
    if mode == "gpu-only":
        blocks = pages
    else:
        want = int(context * fraction) // args.block_size
        blocks = max(want, min_gpu_blocks(mode, cfg, max_len, args))
        clamped = blocks > want
        gib = pages * args.block_size * kv_token_bytes(cfg, args.kv_cache_dtype) / (1 << 30)
        kw = dict(host_pool_gib=round(gib * 1.25 + 1 / 64, 4), staging_rows=args.staging_rows)
    torch.manual_seed(args.seed)          # identical dummy weights in every mode
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy",
              block_size=args.block_size, num_gpu_blocks=blocks, mode=mode,
              max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=args.chunk,
              kv_cache_dtype=args.kv_cache_dtype, enforce_eager=not args.cuda_graphs, **kw)
    return llm, blocks, clamped


def prefill_once(llm, ids: list[int], args, track_blocks: bool) -> dict:
    """One greedy request: TTFT, its tokens, stats deltas, peak GPU blocks in use."""
    from hisparse import SamplingParams

    before = llm.stats()
    total = before["num_gpu_blocks"]
    peak = total - before["free_gpu_blocks"]
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    _sync(args.device)
    t0 = time.perf_counter()
    rid = llm.add_request({"prompt_token_ids": ids}, params)
    ttft, final, steps = None, None, 0
    while llm.has_unfinished_requests():
        outs = llm.step()
        steps += 1
        for o in outs:
            if o.request_id != rid:
                continue
            if ttft is None and o.outputs[0].token_ids:
                _sync(args.device)
                ttft = time.perf_counter() - t0
            if o.finished:
                final = o
        if track_blocks:
            peak = max(peak, total - llm.stats()["free_gpu_blocks"])
    if final is None or final.outputs[0].finish_reason == "error":
        err = None if final is None else final.outputs[0].error
        raise RuntimeError(f"request {rid} did not finish cleanly: {err}")
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in ("staged_rows", "staged_bytes", "staged_chunks",
                                               "spilled_pages", "h2d_bytes", "d2h_bytes",
                                               "host_read_switches", "hot_misses")}
    return dict(ttft_s=ttft, tokens=list(final.outputs[0].token_ids), steps=steps,
                peak_gpu_blocks_used=peak, **delta)


def run_mode(path: str, cfg: dict, mode: str, prompts: list[list[int]], args) -> dict:
    llm, blocks, clamped = make_llm(path, cfg, mode, len(prompts[0]), args, args.gpu_fraction)
    runs = [prefill_once(llm, ids, args, args.track_blocks) for ids in prompts]
    llm.shutdown()
    context = len(prompts[0])
    best = min(runs, key=lambda r: r["ttft_s"])
    first = runs[0]
    return dict(
        mode=mode, context=context, num_gpu_blocks=blocks,
        gpu_budget_tokens=blocks * args.block_size, budget_clamped=clamped,
        peak_gpu_blocks_used=max(r["peak_gpu_blocks_used"] for r in runs),
        ttft_s=round(best["ttft_s"], 4), ttft_all_s=[round(r["ttft_s"], 4) for r in runs],
        prefill_tok_s=round(context / best["ttft_s"], 1),
        staged_rows=first["staged_rows"], staged_bytes=first["staged_bytes"],
        staged_chunks=first["staged_chunks"], spilled_pages=first["spilled_pages"],
        h2d_bytes=first["h2d_bytes"], d2h_bytes=first["d2h_bytes"],
        host_read_switches=first["host_read_switches"], hot_misses=first["hot_misses"],
        steps=first["steps"], tokens=[r["tokens"] for r in runs])


def warm_up(path: str, cfg: dict, modes: list[str], args) -> None:
    """Every mode once at a small context so no kernel compiles inside a timed run; staged
    modes at their minimum pool (a quarter of nothing: their prompt still spills)."""
    ctx = min(args.context, args.warmup_context)
    ids = random.Random(args.seed + 1).choices(range(2, cfg["vocab_size"]), k=ctx)
    for mode in modes:
        llm, _, _ = make_llm(path, cfg, mode, ctx, args, fraction=0.0)
        prefill_once(llm, ids, args, track_blocks=False)
        llm.shutdown()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def markdown(rows: list[dict]) -> str:
    cols = ["mode", "context", "num_gpu_blocks", "peak_gpu_blocks_used", "ttft_s",
            "prefill_tok_s", "vs_gpu_only", "staged_rows", "staged_bytes", "staged_chunks",
            "spilled_pages", "lossless"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=131072, help="prompt tokens")
    p.add_argument("--gpu-fraction", type=float, default=0.25,
                   help="staged modes' GPU KV budget as a fraction of the prompt")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model-shape", default="tp8-stand-in",
                   choices=["tp8-stand-in", "deepseek-v3.2-tp8-rank", "glm-5-tp8-rank"])
    p.add_argument("--geometry", choices=["model", "tiny"], default=None,
                   help="tiny: small hidden size / vocab / heads / top-k (default on CPU)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma list; gpu-only is the baseline of the ratios and token checks")
    p.add_argument("--gen-tokens", type=int, default=4,
                   help="max_tokens of the request (1..; the tokens compared with gpu-only)")
    p.add_argument("--chunk", type=int, default=None,
                   help="max_num_batched_tokens (prefill chunk); default 8192, tiny 128")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--staging-rows", type=int, default=None,
                   help="LLM(staging_rows=...); default: the engine's (a whole history, "
                        "capped at 262144 rows)")
    p.add_argument("--repeats", type=int, default=1,
                   help="requests per mode (fresh prompts; TTFT = the best)")
    p.add_argument("--warmup", dest="warmup", action="store_true", default=None)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--warmup-context", type=int, default=16384)
    p.add_argument("--no-track-blocks", dest="track_blocks", action="store_false",
                   help="do not poll stats() after every step (no peak GPU blocks)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture the decode steps after the first token (default: eager)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_staged_prefill.json",
                   help="JSON file (or a directory: <dir>/bench_staged_prefill.json)")
    a = p.parse_args(argv)
    if a.geometry is None:
        a.geometry = "model" if a.device.startswith("cuda") else "tiny"
    if a.chunk is None:
        a.chunk = 128 if a.geometry == "tiny" else 8192
    if a.warmup is None:
        a.warmup = a.device.startswith("cuda")
    if a.gen_tokens < 1 or a.repeats < 1 or not 0.0 < a.gpu_fraction <= 1.0:
        p.error("--gen-tokens and --repeats must be >= 1, --gpu-fraction in (0, 1]")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu for the smoke run)")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (choose from {list(MODES)})")
    path, cfg = write_model(args)
    print(f"model {args.model_shape}/{args.geometry}: {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, index_topk {cfg['index_topk']}, KV {args.kv_cache_dtype}; "
          f"context {args.context}, chunk {args.chunk}, GPU fraction {args.gpu_fraction}, "
          f"device {args.device}", flush=True)
    if args.warmup:
        t = time.perf_counter()
        warm_up(path, cfg, modes, args)
        print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    rng = random.Random(args.seed)
    prompts = [rng.choices(range(2, cfg["vocab_size"]), k=args.context)
               for _ in range(args.repeats)]
    rows = []
    for mode in modes:
        t = time.perf_counter()
        row = run_mode(path, cfg, mode, prompts, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        print(f"  {mode}: {time.perf_counter() - t:.1f} s wall", flush=True)
    base = next((r for r in rows if r["mode"] == "gpu-only"), None)
    ok = True
    for r in rows:
        r["first_tokens"] = r["tokens"][0][:8]
        if base is not None:
            r["vs_gpu_only"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
            r["lossless"] = r["tokens"] == base["tokens"]
            ok &= r["lossless"]
        if r["mode"] != "gpu-only" and r["num_gpu_blocks"] * args.block_size < args.context:
            r["staged_as_expected"] = r["staged_rows"] > 0 and r["staged_chunks"] > 0
            ok &= r["staged_as_expected"]
    result = dict(config={k: v for k, v in vars(args).items()},
                  model={k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size",
                                             "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
                                             "index_head_dim", "index_topk")},
                  device_name=(torch.cuda.get_device_name() if args.device.startswith("cuda")
                               else "cpu"),
                  results=rows, ok=ok)
    out = args.out
    if os.path.isdir(out) or not out.endswith(".json"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "bench_staged_prefill.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    if not ok:
        print("CHECK FAILED: a staged mode's tokens differ from gpu-only or nothing was staged",
              file=sys.stderr)
    print(markdown(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
