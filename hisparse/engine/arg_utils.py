"""Command-line flags of the engine (``LLM``'s arguments), shared by ``hisparse serve``,
``hisparse bench-serve`` and anything else that builds an engine from flags."""

from __future__ import annotations

import argparse

MODES = ("gpu-only", "hisparse", "always-host")


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: PROG: MESSAGE (see PROG --help)`` and exit
    status 2, without the usage block (subparsers inherit the class)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def host_pool_gib_arg(value: str) -> float | str:
    """``--host-pool-gib``: a number of GiB or ``auto``."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of GiB or 'auto', got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser, with_mode: bool = True) -> None:
    """Every ``LLM`` knob as a flag, with help text and its default."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and KV dtype (default: the checkpoint's)")
    if with_mode:
        g.add_argument("--mode", default="hisparse", choices=MODES,
                       help="where KV may live: hisparse (GPU first, spill to host under "
                       "pressure), gpu-only (baseline), always-host (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=64,
                   help="tokens per KV page, a power of two (default: %(default)s)")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="GPU KV pages (default: from free GPU memory x "
                   "--gpu-memory-utilization on CUDA; max_num_seqs full requests on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free GPU memory the KV cache may take (default: "
                   "%(default)s)")
    g.add_argument("--host-pool-gib", type=host_pool_gib_arg, default=4.0,
                   help="pinned host pool, GiB, or 'auto' (the largest pool that pins, less a "
                   "headroom; probed at start-up) (default: %(default)s)")
    g.add_argument("--hot-buffer-size", type=int, default=None,
                   help="hot-buffer rows per layer and request, >= index_topk "
                   "(default: 2 x index_topk)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest request in tokens (default: min(model max, 16384))")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step (prefill chunk budget) (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                   help="auto: fp8 on CUDA for DSA geometries (bf16 models), else bf16; "
                   "bf16: exact rows (1152 B) and keys (256 B); fp8: FlashMLA's 656-B rows and "
                   "132-B keys, 1.75x the tokens per byte (default: %(default)s)")
    g.add_argument("--hot-policy", default="score", choices=["lru", "score", "score+prefetch"],
                   help="hot-buffer replacement (default: %(default)s)")
    g.add_argument("--hot-prefetch-rows", type=int, default=None,
                   help="score+prefetch: band rows prefetched per layer and request step at "
                   "most, off the critical path (default: max(1, index_topk / 64))")
    g.add_argument("--num-indexer-blocks", type=int, default=None,
                   help="indexer-cache pages (default: max_num_seqs full requests)")
    g.add_argument("--watermark-blocks", type=int, default=None,
                   help="free GPU pages under which requests switch to host-read mode "
                   "(default: max(hot blocks per request, num_gpu_blocks / 10))")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching (default: enabled)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (default: capture decode steps)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="do not overlap scheduling with the GPU step (default: overlapped)")
    g.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="leave Python's cyclic GC alone (default: freeze admitted requests' "
                   "token lists so full collections do not walk them)")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="MTP speculative decoding: draft tokens verified per step (needs "
                   "num_nextn_predict_layers >= 1; 0 = off) (default: %(default)s)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights, config only (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of tensor parallelism; >1 starts worker processes that share "
                   "one host pool (default: %(default)s)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: half the cores, at most 4)")


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation flags (``hisparse serve``)."""
    d = p.add_argument_group("prefill/decode disaggregation (NIXL: pip install --no-deps "
                             "nixl-cu13==1.5.1)")
    d.add_argument("--kv-role", default=None, choices=["prefill", "decode"],
                   help="prefill: hold finished prompts' KV for a decode instance to pull; "
                   "decode: pull the KV of requests carrying kv_transfer_params (default: "
                   "neither, a colocated server)")
    d.add_argument("--kv-host", default="127.0.0.1",
                   help="address of this instance's KV handshake server, as peers reach it "
                   "(default: %(default)s)")
    d.add_argument("--kv-port", type=int, default=None,
                   help="port of the KV handshake server (default: a free port)")
    d.add_argument("--kv-load-failure", default="recompute", choices=["recompute", "fail"],
                   help="decode: a failed or timed-out load recomputes the prompt here, or "
                   "fails the request (default: %(default)s)")
    d.add_argument("--kv-load-timeout-s", type=float, default=30.0,
                   help="decode: seconds a load may take (default: %(default)s)")
    d.add_argument("--kv-hold-timeout-s", type=float, default=120.0,
                   help="prefill: seconds a finished prompt's KV is held for its decode "
                   "(default: %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM`` keyword arguments from :func:`add_engine_args` flags (``--threads`` is checked
    here: it is applied by the caller, before the engine is built)."""
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    kw = dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
              num_gpu_blocks=args.num_gpu_blocks,
              gpu_memory_utilization=args.gpu_memory_utilization,
              host_pool_gib=args.host_pool_gib, hot_buffer_size=args.hot_buffer_size,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_indexer_blocks=args.num_indexer_blocks,
              watermark_blocks=args.watermark_blocks,
              enable_prefix_caching=args.enable_prefix_caching,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
              hot_policy=args.hot_policy,
              hot_prefetch_rows=getattr(args, "hot_prefetch_rows", None),
              tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
              num_speculative_tokens=getattr(args, "num_speculative_tokens", 0),
              gc_freeze=getattr(args, "gc_freeze", True),
              kv_role=getattr(args, "kv_role", None),
              kv_host=getattr(args, "kv_host", "127.0.0.1"),
              kv_port=getattr(args, "kv_port", None),
              kv_load_failure=getattr(args, "kv_load_failure", "recompute"),
              kv_load_timeout_s=getattr(args, "kv_load_timeout_s", 30.0),
              kv_hold_timeout_s=getattr(args, "kv_hold_timeout_s", 120.0))
    if getattr(args, "mode", None) is not None:
        kw["mode"] = args.mode
    return kw
