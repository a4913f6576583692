"""``hisparse bench-serve``: drive the OpenAI-compatible server over HTTP with Poisson arrivals
and long prompts; report request throughput, TTFT and TPOT percentiles per mode.

    hisparse bench-serve --model DIR --modes gpu-only,hisparse,always-host \\
        --num-prompts 64 --request-rate 4 --input-len 8192 --output-len 256
    hisparse bench-serve --url http://host:8000 --vocab-size 129280 ...   # a running server

With ``--model`` each mode gets its own engine and an in-process server on a free port (the
same engine flags as ``hisparse serve``); with ``--url`` the running server is measured once
(the model it serves from ``GET /v1/models`` unless ``--served-model-name`` is given).
Prompts are random token ids (seeded); every request sets ``ignore_eos`` so output lengths are
fixed. Ratios between modes of one run are the figures to quote (machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass


@dataclass
class RequestResult:
    ok: bool
    ttft: float = math.nan
    tpot: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    error: str = ""


def _pct(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


async def _one(client, url: str, model: str, prompt: list[int], output_len: int
               ) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if n and first is None:
                    first = time.perf_counter()
                tokens += n
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="no tokens")
    tpot = (end - first) / (tokens - 1) if tokens > 1 else math.nan
    return RequestResult(True, first - start, tpot, end - start, tokens)


def served_model(url: str, api_key: str | None = None) -> str:
    """The one model a server at ``url`` lists in ``GET /v1/models`` (ValueError if it lists
    none or several, or cannot be reached)."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=_auth(api_key), timeout=30)
        r.raise_for_status()
        ids = [m["id"] for m in r.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--url: could not list the models of {url} "
                         f"({type(e).__name__}: {str(e)[:200]}); give --served-model-name") \
            from None
    if len(ids) != 1:
        raise ValueError(f"--url: {url} serves {ids}; choose one with --served-model-name")
    return ids[0]


def wait_healthy(proc, url: str, timeout: float, log: str) -> None:
    """Wait until the server process ``proc`` answers ``GET url/health`` with 200.

    Raises ``RuntimeError`` with the last lines of its ``log`` if it exits first (a benchmark's
    servers log to temporary files that a remote run does not bring back), or after ``timeout``
    seconds (the process is killed then)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                tail = "".join(f.readlines()[-15:])
            raise RuntimeError(f"{url} exited with {proc.returncode}; {log} ends:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{url} did not come up in {timeout:.0f} s; see {log}")
        time.sleep(0.5)


def _auth(api_key: str | None) -> dict:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int,
                   request_rate: float, seed: int, api_key: str | None = None) -> dict:
    """Send ``prompts`` with exponential inter-arrival gaps (rate ``request_rate`` req/s; inf:
    all at once) and summarise."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 headers=_auth(api_key)) as client:
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, url, model, p, output_len)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(r.output_tokens for r in ok) / duration}
    for name in ("ttft", "tpot", "e2e"):
        vals = [getattr(r, name) for r in ok]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = _pct(vals, q) * 1e3
        out[f"{name}_mean_ms"] = (sum(vals) / len(vals) * 1e3) if vals else math.nan
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def _prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(input_len)] for _ in range(n)]


def _warm_up(url: str, model: str, args, vocab: int) -> None:
    """``--warmup-requests`` requests of the benchmark's lengths, all at once and not measured
    (prompts of another seed: no prefix-cache hits for the measured ones). The first requests
    of a server compile its prefill kernels (seconds)."""
    if args.warmup_requests:
        prompts = _prompts(args.warmup_requests, args.input_len, vocab, args.seed + 1)
        res = asyncio.run(run_load(url, model, prompts, args.output_len, math.inf, args.seed,
                                   getattr(args, "api_key", None)))
        if res["failed"]:
            raise RuntimeError(f"warm-up request failed: {res.get('first_error')}")


