"""Capacity planner: hand-computed bounds, roofline arithmetic, the CLI, and agreement with the
engine's real admission on a tiny random checkpoint (CPU)."""

from __future__ import annotations

import json
import random

import pytest

from hisparse.config import KVCacheConfig, host_blocks_for_gib
from hisparse.engine.capacity import (
    GPU_PAGES,
    HOST_POOL,
    HOT_BUFFERS,
    INDEXER_CACHE,
    MAX_NUM_SEQS,
    CapacityInputs,
    ModelGeometry,
    count_weight_params,
    format_plan,
    geometry_from_config,
    load_geometry,
    plan_capacity,
)

MODES = ("gpu-only", "hisparse", "always-host")

# 2 layers (1 with an indexer), rows of 32 values (64 B bf16), keys of 8 (16 B bf16), top-k 16.
# Blocks of 8 tokens: arena block 8*2*64 = 1024 B, indexer block 8*1*16 = 128 B,
# host block 8*(2*64 + 16) = 1152 B. Context 96: 12 pages. Hot buffer 32 rows: 4 blocks, so a
# host-read request holds 4 + 2 tail = 6 arena blocks.
GEO = ModelGeometry(num_layers=2, num_indexer_layers=1, kv_lora_rank=28, qk_rope_head_dim=4,
                    index_head_dim=8, index_topk=16, weight_bytes=1000)
BASE = dict(context=96, block_size=8, hot_buffer_size=32, max_num_seqs=100)


def plan(**kw):
    return plan_capacity(GEO, CapacityInputs(**{**BASE, **kw}))


def test_bytes_per_token_bf16_and_fp8_production_rows():
    prod = ModelGeometry(num_layers=61, num_indexer_layers=61, kv_lora_rank=512,
                         qk_rope_head_dim=64, index_head_dim=128, index_topk=2048)
    assert (prod.row_bytes("bf16"), prod.key_bytes("bf16")) == (1152, 256)
    assert (prod.row_bytes("fp8"), prod.key_bytes("fp8")) == (656, 132)
    assert prod.row_bytes("float32") == 2304
    # DESIGN §7: ~48 KB per token at 61 layers, FP8 rows and keys.
    p = plan_capacity(prod, CapacityInputs(context=32768, gpu_kv_bytes=33 << 30,
                                           host_pool_bytes=64 << 30, kv_cache_dtype="fp8"))
    assert p["hisparse"].bytes_per_token == {"gpu_arena": 61 * 656, "gpu_indexer": 61 * 132,
                                             "host": 61 * (656 + 132)}
    assert p["gpu-only"].bytes_per_token["host"] == 0
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        prod.row_bytes("int4")


def test_gpu_pages_bound_gpu_only():
    p = plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000)
    m = p["gpu-only"]
    assert (m.max_running, m.bound_by) == (5, GPU_PAGES)   # 60 // 12
    assert m.bounds == {GPU_PAGES: 5, INDEXER_CACHE: 83, MAX_NUM_SEQS: 100}


def test_hot_buffers_bound_and_watermark():
    p = plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000)
    assert (p["always-host"].max_running, p["always-host"].bound_by) == (10, HOT_BUFFERS)
    # hisparse keeps the watermark max(4 hot blocks, 60 // 10) = 6 free: (60 - 6) // 6.
    assert (p["hisparse"].max_running, p["hisparse"].bound_by) == (9, HOT_BUFFERS)
    assert p["hisparse"].watermark_blocks == 6 and p["always-host"].watermark_blocks == 0
    assert p["hisparse"].arena_blocks_per_request == 6
    # An explicit watermark replaces the default rule.
    assert plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000,
                watermark_blocks=12)["hisparse"].max_running == 8


def test_short_requests_never_switch_in_hisparse():
    # context 48: 6 pages <= hot 4 + tail 2, so hisparse keeps them resident (no watermark).
    p = plan(context=48, num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000)
    assert (p["hisparse"].max_running, p["hisparse"].bound_by) == (10, GPU_PAGES)
    assert p["hisparse"].h2d_bytes_per_step == 0
    assert p["always-host"].bound_by == HOT_BUFFERS


