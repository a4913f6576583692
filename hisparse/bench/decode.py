"""Capacity-bound long-context decode: GPU-only vs HiSparse vs always-host in one run.

Model: DeepSeek-V3.2 geometry as one tensor-parallel rank of eight sees it (16 query heads,
kv_lora_rank 512, rope 64, indexer 64 x 128, index_topk 2048, block 64), random weights (dummy
load), bf16, dense MLP layers. Prompts get random KV rows instead of a prefill forward (decode
speed is what is measured; see :mod:`hisparse.bench.synthetic`, plugged in through
``LLM(runner_cls=...)``); decode runs the full model. Only the public engine API is used.

``--model-shape`` picks the model: ``tp8-stand-in`` (the default above: ``--layers`` dense layers)
or a real rank, ``deepseek-v3.2-tp8-rank`` (all 61 layers of one TP-8 rank of DeepSeek-V3.2: 3
dense then 58 MoE layers of 256 experts, top 8, expert intermediate 2048 / 8 = 256, 16 heads,
indexer replicated (64 heads), FP8 block-quantized weights drawn directly in FP8 on the GPU,
~89 GB) or ``glm-5-tp8-rank`` (78 layers, 64 / 8 heads, GLM-5's shared-indexer pattern from the
config defaults; ~82 GB). See :mod:`hisparse.models.random_checkpoint` for the TP-shard rules
(vocab kept whole; the all-reduce is not exercised). The KV cache stays bf16 until the FP8-KV
option lands. ``--gpu-kv-gib auto`` (the default for real ranks): the engine sizes the KV arena
from the free GPU memory after weights (``gpu_memory_utilization``).

Per point, beyond throughput: ``step_span_ms_p50`` (CUDA events on the compute stream around each
``LLM.step``: GPU time plus whatever host gaps fall inside a step; under CUDA graphs mostly the
replay), and the capacity planner's predicted step time / tok/s for that mode and concurrency
(weights read per step = dense weights + the expected bytes of the experts a batch touches).

Top-k sources: ``indexer`` (the model's own indexer: random weights, unrealistic locality),
``synthetic:<overlap>`` and ``trace:<npz>`` (selections replayed in place of the indexer output;
the indexer still runs so its cost is counted).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from hisparse.config import Mode, cdiv

TP8_GEOMETRY = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432 // 8, q_lora_rank=1536,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    num_attention_heads=16, num_key_value_heads=16, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840, first_k_dense_replace=1000,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
)


MODEL_SHAPES = ("tp8-stand-in", "deepseek-v3.2-tp8-rank", "glm-5-tp8-rank")


def model_shape_config(shape: str, layers: int | None = None) -> dict:
    """The config.json dict of ``shape`` (see the module doc); ``layers`` overrides the depth."""
    from hisparse.models.random_checkpoint import (
        DEEPSEEK_V32_SHAPE,
        GLM5_SHAPE,
        fp8_quantization_config,
        make_hf_config,
    )

    if shape == "tp8-stand-in":
        cfg = make_hf_config("deepseek_v32", num_hidden_layers=layers or 8,
                             **TP8_GEOMETRY).to_dict()
        cfg["architectures"] = ["DeepseekV32ForCausalLM"]
        return cfg
    if shape == "deepseek-v3.2-tp8-rank":
        arch, full, name = "deepseek_v32", DEEPSEEK_V32_SHAPE, "DeepseekV32ForCausalLM"
    elif shape == "glm-5-tp8-rank":
        arch, full, name = "glm_moe_dsa", GLM5_SHAPE, "GlmMoeDsaForCausalLM"
    else:
        raise ValueError(f"--model-shape must be one of {list(MODEL_SHAPES)}, got {shape!r}")
    over = dict(full)
    if layers:
        over["num_hidden_layers"] = layers
    cfg = make_hf_config(arch, tp_rank_of=8, **over).to_dict()
    cfg["architectures"] = [name]
    cfg["quantization_config"] = fp8_quantization_config((128, 128))
    return cfg


def touched_weight_bytes(cfg, batch: int) -> int:
    """Expected weight bytes one decode step of ``batch`` tokens reads: every non-routed weight
    plus, per MoE layer, the experts hit (uniform routing: ``E * (1 - (1 - k/E) ** batch)``)."""
    from hisparse.engine.capacity import geometry_from_config

    total = geometry_from_config(cfg).weight_bytes
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    if not n_moe:
        return int(total)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * (
        1 if cfg.fp8_block else cfg.dtype.itemsize)
    hit = E * (1.0 - (1.0 - k / E) ** max(batch, 1))
    return int(total - n_moe * (E - hit) * per_expert)


@dataclass
class Point:
    mode: str
    topk_source: str
    context: int
    concurrency: int
    outputs: int
    decode_tok_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    running_reached: int
    hot_hit_rate: float
    h2d_gb_s: float
    gpu_mem_gib: float
    host_pool_gib: float
    num_preempted: int
    spilled_pages: int
    wall_s: float
    model_shape: str = "tp8-stand-in"
    weights_gib: float = 0.0
    num_gpu_blocks: int = 0
    step_span_ms_p50: float = float("nan")
    plan_step_ms: float = float("nan")
    plan_tok_s: float = float("nan")


def write_config(layers: int | None, shape: str = "tp8-stand-in") -> str:
    cfg = model_shape_config(shape, layers)
    path = tempfile.mkdtemp(prefix="hisparse-bench-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def topk_table(source: str, layers: int, context: int, outputs: int, k: int,
               streams: int = 4) -> torch.Tensor | None:
    """``[streams, layers, outputs, k]`` int32 positions selected at each decode step."""
    if source == "indexer":
        return None
    from hisparse.bench import locality

    kind, _, arg = source.partition(":")
    if kind == "synthetic":
        src = locality.SyntheticTopk(overlap=float(arg), num_layers=layers, seed=0)
    elif kind == "trace":
        src = locality.TraceTopk(arg)
    else:
        raise ValueError(f"topk source must be indexer, synthetic:<overlap> or trace:<npz>, "
                         f"got {source!r}")
    import numpy as np

    table = np.stack([np.stack([np.stack([src.select(l, d, s, context + s + 1, k)
                                          for s in range(outputs)]) for l in range(layers)])
                      for d in range(streams)])
    return torch.from_numpy(table.astype(np.int32))


def make_topk_override(table: torch.Tensor, context: int):
    streams, layers, steps, _ = table.shape

    def override(layer: int, token_slot: torch.Tensor, positions: torch.Tensor,
                 computed: torch.Tensor) -> torch.Tensor:
        step = (positions - context).clamp(0, steps - 1)
        selected = table[token_slot.long() % streams, layer % layers, step]
        return torch.where(token_slot[:, None] >= 0, selected, -1)  # padding selects nothing

    return override


def run_point(path: str, mode, topk_source: str, table, context: int, concurrency: int,
              outputs: int, gpu_kv_gib: float | None, host_buffers, host_pool_gib: float,
              max_seqs: int, block_size: int = 64, enforce_eager: bool = False,
              model_shape: str = "tp8-stand-in") -> Point:
    from hisparse import LLM, SamplingParams
    from hisparse.bench.synthetic import TokenClock, synthetic_runner

    row_bytes_per_block = block_size * 576 * 2
    layers = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    num_gpu_blocks = (None if gpu_kv_gib is None
                      else int(gpu_kv_gib * (1 << 30)) // (row_bytes_per_block * layers))
    max_len = context + outputs
    torch.cuda.reset_peak_memory_stats()
    clock = TokenClock()
    override = None if table is None else make_topk_override(table.to("cuda"), context)
    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", block_size=block_size,
              num_gpu_blocks=num_gpu_blocks, host_pool_gib=host_pool_gib, mode=mode,
              max_model_len=max_len, max_num_seqs=max_seqs,
              num_indexer_blocks=max_seqs * cdiv(max_len, block_size),
              # Prompts are synthetic (random rows): a large budget admits them quickly.
              max_num_batched_tokens=max(16384, min(262144, 4 * context)),
              host_buffers=host_buffers if mode != "gpu-only" else None,
              enforce_eager=enforce_eager,
              runner_cls=synthetic_runner(clock=clock, topk_override=override))
    llm.capture_cuda_graphs()
    g = torch.Generator().manual_seed(0)
    req_ids = []
    for _ in range(concurrency):
        ids = torch.randint(2, 120000, (context,), generator=g).tolist()
        req_ids.append(llm.add_request(
            {"prompt_token_ids": ids},
            SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)))
    done_at: dict[str, float] = {}
    n_out: dict[str, int] = {}
    weights_gib = sum(p.numel() * p.element_size() for p in llm.model.parameters()) / (1 << 30)
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
        finished = llm.step()
        ev[1].record()
        spans.append(ev)
        now = time.perf_counter()
        for out in finished:
            done_at[out.request_id] = now
            n_out[out.request_id] = len(out.outputs[0].token_ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    first_token = {r: clock.times[r][0] for r in req_ids}
    start = min(first_token.values())
    decode_tokens = sum(n_out[r] - 1 for r in req_ids)
    tpots = sorted((done_at[r] - first_token[r]) / max(1, outputs - 1) * 1e3 for r in req_ids)
    s = llm.stats()
    # decode steps only: the last outputs-1 steps of the run (prompts are admitted first)
    span_ms = sorted(a.elapsed_time(b) for a, b in spans[-max(1, outputs - 1):])
    plan_ms = plan_tok = float("nan")
    try:
        mc = llm.model_config
        mp = llm.capacity(context + outputs,
                          weight_bytes=touched_weight_bytes(mc, concurrency))[str(s["mode"])]
        plan_ms, plan_tok = mp.step_time_ms, mp.decode_tok_s
    except Exception as e:  # the planner is advisory here
        print(f"planner: {e}", flush=True)
    lookups = s["hot_hits"] + s["hot_misses"]
    point = Point(
        mode=s["mode"], topk_source=topk_source, context=context, concurrency=concurrency,
        outputs=outputs, decode_tok_s=decode_tokens / (time.perf_counter() - start),
        tpot_p50_ms=statistics.median(tpots), tpot_p99_ms=tpots[int(0.99 * (len(tpots) - 1))],
        running_reached=s["peak_running"],
        hot_hit_rate=s["hot_hits"] / lookups if lookups else float("nan"),
        h2d_gb_s=s["h2d_bytes"] / wall / 1e9,
        gpu_mem_gib=torch.cuda.max_memory_allocated() / (1 << 30),
        host_pool_gib=host_pool_gib if mode != "gpu-only" else 0.0,
        num_preempted=s["num_preempted"], spilled_pages=s["spilled_pages"], wall_s=wall,
        model_shape=model_shape, weights_gib=weights_gib, num_gpu_blocks=s["num_gpu_blocks"],
        step_span_ms_p50=span_ms[len(span_ms) // 2] if span_ms else float("nan"),
        plan_step_ms=plan_ms, plan_tok_s=plan_tok)
    del llm
    gc.collect()  # captured graphs and the runner refer to each other
    torch.cuda.empty_cache()
    return point


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="hisparse bench", description=__doc__)
    p.add_argument("--model-shape", default="tp8-stand-in", choices=MODEL_SHAPES,
                   help="tp8-stand-in (dense, --layers) or a real TP-8 rank (FP8 weights)")
    p.add_argument("--layers", type=int, default=None,
                   help="depth (default: 8 for the stand-in, the real depth for real ranks)")
    p.add_argument("--contexts", default="65536")
    p.add_argument("--concurrency", default="8,32,64,max")
    p.add_argument("--outputs", type=int, default=64)
    p.add_argument("--gpu-kv-gib", default=None,
                   help="GPU KV arena GiB, or 'auto' (free memory after weights); default 16 "
                        "for the stand-in, auto for real ranks")
    p.add_argument("--host-pool-gib", type=float, default=64.0)
    p.add_argument("--modes", default="gpu-only,hisparse,always-host")
    p.add_argument("--topk", default="indexer",
                   help="top-k source of the sweep: indexer, synthetic:<p> or trace:<npz>")
    p.add_argument("--locality", default="",
                   help="extra HiSparse points: comma list of synthetic:<p> / trace:<npz>")
    p.add_argument("--locality-concurrency", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hisparse bench needs a CUDA device")
    modes = {m.value: m.value for m in Mode}
    path = write_config(a.layers, a.model_shape)
    layers = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    stand_in = a.model_shape == "tp8-stand-in"
    kv_arg = a.gpu_kv_gib or ("16" if stand_in else "auto")
    gpu_kv = None if kv_arg == "auto" else float(kv_arg)
    geo_bytes_per_token = layers * (576 + 128) * 2
    t = time.perf_counter()
    host_rows = int(a.host_pool_gib * (1 << 30)) // (geo_bytes_per_token * 64) * 64
    host_buffers = (torch.empty(layers, host_rows, 576, dtype=torch.bfloat16, pin_memory=True),
                    torch.empty(layers, host_rows, 128, dtype=torch.bfloat16, pin_memory=True))
    print(f"pinned {a.host_pool_gib} GiB host pool in {time.perf_counter() - t:.1f} s", flush=True)
    points: list[Point] = []
    os.makedirs(a.out, exist_ok=True)
    t = time.perf_counter()
    for name in a.modes.split(","):  # compile every kernel before timing anything
        # host pool for 4 x 4k tokens at this depth (1 GiB per 8 layers)
        run_point(path, modes[name], "indexer", None, 4096, 4, 8, gpu_kv, None,
                  float(max(1, layers // 8)), 4, enforce_eager=a.eager, model_shape=a.model_shape)
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)

    def record(pt: Point) -> None:
        points.append(pt)
        print(json.dumps(asdict(pt)), flush=True)
        with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
            json.dump([asdict(x) for x in points], f, indent=1)

    contexts = [int(c) for c in a.contexts.split(",")]
    for context in contexts:
        host_cap = host_rows // (context + a.outputs + 64)
        levels = sorted({host_cap if c == "max" else min(int(c), host_cap)
                         for c in a.concurrency.split(",")})
        table = topk_table(a.topk, layers, context, a.outputs, 2048)
        for conc in levels:
            for name in a.modes.split(","):
                record(run_point(path, modes[name], a.topk, table, context, conc, a.outputs,
                                 gpu_kv, host_buffers, a.host_pool_gib, max(levels),
                                 enforce_eager=a.eager, model_shape=a.model_shape))
        sources = filter(None, a.locality.split(",")) if context == contexts[0] else ()
        for source in sources:
            table = topk_table(source, layers, context, a.outputs, 2048)
            conc = min(a.locality_concurrency, host_cap)
            for name in ("hisparse", "always-host"):
                record(run_point(path, modes[name], source, table, context, conc, a.outputs,
                                 gpu_kv, host_buffers, a.host_pool_gib, conc,
                                 enforce_eager=a.eager, model_shape=a.model_shape))
    print_table(points)
    plot(points, os.path.join(a.out, "bench_decode.png"))
    return 0


def print_table(points: list[Point]) -> None:
    cols = ["mode", "topk_source", "context", "concurrency", "decode_tok_s", "tpot_p50_ms",
            "tpot_p99_ms", "running_reached", "hot_hit_rate", "h2d_gb_s", "gpu_mem_gib",
            "num_preempted", "step_span_ms_p50", "plan_step_ms", "plan_tok_s"]
    print(" | ".join(cols))
    for pt in points:
        d = asdict(pt)
        print(" | ".join(f"{d[c]:.3g}" if isinstance(d[c], float) else str(d[c]) for c in cols))


def plot(points: list[Point], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("gpu-only", "hisparse", "always-host"):
        for context in sorted({p.context for p in points}):
            for source in sorted({p.topk_source for p in points}):
                pts = [p for p in points if p.mode == mode and p.context == context
                       and p.topk_source == source]
                if len(pts) > 1:
                    ax.plot([p.concurrency for p in pts], [p.decode_tok_s for p in pts],
                            marker="o", label=f"{mode} {context // 1024}k {source[:12]}")
    ax.set_xlabel("concurrent requests submitted")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