def _bench_mode(args, mode: str | None, prompts, vocab: int) -> dict:
    from hisparse.server.app import ServerThread

    if args.url:
        url = args.url.rstrip("/")
        model = args.served_model_name or served_model(url, args.api_key)
        _warm_up(url, model, args, vocab)
        return asyncio.run(run_load(url, model, prompts, args.output_len, args.request_rate,
                                    args.seed, args.api_key))
    from hisparse.engine.arg_utils import engine_kwargs
    from hisparse.engine.async_engine import AsyncLLM
    from hisparse.engine.llm import LLM
    from hisparse.server.app import create_app

    kw = engine_kwargs(args)
    kw["mode"] = mode
    llm = LLM(args.model, **kw)
    llm.capture_cuda_graphs()
    engine = AsyncLLM(llm, max_waiting_requests=max(len(prompts), 1), log_interval=0)
    try:
        with ServerThread(create_app(engine, model_name="bench")) as srv:
            _warm_up(srv.url, "bench", args, vocab)
            before = llm.stats()        # the counters below are the measured run's only
            res = asyncio.run(run_load(srv.url, "bench", prompts, args.output_len,
                                       args.request_rate, args.seed))
        after = llm.stats()
        s = {k: after[k] - before[k] for k in ("hot_hits", "hot_misses", "spilled_pages",
                                              "num_preempted")}
        lookups = s["hot_hits"] + s["hot_misses"]
        res.update(peak_running=after["peak_running"], spilled_pages=s["spilled_pages"],
                   num_preempted=s["num_preempted"],
                   hot_hit_rate=s["hot_hits"] / lookups if lookups else math.nan)
        return res
    finally:
        if engine.shutdown():
            llm.shutdown()      # one engine per mode in this process: free each one


def add_args(p: argparse.ArgumentParser) -> None:
    from hisparse.engine.arg_utils import add_engine_args

    p.add_argument("--model", default=None, help="checkpoint directory: benchmark in-process "
                   "servers, one per mode")
    p.add_argument("--url", default=None, help="benchmark a running server instead")
    p.add_argument("--served-model-name", default=None,
                   help="model name sent with --url (default: the one GET /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer token sent with --url")
    p.add_argument("--modes", default="gpu-only,hisparse,always-host",
                   help="comma-separated modes (with --model)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--input-len", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token id range of the random prompts (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="unmeasured requests sent first (default: %(default)s; 0: none)")
    p.add_argument("--json", action="store_true", help="print one JSON line per mode")
    add_engine_args(p, with_mode=False)


def main(argv: list[str] | None = None) -> int:
    from hisparse.engine.arg_utils import ArgParser

    p = ArgParser(prog="hisparse bench-serve", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.url is None):
        raise ValueError("give exactly one of --model DIR or --url URL")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    from hisparse.engine.arg_utils import engine_kwargs

    if args.model is not None:
        engine_kwargs(args)         # flag errors before any work
    vocab = args.vocab_size
    if vocab is None:
        if args.model is None:
            raise ValueError("--vocab-size is needed with --url")
        from hisparse.models.loader import load_config

        vocab = load_config(args.model).vocab_size
    from hisparse.logging_utils import set_cpu_threads

    set_cpu_threads(args.device, args.threads)
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    modes = [None] if args.url else [m.strip() for m in args.modes.split(",") if m.strip()]
    results = {}
    for mode in modes:
        res = _bench_mode(args, mode, prompts, vocab)
        results[mode or "server"] = res
        if args.json:
            print(json.dumps({"mode": mode or "server", **res}))
    if not args.json:
        _print_table(results, args)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


def _print_table(results: dict, args) -> None:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"bench-serve: {args.num_prompts} requests, {args.input_len} prompt + "
          f"{args.output_len} output tokens, arrival rate {rate} req/s")
    keys = ["completed", "failed", "request_throughput", "output_throughput", "ttft_p50_ms",
            "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
            "e2e_p50_ms", "peak_running", "spilled_pages", "num_preempted", "hot_hit_rate"]
    print(f"{'metric':<20}" + "".join(f"{m:>14}" for m in results))
    for k in keys:
        if not any(k in r for r in results.values()):
            continue
        cells = []
        for r in results.values():
            v = r.get(k, math.nan)
            cells.append(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}")
        print(f"{k:<20}" + "".join(cells))
    for m, r in results.items():
        if "first_error" in r:
            print(f"{m}: first error: {r['first_error']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