def test_indexer_cache_bound():
    p = plan(num_gpu_blocks=600, num_indexer_blocks=36, num_host_blocks=1000)
    for mode in MODES:
        assert (p[mode].max_running, p[mode].bound_by) == (3, INDEXER_CACHE), mode


def test_host_pool_bound():
    p = plan(num_gpu_blocks=600, num_indexer_blocks=1000, num_host_blocks=59)
    assert (p["gpu-only"].max_running, p["gpu-only"].bound_by) == (50, GPU_PAGES)
    assert (p["always-host"].max_running, p["always-host"].bound_by) == (4, HOST_POOL)
    assert p["always-host"].gpu_held == 0
    # hisparse: 4 host-backed requests (6 arena blocks each), then GPU-held ones of 12 pages
    # in what the arena has left above the watermark max(4, 60): (600 - 60 - 24) // 12 = 43.
    h = p["hisparse"]
    assert (h.max_running, h.gpu_held, h.bound_by) == (47, 43, GPU_PAGES)
    assert h.bounds[HOST_POOL] == 4 and h.bounds[GPU_PAGES] == 47
    # ... or what the indexer cache / max_num_seqs leave
    q = plan(num_gpu_blocks=600, num_indexer_blocks=12 * 10, num_host_blocks=59)["hisparse"]
    assert (q.max_running, q.gpu_held, q.bound_by) == (10, 6, INDEXER_CACHE)
    q = plan(num_gpu_blocks=600, num_indexer_blocks=1000, num_host_blocks=59, max_num_seqs=9)
    assert (q["hisparse"].max_running, q["hisparse"].bound_by) == (9, MAX_NUM_SEQS)
    # GPU-held requests read every row resident: no PCIe bytes of theirs
    assert h.h2d_bytes_per_step == pytest.approx(p["always-host"].h2d_bytes_per_step)
    # From bytes: 59 host blocks of 1152 B.
    q = plan(num_gpu_blocks=600, num_indexer_blocks=1000, host_pool_bytes=59 * 1152 + 1151)
    assert q["always-host"].num_host_blocks == 59 and q["always-host"].max_running == 4
    # No host pool at all: the host modes run nothing.
    assert plan(num_gpu_blocks=600, num_indexer_blocks=1000)["always-host"].max_running == 0


def test_max_num_seqs_bound():
    p = plan(num_gpu_blocks=600, num_indexer_blocks=1000, num_host_blocks=1000, max_num_seqs=2)
    for mode in MODES:
        assert (p[mode].max_running, p[mode].bound_by) == (2, MAX_NUM_SEQS), mode


def test_split_of_the_gpu_budget():
    # gpu-only: 12 pages of 1024 B + 12 indexer blocks of 128 B = 13824 B per request.
    p = plan(gpu_kv_bytes=5 * 13824, num_host_blocks=1000)
    assert (p["gpu-only"].max_running, p["gpu-only"].bound_by) == (5, GPU_PAGES)
    assert (p["gpu-only"].num_gpu_blocks, p["gpu-only"].num_indexer_blocks) == (60, 60)
    assert plan(gpu_kv_bytes=5 * 13824 - 1, num_host_blocks=1000)["gpu-only"].max_running == 4
    # always-host: 6 * 1024 + 12 * 128 = 7680 B per request.
    assert p["always-host"].max_running == 9 and p["always-host"].bound_by == HOT_BUFFERS
    # hisparse, 8 requests: arena N with N - max(4, N // 10) >= 48 is 53 blocks;
    # 53 * 1024 + 96 * 128 = 66560 <= 69120. 9 requests: 59 blocks + 108 -> 74240 > 69120.
    assert p["hisparse"].max_running == 8
    assert p["hisparse"].gpu_bytes_per_request == 7680
    # Long contexts: the indexer keys of the whole context outweigh hot buffer + tail.
    # 20 requests: arena max(100-page prompt, 20 * 6) = 120 blocks + 20 * 100 indexer blocks.
    long = plan(context=800, gpu_kv_bytes=120 * 1024 + 2000 * 128, num_host_blocks=10**6)
    assert (long["always-host"].max_running, long["always-host"].bound_by) == (20, INDEXER_CACHE)
    # Small budgets: the arena still holds one max-length prompt (100 blocks).
    small = plan(context=800, gpu_kv_bytes=100 * 1024 + 2 * 12800, num_host_blocks=10**6)
    assert small["always-host"].max_running == 2
    assert long["gpu-only"].bound_by == GPU_PAGES
    # A fixed indexer pool is charged to the budget; the arena gets the rest.
    fixed = plan(gpu_kv_bytes=100 * 1024 + 36 * 128, num_indexer_blocks=36, num_host_blocks=1000)
    assert fixed["always-host"].num_gpu_blocks == 100
    assert fixed["always-host"].bound_by == INDEXER_CACHE


