"""The replayed next-ranked band (issue 15, ``hisparse bench``): a trace's ranks k.. reach the
score policy and the prefetcher through the top-k override, tiled like its top-k; synthetic
sources have no band. Hand-built random traces only (no trace data in the repository)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from hisparse.bench import decode, report
from hisparse.bench.locality import SyntheticTopk, TraceTopk


def _write_trace(path, pos, below, ctx0):
    docs, _, steps, _ = pos.shape
    ctx = np.broadcast_to(ctx0 + np.arange(steps), (docs, steps)).astype(np.int32)
    fields = dict(positions=pos.astype(np.int32), context_lens=ctx)
    if below is not None:
        fields["below_cut"] = below.astype(np.int32)
    np.savez(path, **fields)
    return str(path)


@pytest.fixture
def random_trace(tmp_path):
    """docs 2, layers 3, steps 5, k_t 4, 5 ranks below the cut: unique random positions."""
    rng = np.random.default_rng(5)
    docs, layers, steps, kt, kb, ctx0 = 2, 3, 5, 4, 5, 30
    ranked = np.zeros((docs, layers, steps, kt + kb), dtype=np.int64)
    for d, l, t in itertools.product(range(docs), range(layers), range(steps)):
        ranked[d, l, t] = rng.choice(ctx0 + t, size=kt + kb, replace=False)
    path = _write_trace(tmp_path / "t.npz", ranked[..., :kt], ranked[..., kt:], ctx0)
    return path, ranked, kt


def _expected_band(ranked, kt, ctx0, layer, stream, step, context_len, k, width):
    """The band spelled out from TraceTopk's documented tiling: tile i replays sub-stream
    u = stream * S + i (doc u % docs, layer (layer + u // docs) % layers), sits R = the largest
    trace context below the next tile and puts its n_i best ranks in the selection; the band
    lists the tiles' following ranks by (rank, tile)."""
    docs, layers, steps, _ = ranked.shape
    S = math.ceil(k / kt)
    R = ctx0 + steps - 1
    base = context_len - step - ctx0
    keyed, left = [], k
    for i in range(S):
        u = stream * S + i
        n = min(kt, left)
        left -= n
        full = ranked[u % docs, (layer + u // docs) % layers, step % steps]
        off = base - (S - 1 - i) * R
        keyed += [(rank, i, int(full[rank]) + off) for rank in range(n, len(full))]
    out = [p for _, _, p in sorted(keyed)][:width]
    return np.array(out + [-1] * (width - len(out)))


@pytest.mark.parametrize("k", [3, 4, 6, 8, 12])
def test_trace_band_is_the_tiled_ranks_below_the_cut(random_trace, k):
    path, ranked, kt = random_trace
    tr = TraceTopk(path)
    assert tr.has_band
    c0 = tr.min_context(k) + 3
    for layer, stream, t in itertools.product(range(4), range(3), range(7)):
        sel = tr.select(layer, stream, t, c0 + t, k)
        for width in (k, 2 * k, 40):
            band = tr.select_band(layer, stream, t, c0 + t, k, width)
            assert band.dtype == np.int64 and band.shape == (width,)
            want = _expected_band(ranked, kt, 30, layer, stream, t, c0 + t, k, width)
            assert np.array_equal(band, want), (layer, stream, t, width)
            real = band[band >= 0]
            assert len(np.unique(real)) == len(real) and real.max() < c0 + t
            assert not np.isin(real, sel).any()               # disjoint from the selection
            assert (band[len(real):] == -1).all()             # padding only at the end
    # the band's head takes the same rank from every tile (interleaved, not concatenated)
    S = tr.tiles(8)
    head = tr.select_band(0, 0, 0, tr.min_context(8), 8, S)
    spans = sorted(int(p) // tr.span for p in head)
    assert len(set(spans)) == S


def test_band_table_and_override(random_trace):
    path, _, _ = random_trace
    tr = TraceTopk(path)
    k, layers, outputs, streams = 8, 2, 6, 3
    context = tr.min_context(k) + 2
    table = decode.topk_table(tr, layers, context, outputs, k, streams=streams, band=k)
    assert table.shape == (streams, layers, outputs, 2 * k) and table.dtype == torch.int32
    override = decode.make_topk_override(table, context, k)
    slots = torch.tensor([2, -1, 0, 4, -1], dtype=torch.int32)
    steps = torch.tensor([0, 3, 5, 2, 1])
    for layer in range(layers + 1):                   # layers beyond the table wrap around
        topk, band = override(layer, slots, context + steps, torch.zeros(5, k, dtype=torch.int32))
        assert topk.shape == (5, k) and band.shape == (5, k)
        assert band.stride(-1) == 1                   # the resolver's contract
        for i, (slot, s) in enumerate(zip(slots.tolist(), steps.tolist())):
            if slot < 0:                              # padding selects nothing, has no band
                assert (topk[i] == -1).all() and (band[i] == -1).all()
                continue
            c = context + s + 1
            assert topk[i].tolist() == tr.select(layer % layers, slot % streams, s, c, k).tolist()
            assert band[i].tolist() == tr.select_band(layer % layers, slot % streams, s, c, k,
                                                      k).tolist()
    # without a band the override hands over none
    plain = decode.topk_table(tr, layers, context, outputs, k, streams=streams)
    topk, band = decode.make_topk_override(plain, context)(0, slots, context + steps, None)
    assert band is None and topk.shape == (5, k)


def test_ascending_table_holds_each_selection_in_position_order():
    """``ascending`` (the engine's order without a band): every step's row is the source's
    selection, sorted, ``-1`` after it; the source's own (random) order differs somewhere."""
    src = SyntheticTopk(0.8, 2, seed=3)
    context, outputs, k = 40, 5, 16
    asc = decode.topk_table(src, 2, context, outputs, k, streams=2, ascending=True)
    raw = decode.topk_table(SyntheticTopk(0.8, 2, seed=3), 2, context, outputs, k, streams=2)
    assert not torch.equal(asc, raw)
    for d in range(2):
        for layer in range(2):
            for s in range(outputs):
                got, sel = asc[d, layer, s].tolist(), raw[d, layer, s].tolist()
                chosen = sorted(c for c in sel if c >= 0)
                assert got == chosen + [-1] * (k - len(chosen))


def test_an_engine_that_sorts_its_top_k_replays_the_band_table_sorted(random_trace):
    """Every run under HISPARSE_TOPK_ORDER=positions (the default), a band policy's or
    not: the band's table (k + band wide) replays with its top k in position order (``-1``
    last where a step selects fewer than k), the band columns kept in rank order."""
    path, _, _ = random_trace
    k, layers, outputs, streams = 8, 2, 6, 3
    context = TraceTopk(path).min_context(k) + 2
    raw = decode.topk_table(TraceTopk(path), layers, context, outputs, k, streams=streams,
                            band=k)
    asc = decode.topk_table(TraceTopk(path), layers, context, outputs, k, streams=streams,
                            band=k, ascending=True)
    assert asc.shape == raw.shape and not torch.equal(raw[..., :k], asc[..., :k])
    assert torch.equal(asc[..., k:], raw[..., k:])
    # and steps that select fewer than k (a synthetic source, steps 0-2 select 5-7 of 8)
    short_raw = decode.topk_table(SyntheticTopk(0.8, 2, seed=5), 2, 4, 6, k, streams=2)
    short = decode.topk_table(SyntheticTopk(0.8, 2, seed=5), 2, 4, 6, k, streams=2,
                              ascending=True)
    assert (short == -1).any()
    for got, src in ((asc, raw), (short, short_raw)):
        for row, want in zip(got[..., :k].reshape(-1, k).tolist(),
                             src[..., :k].reshape(-1, k).tolist()):
            chosen = sorted(c for c in want if c >= 0)
            assert row == chosen + [-1] * (k - len(chosen))


def test_sources_without_a_band(tmp_path, random_trace):
    _, ranked, kt = random_trace
    no_band = _write_trace(tmp_path / "nb.npz", ranked[..., :kt], None, 30)
    tr = TraceTopk(no_band)
    assert not tr.has_band and not SyntheticTopk(0.8, 2).has_band
    with pytest.raises(ValueError, match="below_cut"):
        tr.select_band(0, 0, 0, tr.min_context(4), 4, 4)
    with pytest.raises(ValueError, match="band"):
        decode.topk_table(tr, 1, tr.min_context(4), 2, 4, band=4)
    with pytest.raises(ValueError, match="--hot-policies score.*has_band"):
        decode.check_band_policies("synthetic:0.8", ["lru", "score"])
    with pytest.raises(ValueError, match="below_cut"):
        decode.check_band_policies(f"trace:{no_band}", ["score+prefetch"], tr)
    decode.check_band_policies("synthetic:0.8", ["lru"])           # lru needs no band
    decode.check_band_policies("indexer", ["score+prefetch"])      # the indexer has its own
    with pytest.raises(ValueError, match="MiB"):
        decode.topk_table(SyntheticTopk(0.8, 1), 1, 64, 4, 8, limit_bytes=100)


def test_bench_refuses_band_policies_on_synthetic_before_the_device(capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(["--profile", "tp8-rank", "--hot-policies", "lru,score+prefetch"])
    assert e.value.code == 2
    assert "--hot-policies score+prefetch" in capsys.readouterr().err


def test_ratio_rows_against_the_all_hit_point():
    base = report.Point(mode="always-host", topk_source="synthetic:1.0", context=64,
                        concurrency=4, outputs=8, decode_tok_s=1.0, tpot_p50_ms=1.0,
                        tpot_p99_ms=1.0, running_reached=4, hot_hit_rate=0.99, h2d_gb_s=0.0,
                        gpu_mem_gib=1.0, host_pool_gib=1.0, num_preempted=0, spilled_pages=0,
                        wall_s=1.0, wall_ms_per_step=10.0, gpu_ms_per_step=8.0)
    pts = [base,
           replace(base, topk_source="trace:/x/t.npz", hot_policy="score+prefetch",
                   wall_ms_per_step=10.4, gpu_ms_per_step=10.0, hot_prefetch_hits=7),
           replace(base, topk_source="trace:/x/t.npz", concurrency=8)]     # no baseline
    rows = report.ratio_rows(pts)
    assert [r["source"] for r in rows] == ["synthetic:1.0", "t.npz"]
    assert rows[0]["wall_x"] == 1.0 and rows[1]["wall_x"] == pytest.approx(1.04)
    assert rows[1]["gpu_x"] == pytest.approx(1.25) and rows[1]["prefetch_hits"] == 7


def test_plot_series_keeps_single_points_and_sorts_by_concurrency():
    """A bench of one concurrency still plots its points (a line of one marker each), and a
    line's points go by concurrency, not by the order they were measured."""
    base = report.Point(mode="gpu-only", topk_source="synthetic:0.8", context=32768,
                        concurrency=64, outputs=8, decode_tok_s=30.0, tpot_p50_ms=1.0,
                        tpot_p99_ms=1.0, running_reached=4, hot_hit_rate=1.0, h2d_gb_s=0.0,
                        gpu_mem_gib=1.0, host_pool_gib=1.0, num_preempted=0, spilled_pages=0,
                        wall_s=1.0)
    pts = [base, replace(base, concurrency=8, decode_tok_s=10.0),
           replace(base, mode="hisparse", decode_tok_s=40.0),
           replace(base, topk_source="trace:/runs/x/t.npz", decode_tok_s=20.0)]
    assert report.plot_series(pts) == [("gpu-only 32k synthetic:0.8", [8, 64], [10.0, 30.0]),
                                       ("gpu-only 32k t.npz", [64], [20.0]),
                                       ("hisparse 32k synthetic:0.8", [64], [40.0])]


# ------------------------------------------------------------------ the engine on CPU
# One tile (k_t = top-k; the tiling is the tests above): every selected or band row lies below
# position 160, far below what 16 GPU blocks of 8 tokens can keep resident, so all are host-only.
K, STEPS, CTX0, ENTER = 16, 6, 320, 4


def _chain_trace(path, prefetchable: bool, seed: int) -> str:
    """One doc, one layer: step t+1 keeps K - ENTER of step t's rows and takes ENTER new ones:
    the best ENTER of step t's band (``prefetchable``) or rows no band ever holds. Every new
    or band row is a fresh position."""
    rng = np.random.default_rng(seed)
    fresh = iter(rng.permutation(160).tolist())
    sel = [next(fresh) for _ in range(K)]
    pos = np.zeros((1, 1, STEPS, K), dtype=np.int64)
    below = np.zeros((1, 1, STEPS, K), dtype=np.int64)
    for t in range(STEPS):
        pos[0, 0, t] = sel
        below[0, 0, t] = band = [next(fresh) for _ in range(K)]
        entering = band[:ENTER] if prefetchable else [next(fresh) for _ in range(ENTER)]
        sel = sel[ENTER:] + entering
    return _write_trace(path, pos, below, CTX0)


@pytest.fixture(scope="module")
def band_model(tmp_path_factory, single_torch_thread):
    from hisparse.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("band"), "deepseek_v32", seed=5,
                                  index_topk=K, num_hidden_layers=2)


def _run_engine(model, trace, policy):
    from hisparse import LLM, SamplingParams
    from hisparse.bench.synthetic import synthetic_runner

    tr = TraceTopk(trace)
    context = tr.min_context(K) + 4
    table = decode.topk_table(tr, 2, context, STEPS, K, streams=2, band=K)
    override = decode.make_topk_override(table, context, K)
    llm = LLM(model, device="cpu", block_size=8, max_model_len=context + STEPS + 1,
              max_num_seqs=2, max_num_batched_tokens=64, mode="always-host",
              num_gpu_blocks=16, host_pool_gib=0.01,     # few GPU blocks: history host-only
              hot_buffer_size=2 * K, hot_policy=policy,
              hot_prefetch_rows=ENTER, runner_cls=synthetic_runner(topk_override=override))
    try:
        llm.generate([{"prompt_token_ids": list(range(2, 2 + context))}] * 2,
                     SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True))
        return llm.stats()
    finally:
        llm.shutdown()


def test_engine_prefetches_the_replayed_band(band_model, tmp_path):
    cold = 2 * 2 * K                            # 2 requests x 2 layers, first step all misses
    entering = 2 * 2 * (STEPS - 1) * ENTER      # rows entering at the later steps
    s = _run_engine(band_model, _chain_trace(tmp_path / "a.npz", True, 1), "score+prefetch")
    assert s["hot_prefetched"] == 2 * 2 * STEPS * ENTER        # ENTER band rows every step
    assert s["hot_prefetch_hits"] == entering                  # each one used the next step
    assert s["hot_demand_misses"] == cold
    s = _run_engine(band_model, _chain_trace(tmp_path / "b.npz", False, 1), "score+prefetch")
    assert s["hot_prefetched"] > 0 and s["hot_prefetch_hits"] == 0
    assert s["hot_demand_misses"] == cold + entering
    s = _run_engine(band_model, _chain_trace(tmp_path / "c.npz", True, 1), "lru")
    assert s["hot_prefetched"] == 0 and s["hot_demand_misses"] == cold + entering


def test_bench_names_host_pool_gib_when_the_pool_cannot_be_pinned(monkeypatch, capsys):
    """A pool that does not pin ends the benchmark with an error naming --host-pool-gib (it
    died with a raw 'CUDA error: out of memory' traceback)."""
    import torch

    def refuse(*args, **kw):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "pin_host_pool", refuse)
    with pytest.raises(SystemExit) as e:
        decode.main(["--topk", "indexer", "--contexts", "4096", "--outputs", "8",
                     "--host-pool-gib", "96"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--host-pool-gib 96" in err and "out of memory" in err


def test_replay_kernel_equals_reference(monkeypatch):
    """The benchmark's one-kernel top-k replay (Triton, under the interpreter here) gives the
    torch reference's rows: stream = slot modulo streams, layer modulo layers, step clamped on
    both sides, padding tokens all -1; a poisoned output catches unwritten columns."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib

    from hisparse.bench import _replay_triton, replay
    importlib.reload(_replay_triton)
    g = torch.Generator().manual_seed(3)
    streams, layers, steps, width, context = 3, 4, 5, 1500, 100   # width > BLOCK: two blocks
    table = torch.randint(-1, 10_000, (streams, layers, steps, width), generator=g,
                          dtype=torch.int32)
    slots = torch.tensor([0, 4, -1, 2, 7], dtype=torch.int32)
    positions = torch.tensor([90, 101, 103, 104, 500], dtype=torch.int64)   # below, in, above
    for layer in (0, 3, 6):
        want = replay.replay_rows_reference(table, layer, slots, positions, context)
        got = _replay_triton.replay_rows(table, layer, slots, positions, context)
        assert torch.equal(got, want), layer
        assert (got[2] == -1).all()


@pytest.mark.gpu
def test_gpu_replay_kernel_equals_reference_inside_a_graph():
    """On CUDA the replay is the compiled kernel; captured in a CUDA graph (as the engine's
    decode graphs capture it) and replayed after the slots and positions changed, it gives the
    reference's rows for the new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hisparse.bench import replay
    g = torch.Generator(device="cuda").manual_seed(5)
    table = torch.randint(-1, 50_000, (4, 61, 64, 4096), generator=g, device="cuda",
                          dtype=torch.int32)
    slots = torch.tensor([0, 5, -1, 3], dtype=torch.int32, device="cuda")
    positions = torch.tensor([10, 40, 41, 90], dtype=torch.int64, device="cuda")
    replay.replay_rows(table, 7, slots, positions, 32)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = replay.replay_rows(table, 7, slots, positions, 32)
    slots.copy_(torch.tensor([2, -1, 6, 1], dtype=torch.int32))
    positions.copy_(torch.tensor([33, 34, 200, 0], dtype=torch.int64))
    graph.replay()
    want = replay.replay_rows_reference(table, 7, slots, positions, 32)
    assert torch.equal(out, want)
