"""Command line: ``hisparse demo | generate | serve | router | bench | bench-serve | plan |
simulate``."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _simulate(args: argparse.Namespace) -> int:
    from hisparse.config import Mode
    from hisparse.engine.simulate import simulate_workload

    results = {str(mode): simulate_workload(mode, requests=args.requests, max_len=args.max_len,
                                            block_size=args.block_size,
                                            gpu_blocks=args.gpu_blocks, seed=args.seed,
                                            check=args.check)
               for mode in (Mode.GPU_ONLY, Mode.HISPARSE, Mode.ALWAYS_HOST)}
    keys = ["steps", "peak_running", "num_preempted", "spilled_pages", "lost_pages",
            "host_read_switches", "hot_hits", "hot_misses", "prefix_hit_tokens", "mirrored_rows"]
    print("Simulated workload through the KV core and the fake worker "
          f"({args.requests} requests, max_len {args.max_len}, {args.gpu_blocks} GPU blocks of "
          f"{args.block_size}; every row read back and checked):")
    print(f"{'counter':<20}" + "".join(f"{m:>14}" for m in results))
    for k in keys:
        print(f"{k:<20}" + "".join(f"{results[m][k]:>14}" for m in results))
    if args.json:
        print(json.dumps(results))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hisparse.demo import demo_checkpoint, run_demo

    if args.checkpoint_only:
        print(demo_checkpoint())
        return 0
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return 0 if run_demo(num_prompts=args.prompts, max_tokens=args.max_tokens,
                         device=args.device, kv_cache_dtype=args.kv_cache_dtype) else 1


def _mode(args: argparse.Namespace) -> str:
    if args.hisparse is not None:
        if args.mode is not None:
            raise ValueError("give --mode only (--hisparse is its deprecated alias)")
        print("warning: --hisparse is deprecated; use --mode {gpu-only,hisparse,always-host}",
              file=sys.stderr)
        return {"on": "hisparse", "off": "gpu-only", "always-host": "always-host"}[args.hisparse]
    return args.mode or "hisparse"


def _generate(args: argparse.Namespace) -> int:
    from hisparse import LLM, SamplingParams

    prompts: list = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        try:
            prompts.append({"prompt_token_ids": [int(t) for t in ids.split(",")]})
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {ids!r}") \
                from None
    if not prompts:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3 (repeatable)")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    from hisparse.engine.arg_utils import engine_kwargs

    llm = LLM(args.model, **{**engine_kwargs(args), "mode": _mode(args)})
    try:
        outs = llm.generate(prompts, params, use_tqdm=True)
        stats = llm.stats()
    finally:
        llm.shutdown()
    for out in outs:
        c = out.outputs[0]
        print(json.dumps({"request_id": out.request_id, "prompt": out.prompt,
                          "token_ids": c.token_ids, "text": c.text,
                          "finish_reason": c.finish_reason, "error": c.error}))
    print(json.dumps(stats))
    return 0


def _plan_config(args: argparse.Namespace):
    """The DSAConfig ``hisparse plan`` plans for: --model's config.json or a --model-shape."""
    from hisparse.models.config import DSAConfig

    if (args.model is None) == (args.model_shape is None):
        raise ValueError("give exactly one of --model DIR and --model-shape NAME")
    if args.model_shape is not None:
        from hisparse.models.shapes import model_shape_config

        return DSAConfig.from_hf(model_shape_config(args.model_shape))
    path = args.model
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"--model must be a checkpoint directory with config.json or a "
                         f"config.json path, got {path!r}")
    with open(file) as f:
        try:
            return DSAConfig.from_hf(json.load(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"--model: {file} is not valid JSON ({e.msg})") from None


def _plan(args: argparse.Namespace) -> int:
    import math

    from hisparse.engine.capacity import (
        CapacityInputs,
        format_plan,
        geometry_from_config,
        plan_capacity,
    )

    for flag in ("gpu_kv_gib", "host_pool_gib", "weight_bytes"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number >= 0, got {v}")
    for flag in ("context", "block_size", "max_num_seqs", "hot_buffer_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= args.hit_rate <= 1:
        raise ValueError(f"--hit-rate must be in [0, 1], got {args.hit_rate}")
    for flag in ("hbm_gb_s", "pcie_gb_s"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    cfg = _plan_config(args)
    if args.context > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    plan = plan_capacity(geometry_from_config(cfg), CapacityInputs(
        context=args.context, gpu_kv_bytes=int(args.gpu_kv_gib * (1 << 30)),
        host_pool_bytes=int(args.host_pool_gib * (1 << 30)), block_size=args.block_size,
        hot_buffer_size=args.hot_buffer_size, max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype, hit_rate=args.hit_rate, hbm_gb_s=args.hbm_gb_s,
        pcie_gb_s=args.pcie_gb_s,
        weight_bytes=None if args.weight_bytes is None else int(args.weight_bytes * 1e9)))
    print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import time

    from hisparse.engine.arg_utils import engine_kwargs
    from hisparse.logging_utils import set_cpu_threads

    try:
        import uvicorn

        from hisparse.server.app import create_app
    except ModuleNotFoundError as e:
        raise ValueError(f"hisparse serve needs {e.name}: pip install 'hisparse[serve]'") \
            from None
    from hisparse import LLM
    from hisparse.engine.async_engine import AsyncLLM

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    kwargs = engine_kwargs(args)
    set_cpu_threads(args.device, args.threads)
    llm = LLM(args.model, **kwargs)
    try:
        # Captured before the first request, as vLLM does: a graph captured on first use
        # stalls every running request for its compile and capture (26 s at the first
        # host-read switch of the stand-in on the H200).
        t0 = time.perf_counter()
        llm.capture_cuda_graphs()
        logging.getLogger("hisparse.server").info("decode CUDA graphs ready in %.1f s",
                                                  time.perf_counter() - t0)
    except BaseException:
        llm.shutdown()
        raise
    engine = AsyncLLM(llm, max_waiting_requests=args.max_waiting_requests,
                      log_interval=args.log_interval)
    try:
        app = create_app(engine, model_name=args.served_model_name, api_key=args.api_key,
                         allowed_origins=origins or None,
                         max_request_bytes=args.max_request_bytes)
        logging.getLogger("hisparse.server").info(
            "serving %s on http://%s:%d (OpenAI API under /v1, metrics at /metrics)",
            args.served_model_name or args.model, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port,
                    log_level="debug" if args.debug else "warning")
    finally:
        if engine.shutdown():
            llm.shutdown()      # never under a step the engine thread still runs
    return 0


def _add_serve_parser(sub) -> None:
    import os

    from hisparse.engine.arg_utils import add_disagg_args, add_engine_args
    from hisparse.server.http import DEFAULT_MAX_REQUEST_BYTES

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                         description="Serve MODEL over an OpenAI-compatible HTTP API: "
                         "/v1/completions, /v1/chat/completions, /v1/models[/ID], /tokenize, "
                         "/detokenize, /version, /health, /metrics.")
    srv.add_argument("model", help="checkpoint directory (config.json + safetensors)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    srv.add_argument("--served-model-name", default=None,
                     help="model name in the API (default: the directory's name)")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="requests queued beyond --max-num-seqs before answering 503 "
                     "(default: %(default)s)")
    srv.add_argument("--log-interval", type=float, default=10.0,
                     help="seconds between throughput / tier log lines while busy, 0: off "
                     "(default: %(default)s)")
    srv.add_argument("--api-key", default=os.environ.get("HISPARSE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (/health, /metrics, "
                     "/tokenize stay open) (default: $HISPARSE_API_KEY, else none)")
    srv.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                     help="CORS: comma-separated origins allowed to call the API from a "
                     "browser, '*' for any (default: none, no CORS headers)")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help="larger request bodies get 413 (default: %(default)s)")
    add_engine_args(srv)
    add_disagg_args(srv)
    srv.set_defaults(func=_serve)


def _router(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from hisparse.server.router import create_router
    except ModuleNotFoundError as e:
        raise ValueError(f"hisparse router needs {e.name}: pip install 'hisparse[serve]'") \
            from None
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    app = create_router(args.prefill or [], args.decode or [], args.policy)
    uvicorn.run(app, host=args.host, port=args.port,
                log_level="debug" if args.debug else "warning")
    return 0


def _add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="prefill/decode disaggregation router (OpenAI API)",
                       description="Send each completion to a prefill instance (kv-role "
                       "prefill) for its prompt, then to a decode instance (kv-role decode) "
                       "with the returned kv_transfer_params; stream the decode's answer.")
    r.add_argument("--prefill", action="append", metavar="URL",
                   help="a prefill instance (repeat for more)")
    r.add_argument("--decode", action="append", metavar="URL",
                   help="a decode instance (repeat for more)")
    r.add_argument("--policy", default="least-loaded", choices=["least-loaded", "round-robin"],
                   help="instance choice (default: %(default)s)")
    r.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    r.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    r.set_defaults(func=_router)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hisparse")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _user_errors() -> tuple[type[BaseException], ...]:
    from hisparse.engine.llm import EngineStartupError

    return (ValueError, EngineStartupError, FileNotFoundError)


def _bench_policy(args) -> int:
    from hisparse.bench.policy import run_args

    return run_args(args)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    argv = list(argv)
    debug = "--debug" in argv    # anywhere on the line: tracebacks and debug logs
    if debug:
        argv.remove("--debug")
    from hisparse.logging_utils import setup_logging

    setup_logging(debug)
    try:
        return _main(argv, debug)
    except _user_errors() as e:
        if debug:
            raise
        # A user error: one line, exit status 2 (like argparse), no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str], debug: bool) -> int:
    if argv[:1] == ["bench"]:  # its own argument parser: hisparse bench --help
        from hisparse.bench.decode import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["bench-serve"]:
        from hisparse.bench.serve import main as bench_serve_main

        return bench_serve_main(argv[1:])
    from hisparse.engine.arg_utils import ArgParser, add_engine_args

    parser = ArgParser(prog="hisparse", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hisparse {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and debug logs (anywhere on the line)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="random-weight DSA model, tiny GPU pool, lossless check")
    demo.add_argument("--prompts", type=int, default=16)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--device", default=None)
    demo.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    demo.add_argument("--checkpoint-only", action="store_true",
                      help="build the demo checkpoint (random weights, DeepSeek's tokenizer, a "
                      "chat template) if needed and print its path, e.g. for hisparse serve")
    demo.set_defaults(func=_demo)

    gen = sub.add_parser("generate", help="generate from a checkpoint directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", help="text prompt (needs a tokenizer)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen, with_mode=False)
    gen.add_argument("--mode", default=None, choices=["gpu-only", "hisparse", "always-host"],
                     help="where KV may live (default: hisparse)")
    gen.add_argument("--hisparse", default=None, choices=["on", "off", "always-host"],
                     help=argparse.SUPPRESS)  # deprecated alias of --mode
    gen.set_defaults(func=_generate)
    sub.add_parser("bench", help="capacity-bound decode benchmark, three designs (CUDA)",
                   add_help=False)
    _add_serve_parser(sub)
    _add_router_parser(sub)
    sub.add_parser("bench-serve", help="serving benchmark over HTTP: Poisson arrivals, TTFT / "
                   "TPOT percentiles per mode", add_help=False)
    sim = sub.add_parser("simulate", help="drive the KV core with a fake worker (no model)")
    sim.add_argument("--requests", type=int, default=32)
    sim.add_argument("--max-len", type=int, default=512)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--gpu-blocks", type=int, default=96)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--check", action="store_true", help="check invariants after every step")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=_simulate)
    pl = sub.add_parser("plan", help="max running requests per mode (reads config.json)")
    pl.add_argument("--model", default=None, help="checkpoint directory or config.json")
    from hisparse.models.shapes import MODEL_SHAPES

    pl.add_argument("--model-shape", choices=MODEL_SHAPES, default=None,
                    help="plan for a built-in shape instead of --model (as hisparse bench)")
    pl.add_argument("--gpu-kv-gib", type=float, required=True, help="GPU arena + indexer cache")
    pl.add_argument("--host-pool-gib", type=float, required=True)
    pl.add_argument("--context", type=int, required=True, help="tokens per request")
    pl.add_argument("--hot-buffer-size", type=int, default=None)
    pl.add_argument("--block-size", type=int, default=64)
    pl.add_argument("--max-num-seqs", type=int, default=256)
    pl.add_argument("--kv-cache-dtype", default="fp8", choices=["bf16", "fp8", "fp16", "fp32"],
                    help="KV format planned for (default: %(default)s, what the engine's 'auto' "
                         "runs on CUDA for DSA models)")
    pl.add_argument("--hit-rate", type=float, default=0.9)
    pl.add_argument("--hbm-gb-s", type=float, default=4800.0)
    pl.add_argument("--pcie-gb-s", type=float, default=55.0)
    pl.add_argument("--weight-bytes", type=float, default=None, help="GB read per step")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan)
    bp = sub.add_parser("bench-policy", help="replay top-k traces through hot-buffer policies")
    from hisparse.bench.policy import build_parser as _policy_parser
    _policy_parser(bp)
    bp.set_defaults(func=_bench_policy)
    args = parser.parse_args(argv)
    args.debug = debug
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