def test_roofline_hand_computed():
    p = plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000, hit_rate=0.5,
             hbm_gb_s=1.0, pcie_gb_s=0.001)
    g = p["gpu-only"]  # 5 requests
    # per request: keys 96*1*16 + selected rows 16*2*64 + new row/key 2*64 + 16 = 3728 B
    assert g.hbm_bytes_per_step == 1000 + 5 * 3728
    assert g.h2d_bytes_per_step == 0 and g.pcie_ms == 0
    assert g.step_time_ms == pytest.approx(g.hbm_ms) == pytest.approx((1000 + 5 * 3728) / 1e6)
    a = p["always-host"]  # 10 requests, 8 of 16 selected rows miss in each layer
    assert a.hbm_bytes_per_step == 1000 + 10 * (3728 + 8 * 2 * 64)
    assert a.h2d_bytes_per_step == 10 * 8 * 2 * 64
    assert a.d2h_bytes_per_step == 10 * (2 * 64 + 16)
    assert a.pcie_ms == pytest.approx(10240 / 1e6 * 1e3)
    assert a.step_time_ms == pytest.approx(max(a.hbm_ms, a.pcie_ms)) == pytest.approx(10.24)
    assert a.decode_tok_s == pytest.approx(10 / 10.24e-3)
    assert plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000,
                weight_bytes=0)["gpu-only"].hbm_bytes_per_step == 5 * 3728


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="gpu_kv_bytes"):
        plan()
    with pytest.raises(ValueError, match="hot_buffer_size"):
        plan(gpu_kv_bytes=1 << 20, hot_buffer_size=8)
    with pytest.raises(ValueError, match="hit_rate"):
        plan(gpu_kv_bytes=1 << 20, hit_rate=1.5)
    with pytest.raises(ValueError, match="block_size"):
        plan(gpu_kv_bytes=1 << 20, block_size=12)


def _write_config(tmp_path, arch="deepseek_v32", **kw):
    from hisparse.models.random_checkpoint import make_hf_config

    cfg = make_hf_config(arch, **kw).to_dict()
    cfg["architectures"] = [{"deepseek_v32": "DeepseekV32ForCausalLM",
                             "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[arch]]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("arch,kw", [
    ("deepseek_v32", {}),
    ("glm_moe_dsa", dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])),
])
def test_weight_params_match_the_transformers_model(arch, kw):
    from hisparse.models.config import DSAConfig
    from hisparse.models.random_checkpoint import make_random_model

    model = make_random_model(arch, **kw)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    dsa = DSAConfig.from_hf(cfg)
    ref = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert count_weight_params(dsa) == ref
    geo = geometry_from_config(dsa)
    assert geo.num_indexer_layers == sum(dsa.layer_has_indexer(i) for i in range(dsa.num_layers))
    assert geo.weight_bytes == ref * 4 or geo.weight_bytes == ref * 2  # checkpoint dtype


def test_cli_plan_json_and_table(tmp_path, capsys):
    from hisparse.cli import main

    path = _write_config(tmp_path, num_hidden_layers=5, kv_lora_rank=512, qk_rope_head_dim=64,
                         index_head_dim=128, index_topk=2048, max_position_embeddings=65536)
    geo = load_geometry(path)
    assert (geo.num_layers, geo.kv_row_dim, geo.index_head_dim) == (5, 576, 128)
    args = ["plan", "--model", path, "--gpu-kv-gib", "2", "--host-pool-gib", "4",
            "--context", "32768", "--kv-cache-dtype", "fp8", "--weight-bytes", "1.5"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for mode in MODES:
        assert {"max_running", "bound_by", "bytes_per_token", "step_time_ms",
                "decode_tok_s"} <= set(out[mode])
        assert out[mode]["bound_by"] in out[mode]["bounds"]
        assert out[mode]["max_running"] == out[mode]["bounds"][out[mode]["bound_by"]]
        assert out[mode]["max_running"] == min(v for k, v in out[mode]["bounds"].items()
                                               if k != HOST_POOL or mode != "hisparse")
    assert out["hisparse"]["bytes_per_token"]["host"] == 5 * (656 + 132)
    assert out["inputs"]["weight_bytes"] == 1_500_000_000
    assert out["hisparse"]["max_running"] > out["gpu-only"]["max_running"] > 0
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "max running" in table and "always-host" in table and "bound by" in table
    with pytest.raises(ValueError, match="config.json"):
        load_geometry(str(tmp_path / "missing"))


# ---------------------------------------------------------------- the engine agrees

GIB_ = 1 << 30
PROMPT, OUT, BS, HOT = 64, 48, 8, 32   # 112 tokens: 14 pages; host-read: 4 hot + 2 tail blocks


def _run_engine(path, mode, num_gpu_blocks, n_requests=12, **kw):
    from hisparse import LLM, SamplingParams

    base = dict(device="cpu", dtype="float32", block_size=BS, max_model_len=PROMPT + OUT,
                max_num_seqs=16, num_gpu_blocks=num_gpu_blocks, hot_buffer_size=HOT,
                host_pool_gib=0.05, max_num_batched_tokens=64, enable_prefix_caching=False)
    base.update(kw)
    llm = LLM(path, mode=mode, **base)
    plan = llm.capacity()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(PROMPT)]}
               for _ in range(n_requests)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True))
    return llm, plan


def test_llm_capacity_uses_the_engine_pools(dsv32_path):
    from hisparse import LLM

    llm = LLM(dsv32_path, device="cpu", dtype="float32", block_size=BS, max_model_len=112,
              max_num_seqs=16, num_gpu_blocks=60, hot_buffer_size=HOT, host_pool_gib=0.05,
              max_num_batched_tokens=64)
    kv: KVCacheConfig = llm.kv_config
    plan = llm.capacity()
    geo = llm.caches.geo
    assert plan.inputs.kv_cache_dtype == "float32"
    m = plan["hisparse"]
    # The planner's pools and bytes are the engine's.
    assert m.num_gpu_blocks == kv.num_gpu_blocks and m.num_indexer_blocks == kv.num_indexer_blocks
    assert m.num_host_blocks == kv.num_host_blocks
    assert m.num_host_blocks == host_blocks_for_gib(0.05, geo.bytes_per_token * BS)
    assert m.bytes_per_token["host"] == geo.bytes_per_token
    assert m.watermark_blocks == kv.watermark
    assert m.arena_blocks_per_request == kv.hot_blocks_per_request + 2
    assert m.bounds[INDEXER_CACHE] == kv.num_indexer_blocks // kv.max_pages_per_request
    assert plan["gpu-only"].bounds[GPU_PAGES] == kv.num_gpu_blocks // kv.max_pages_per_request
    assert llm.capacity(context=48)["hisparse"].bound_by == GPU_PAGES  # short: stays resident
    assert llm.capacity(hit_rate=1.0)["always-host"].h2d_bytes_per_step == 0


def test_engine_peak_running_matches_the_plan(dsv32_path, num_gpu_blocks=60):
    """gpu-only: the engine's peak is the plan. hisparse: the engine reaches at least the plan
    (it admits past the watermark; the plan leaves the watermark free) and at most the
    always-host figure. always-host: at most the plan and at least one less (the last request
    prefills its prompt pages resident before it shrinks to hot buffer + tail)."""
    peaks, plans = {}, {}
    for mode in MODES:
        llm, plan = _run_engine(dsv32_path, mode, num_gpu_blocks)
        peaks[mode], plans[mode] = llm.stats()["peak_running"], plan
        assert plan[mode].bound_by in (GPU_PAGES, HOT_BUFFERS)
    assert peaks["gpu-only"] == plans["gpu-only"]["gpu-only"].max_running
    assert plans["hisparse"]["hisparse"].max_running <= peaks["hisparse"] \
        <= plans["hisparse"]["always-host"].max_running
    planned = plans["always-host"]["always-host"].max_running
    assert planned - 1 <= peaks["always-host"] <= planned
    assert peaks["always-host"] > peaks["gpu-only"]


def test_engine_indexer_and_host_bounds(dsv32_path):
    llm, plan = _run_engine(dsv32_path, "gpu-only", 200, n_requests=6, num_indexer_blocks=3 * 14)
    assert (plan["gpu-only"].max_running, plan["gpu-only"].bound_by) == (3, INDEXER_CACHE)
    assert llm.stats()["peak_running"] == 3
    host_gib = 2.5 * 14 * BS * llm.caches.geo.bytes_per_token / (1 << 30)
    llm, plan = _run_engine(dsv32_path, "always-host", 200, n_requests=6,
                            host_pool_gib=host_gib)
    assert (plan["always-host"].max_running, plan["always-host"].bound_by) == (2, HOST_POOL)
    assert llm.stats()["peak_running"] == 2
    # hisparse runs the 4 others GPU-held (14 pages each), as its plan says it can
    llm, plan = _run_engine(dsv32_path, "hisparse", 200, n_requests=6, host_pool_gib=host_gib)
    assert plan["hisparse"].bounds[HOST_POOL] == 2 and plan["hisparse"].max_running >= 6
    assert llm.stats()["peak_running"] == 6 and llm.stats()["gpu_held_admissions"] == 4
    # an arena with room for two GPU-held requests beside two host-read ones above the
    # watermark: 2 * 6 + 2 * 14 + max(4, 44 // 10) = 44 blocks
    llm, plan = _run_engine(dsv32_path, "hisparse", 44, n_requests=6, host_pool_gib=host_gib)
    assert (plan["hisparse"].max_running, plan["hisparse"].gpu_held) == (4, 2)
    assert plan["hisparse"].bound_by == GPU_PAGES
    s = llm.stats()
    assert s["peak_running"] == 4 and s["gpu_held_admissions"] >= 2, s


def test_format_plan_lists_every_mode():
    text = format_plan(plan(num_gpu_blocks=60, num_indexer_blocks=1000, num_host_blocks=1000))
    assert all(m in text for m in MODES) and "decode tok/s" in text


@pytest.mark.parametrize("mode", MODES)
def test_engine_splits_the_gpu_budget_for_its_mode(dsv32_path, monkeypatch, mode):
    """Neither GPU pool given: the engine splits the KV budget (free memory on CUDA; a fixed
    figure here) as the planner does for its mode, allocates exactly those pools, and
    ``LLM.capacity()`` reports them; in the host modes the indexer cache is sized for what the
    host pool / hot buffers allow instead of idling next to them."""
    from dataclasses import replace

    from hisparse import LLM
    from hisparse.engine import pool_sizing

    budget = 300 * 1024 * 1024 // 64       # ~4.7 MiB: ~14 full-length requests' GPU pages
    monkeypatch.setattr(pool_sizing, "gpu_kv_budget",
                        lambda device, geo, util, reserve, staging_rows: budget)
    mg = load_geometry(dsv32_path)
    per_token = mg.num_layers * mg.row_bytes("float32") + mg.num_indexer_layers * mg.key_bytes(
        "float32")
    host_gib = 6.5 * 14 * BS * per_token / (1 << 30)   # host pool bound: 6 requests of 14 pages
    llm = LLM(dsv32_path, device="cpu", dtype="float32", block_size=BS, max_model_len=112,
              max_num_seqs=16, hot_buffer_size=HOT, host_pool_gib=host_gib,
              max_num_batched_tokens=64, mode=mode)
    kv, c, geo = llm.kv_config, llm.caches, llm.caches.geo
    # what the engine allocated
    assert c.arena.shape[1] == (kv.num_gpu_blocks + 1) * BS
    assert tuple(c.indexer.shape) == tuple(geo.indexer_shape(kv.num_indexer_blocks + 1, BS))
    host_rows = c.host.shape[1] if c.host is not None else 0
    assert host_rows == (kv.num_host_blocks * BS if mode != "gpu-only" else 0)
    used = (kv.num_gpu_blocks * geo.gpu_bytes_per_block(BS)
            + kv.num_indexer_blocks * geo.indexer_bytes_per_block(BS))
    assert used <= budget
    # what capacity() reports: those pools, and the planner's own split of the same budget
    got = llm.capacity()[mode]
    assert (got.num_gpu_blocks, got.num_indexer_blocks) == (kv.num_gpu_blocks,
                                                            kv.num_indexer_blocks)
    mg = replace(geometry_from_config(llm.model_config), num_layers=geo.num_layers,
                 num_indexer_layers=len(geo.indexer_layers))
    assert mg == load_geometry(dsv32_path)     # no MTP layer here: the same geometry
    want = plan_capacity(mg, CapacityInputs(
        context=112, gpu_kv_bytes=budget, block_size=BS, hot_buffer_size=HOT, max_num_seqs=16,
        kv_cache_dtype="float32",
        num_host_blocks=kv.num_host_blocks if mode != "gpu-only" else None))[mode]
    assert got.max_running == want.max_running > 0
    # the budget the pools came from, replanned: the same split, or another max_num_seqs's
    plan = llm.capacity()
    assert plan.inputs.gpu_kv_bytes == budget
    again = llm.capacity(num_gpu_blocks=None, num_indexer_blocks=None)[mode]
    assert (again.max_running, again.num_gpu_blocks, again.num_indexer_blocks) == (
        want.max_running, want.num_gpu_blocks, want.num_indexer_blocks)
    wider = llm.capacity(num_gpu_blocks=None, num_indexer_blocks=None, max_num_seqs=64)[mode]
    assert wider.max_running >= got.max_running
    if mode == "hisparse":   # `hisparse bench --concurrency max` plans the same
        from hisparse.bench.decode import hisparse_plan

        bench = hisparse_plan(dsv32_path, 112, budget, kv.num_host_blocks, BS, "float32")
        widest = llm.capacity(num_gpu_blocks=None, num_indexer_blocks=None,
                              max_num_seqs=4096)[mode]
        assert (bench.max_running, bench.gpu_held) == (widest.max_running, widest.gpu_held)
        assert bench.gpu_held > 0 and bench.max_running > got.max_running - got.gpu_held
    assert kv.num_indexer_blocks == want.max_running * kv.max_pages_per_request
    if mode == "gpu-only":
        assert got.bound_by in (GPU_PAGES, INDEXER_CACHE)
    elif mode == "always-host":   # the indexer cache is never what stops the host modes
        assert got.bounds[INDEXER_CACHE] >= got.max_running
        assert got.bound_by == HOST_POOL and got.max_running == 6
        # the arena keeps the rest of the budget (resident pages: fewer host reads)
        assert kv.num_gpu_blocks > 6 * kv.max_pages_per_request
    else:   # hisparse: 6 host-backed requests, GPU-held ones in the rest of the budget
        assert got.bounds[HOST_POOL] == 6 and got.gpu_held == got.max_running - 6 > 0
        assert got.bound_by in (GPU_PAGES, MAX_NUM_SEQS, INDEXER_CACHE)


def test_engine_split_reaches_the_gpu_held_plan(dsv32_path, monkeypatch):
    """A budget past what max_num_seqs full-length requests need and a host pool of one
    request: hisparse's plan is max_num_seqs requests, all but one GPU-held, and the arena the
    engine allocates (capped near max_num_seqs requests' pages) still leaves the watermark
    free beside them, so its own capacity() reaches the plan."""
    from hisparse import LLM
    from hisparse.engine import pool_sizing

    mg = load_geometry(dsv32_path)
    per_page = BS * (mg.num_layers * mg.row_bytes("float32")
                     + mg.num_indexer_layers * mg.key_bytes("float32"))
    budget = 3 * 16 * 14 * per_page                     # ~3x what 16 requests of 14 pages take
    monkeypatch.setattr(pool_sizing, "gpu_kv_budget",
                        lambda device, geo, util, reserve, staging_rows: budget)
    llm = LLM(dsv32_path, device="cpu", dtype="float32", block_size=BS, max_model_len=112,
              max_num_seqs=16, hot_buffer_size=HOT, host_pool_gib=1.5 * 14 * per_page / GIB_,
              max_num_batched_tokens=64, mode="hisparse")
    got = llm.capacity()["hisparse"]
    assert got.bounds[HOST_POOL] == 1
    assert (got.max_running, got.gpu_held, got.bound_by) == (16, 15, MAX_NUM_SEQS)
    kv = llm.kv_config
    assert kv.num_gpu_blocks - kv.watermark >= 15 * 14 + got.arena_blocks_per_request


def test_host_pool_auto_without_cuda(dsv32_path, monkeypatch):
    from hisparse import LLM
    from hisparse.worker import pinned

    monkeypatch.setattr(pinned, "available_host_memory_bytes", lambda: 1 << 30)
    llm = LLM(dsv32_path, device="cpu", dtype="float32", block_size=BS, max_model_len=112,
              max_num_seqs=4, num_gpu_blocks=60, hot_buffer_size=HOT, host_pool_gib="auto",
              max_num_batched_tokens=64)
    per_block = llm.caches.geo.bytes_per_token * BS
    assert llm.kv_config.num_host_blocks == int((1 << 30) * pinned.CPU_FRACTION) // per_block


def test_host_pool_auto_with_nothing_to_pin_names_the_knob(dsv32_path, monkeypatch):
    from hisparse import LLM
    from hisparse.worker import pinned

    monkeypatch.setattr(pinned, "available_host_memory_bytes", lambda: 0)
    with pytest.raises(ValueError, match="host_pool_gib='auto' found no host memory"):
        LLM(dsv32_path, device="cpu", dtype="float32", block_size=BS, max_model_len=112,
            max_num_seqs=4, num_gpu_blocks=60, hot_buffer_size=HOT, host_pool_gib="auto",
            max_num_batched_tokens=64)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
def test_engine_split_on_cuda_matches_capacity(dsv32_path, mode):
    """On CUDA, from free memory: the pools allocated are the ones LLM.capacity() reports, and
    they fit the budget the engine measured."""
    import torch

    from hisparse import LLM

    llm = LLM(dsv32_path, device="cuda", dtype="bfloat16", block_size=BS, max_model_len=112,
              max_num_seqs=16, hot_buffer_size=HOT, host_pool_gib=0.05, mode=mode,
              max_num_batched_tokens=64, enforce_eager=True)
    kv, c = llm.kv_config, llm.caches
    got = llm.capacity()[mode]
    assert (got.num_gpu_blocks, got.num_indexer_blocks) == (kv.num_gpu_blocks,
                                                            kv.num_indexer_blocks)
    assert c.arena.shape[1] == (kv.num_gpu_blocks + 1) * BS
    assert tuple(c.indexer.shape) == tuple(c.geo.indexer_shape(kv.num_indexer_blocks + 1, BS))
    if mode != "gpu-only":
        assert c.host.shape[1] == kv.num_host_blocks * BS and c.host.is_pinned()
    if mode == "always-host":
        assert got.bound_by in (HOST_POOL, MAX_NUM_SEQS, HOT_BUFFERS)
    elif mode == "hisparse":    # GPU-held requests past the host pool's bound
        assert got.gpu_held == 0 or got.max_running - got.gpu_held == got.bounds[HOST_POOL]
        assert got.bound_by in (HOST_POOL, MAX_NUM_SEQS, GPU_PAGES, INDEXER_CACHE)
    assert kv.num_indexer_blocks == got.max_running * kv.max_pages_per_request
    assert got.max_running > 0
    llm.shutdown()
    torch.cuda.empty_cache()
