"""End-to-end engine tests on CPU: oracle vs transformers, lossless tiering, prefix restore,
bad input."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from workload import prompts, tokens

from hisparse import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)




def unconstrained(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8)
    base.update(kw)
    return LLM(path, mode="gpu-only", **base)


def tiny_pool(path, mode="hisparse", **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
                num_gpu_blocks=30, hot_buffer_size=32, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, mode=mode, **base)


@pytest.mark.parametrize("arch", ["dsv32", "glm"])
def test_oracle_greedy_tokens_and_logits_match_transformers(arch, request):
    path = request.getfixturevalue(f"{arch}_path")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(3, 40, 70, seed=1)           # longer than index_topk (16)
    llm = tiny_pool(path)
    outs = llm.generate(batch, GREEDY)
    for p, out in zip(batch, outs):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.prompt_token_ids == p["prompt_token_ids"]
    # Logits of a prefill step through the paged engine vs transformers' forward.
    ids = batch[0]["prompt_token_ids"]
    llm2 = unconstrained(path)
    llm2.add_request({"prompt_token_ids": ids}, GREEDY)
    plan = llm2.scheduler.schedule()
    logits, _ = llm2.runner.execute(plan, ids)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_lossless_under_a_tiny_gpu_pool(dsv32_path, mode):
    ref = unconstrained(dsv32_path)
    for seed, (n, lo, hi) in enumerate([(8, 20, 120), (5, 90, 150), (12, 3, 40)]):
        batch = prompts(n, lo, hi, seed=seed + 10)
        params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(4, 30),
                                 ignore_eos=True) for i in range(n)]
        want = tokens(ref.generate(batch, params))
        llm = tiny_pool(dsv32_path, mode)
        assert tokens(llm.generate(batch, params)) == want
        if seed == 0:
            s = llm.stats()
            assert s["spilled_pages"] > 0 and s["host_read_switches"] > 0
            assert s["hot_misses"] > 0 and s["h2d_bytes"] > 0 and s["d2h_bytes"] > 0


def test_lossless_with_gpu_held_requests_past_a_small_host_pool(dsv32_path):
    """hisparse with a host pool of two max-length requests: the others run GPU-held (all
    pages on GPU, no host blocks) while host-backed ones switch to host-read mode under
    pressure; greedy tokens equal the unconstrained run's."""
    ref = unconstrained(dsv32_path)
    host_gib = 2.5 * 24 * 8 * ref.caches.geo.bytes_per_token / (1 << 30)   # 24 pages a request
    batch = prompts(8, 90, 150, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(20, 40),
                             ignore_eos=True) for i in range(8)]
    want = tokens(ref.generate(batch, params))
    llm = tiny_pool(dsv32_path, num_gpu_blocks=110, host_pool_gib=host_gib)
    assert tokens(llm.generate(batch, params)) == want
    s = llm.stats()
    assert s["gpu_held_admissions"] > 0 and s["host_read_switches"] > 0, s
    assert s["peak_running"] > 2 and s["hot_misses"] > 0
    assert s["free_gpu_blocks"] == 110 and s["free_host_blocks"] == llm.kv_config.num_host_blocks


def test_lossless_gpu_held_requests_with_prefix_hits(dsv32_path):
    """A cached system prompt, then 8 requests sharing it past a host pool of two: every one,
    the GPU-held ones included, starts from the cached pages (host-only ones restored), and
    greedy tokens equal the unconstrained run's."""
    ref = unconstrained(dsv32_path)
    host_gib = 2.5 * 24 * 8 * ref.caches.geo.bytes_per_token / (1 << 30)   # 24 pages a request
    rng = random.Random(5)
    system = [rng.randrange(3, 380) for _ in range(80)]            # 10 full pages
    batch = [{"prompt_token_ids": system + [rng.randrange(3, 380)
                                            for _ in range(rng.randrange(10, 60))]}
             for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(20, 40),
                             ignore_eos=True) for i in range(8)]
    want = tokens(ref.generate(batch, params))
    llm = tiny_pool(dsv32_path, num_gpu_blocks=110, host_pool_gib=host_gib)
    llm.generate([{"prompt_token_ids": system + [5]}], GREEDY)      # publishes the 10 pages
    base = llm.stats()["prefix_hit_tokens"]
    assert tokens(llm.generate(batch, params)) == want
    s = llm.stats()
    assert s["gpu_held_admissions"] > 0, s
    assert s["prefix_hit_tokens"] - base == 8 * 80, s                # every request hit
    assert s["free_gpu_blocks"] == 110 and s["free_host_blocks"] == llm.kv_config.num_host_blocks


def test_overwritten_hot_lru_is_reported_and_outputs_stay_exact(dsv32_path, caplog):
    """Hot-buffer LRU entries overwritten mid-run with values out of range, their slots' rows
    lost (the resolver's fail-safe skips such entries, ``counters[2]``), show in
    ``stats()["hot_lru_corrupt"]``, are logged as an error once per new count, and, with
    enough usable slots left for every step's misses, the outputs still equal an unconstrained
    run's."""
    batch = prompts(8, 20, 120, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(unconstrained(dsv32_path).generate(batch, params))
    llm = tiny_pool(dsv32_path)
    ids = [llm.add_request(p, params) for p in batch]
    outs = {}
    while llm.has_unfinished_requests() and llm.stats()["host_read_switches"] == 0:
        outs.update({o.request_id: o for o in llm.step() if o.finished})
    assert llm.stats()["host_read_switches"] > 0 and llm.stats()["hot_lru_corrupt"] == 0
    # every third LRU entry of every request slot and layer out of range; its hot slot loses
    # its row (the key), as the fail-safe assumes: the slot is lost, the row loads again
    c = llm.caches
    H = c.hot_lru.shape[-1]
    lost = c.hot_lru[:, :, ::3].long()
    c.hot_keys.scatter_(2, lost, -1)
    c.hot_lru[:, :, ::3] = H + 7
    with caplog.at_level("ERROR", logger="hisparse.engine"):
        while llm.has_unfinished_requests():
            outs.update({o.request_id: o for o in llm.step() if o.finished})
        corrupt = llm.stats()["hot_lru_corrupt"]
        assert corrupt > 0 and llm.stats()["hot_lru_corrupt"] == corrupt
    assert [r.getMessage() for r in caplog.records].count(
        f"the resolver skipped {corrupt} hot-buffer LRU entries out of range: the hot buffers' "
        "state was overwritten (those slots go unused; rows are loaded again)") == 1
    assert tokens([outs[i] for i in ids]) == want


def test_gpu_only_mode_matches_and_never_touches_host(dsv32_path):
    batch = prompts(6, 30, 100, seed=3)
    want = tokens(unconstrained(dsv32_path).generate(batch, GREEDY))
    llm = unconstrained(dsv32_path, num_gpu_blocks=24)   # admission bounded by GPU blocks
    assert tokens(llm.generate(batch, GREEDY)) == want
    s = llm.stats()
    assert s["peak_running"] < 6 and s["d2h_bytes"] == 0 and s["hot_misses"] == 0


def test_sampling_with_seed_is_reproducible_and_batch_independent(dsv32_path):
    llm = unconstrained(dsv32_path)
    p = prompts(3, 20, 40, seed=4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                        ignore_eos=True)
    alone = tokens(llm.generate(p[:1], sp))
    batched = tokens(llm.generate(p, [sp, GREEDY, GREEDY]))
    assert alone[0] == batched[0]
    assert alone[0] != tokens(llm.generate(p[:1], GREEDY))[0]


def test_prefix_restored_from_host_after_pressure(dsv32_path):
    rng = random.Random(5)
    shared = [rng.randrange(2, 384) for _ in range(96)]
    first = {"prompt_token_ids": shared + [7, 8, 9]}
    second = {"prompt_token_ids": shared + [rng.randrange(2, 384) for _ in range(20)]}
    llm = tiny_pool(dsv32_path, num_gpu_blocks=26)
    llm.generate([first], GREEDY)
    llm.generate(prompts(6, 90, 120, seed=6), GREEDY)     # pressure: the cached pages are reused
    before = llm.stats()["host_prefix_hit_tokens"]
    out = llm.generate([second], GREEDY)
    s = llm.stats()
    assert s["host_prefix_hit_tokens"] - before >= 64 and s["restored_pages"] > 0
    assert tokens(out) == tokens(unconstrained(dsv32_path).generate([second], GREEDY))


def test_bad_input_is_rejected_and_the_engine_keeps_serving(dsv32_path):
    llm = tiny_pool(dsv32_path)
    good = prompts(2, 30, 40, seed=7)
    ok_id = llm.add_request(good[0], GREEDY)
    with pytest.raises(ValueError, match=r"max_model_len \(192\)"):
        llm.add_request({"prompt_token_ids": [5] * 192}, GREEDY)
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(ValueError, match=r"token id 384 is outside the vocabulary \[0, 384\)"):
        llm.generate([good[1], {"prompt_token_ids": [3, 384]}], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    out = llm.generate([good[1]], GREEDY)       # still serving, including the queued request
    assert len(out[0].outputs[0].token_ids) == 16
    while llm.has_unfinished_requests():
        llm.step()
    assert ok_id not in llm._requests


def test_bad_engine_config_names_the_field(dsv32_path, tmp_path):
    with pytest.raises(ValueError, match=r"hot_buffer_size must be >= index_topk \(16\)"):
        tiny_pool(dsv32_path, hot_buffer_size=8)
    with pytest.raises(ValueError, match="host_pool_gib .* exceeds available host memory"):
        tiny_pool(dsv32_path, host_pool_gib=1e6)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        tiny_pool(dsv32_path, block_size=12)
    bad = tmp_path / "llama"
    shutil.copytree(dsv32_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(bad), device="cpu")


def test_glm_shared_indexer_layers_lossless_under_pressure(glm_path):
    batch = prompts(6, 40, 140, seed=21)
    want = tokens(unconstrained(glm_path).generate(batch, GREEDY))
    llm = tiny_pool(glm_path)
    assert tokens(llm.generate(batch, GREEDY)) == want
    assert llm.stats()["hot_misses"] > 0


def test_text_prompts_and_text_outputs_with_a_tokenizer(dsv32_path, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "with_tokenizer"
    shutil.copytree(dsv32_path, path)
    vocab = {f"w{i}": i for i in range(384)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, max_model_len=64,
              max_num_seqs=2, mode="gpu-only")
    text = " ".join(f"w{i}" for i in range(5, 25))
    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt == text and out.prompt_token_ids == list(range(5, 25))
    assert out.outputs[0].text == " ".join(f"w{i}" for i in out.outputs[0].token_ids)
    ids_out = llm.generate([{"prompt_token_ids": list(range(5, 25))}],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert ids_out.outputs[0].token_ids == out.outputs[0].token_ids


def test_topk_barrier_give_ups_are_reported(dsv32_path, caplog):
    """A give-up of the one-launch top-k's row barriers (``TopkScratch.stalls``: the selection
    may be inexact) shows in ``stats()["topk_stalls"]`` and is logged as an error once per new
    count; none in a normal run."""
    llm = unconstrained(dsv32_path)
    llm.generate(prompts(2, 20, 40, seed=5), SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.stats()["topk_stalls"] == 0
    llm.caches.workspace.indexer.topk.stalls.fill_(3)        # as the kernel counts a give-up
    with caplog.at_level("ERROR", logger="hisparse.engine"):
        assert llm.stats()["topk_stalls"] == 3
        assert llm.stats()["topk_stalls"] == 3
    errors = [r for r in caplog.records if "gave up 3 row barrier" in r.getMessage()]
    assert len(errors) == 1


def _host_read_selections(llm, batch, params) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(top-k, band) of the last indexer layer after every step whose forward read the host
    with a band."""
    for p, sp in zip(batch, params):
        llm.add_request(p, sp)
    seen = []
    while llm.has_unfinished_requests():
        llm.step()
        ctx = llm.runner.ctx
        if ctx.host_read and ctx.band is not None:
            seen.append((ctx.topk.clone(), ctx.band.clone()))
    return seen


@pytest.mark.parametrize("order", ["positions", "ranked"])
def test_topk_order_positions_sorts_the_top_k_and_keeps_the_band_ranked(dsv32_path,
                                                                        kernel_switches, order):
    """HISPARSE_TOPK_ORDER=positions under the score policy: in host-read forwards (the ones
    that select a band) the top k come out in position order (``-1`` last) beside the
    band; ``ranked`` keeps them in score order (the check can fail)."""
    from hisparse.ops.topk import column_order_reference

    kernel_switches(topk_order=order)
    llm = tiny_pool(dsv32_path, hot_policy="score")
    batch = prompts(8, 90, 150, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 8
    seen = _host_read_selections(llm, batch, params)
    assert seen, "no host-read forward with a band"
    sorted_rows = [torch.equal(top, column_order_reference(top)) for top, _ in seen]
    if order == "positions":
        assert all(sorted_rows)
    else:
        assert not all(sorted_rows)
    for top, band in seen:          # the band: positions outside the token's top k
        for t in range(top.shape[0]):
            picked = set(top[t][top[t] >= 0].tolist())
            assert not picked & set(band[t][band[t] >= 0].tolist())


@pytest.mark.parametrize("order", ["positions", "ranked"])
def test_lossless_under_each_topk_order_with_the_score_policy(dsv32_path, kernel_switches,
                                                               order):
    """Hisparse under pressure with the score policy gives the unconstrained run's greedy
    tokens under ``positions`` (host-read forwards rank k + band and count their k into
    position order; the others do not rank) and ``ranked`` (every forward ranks). Tokens of a
    tiny fp32 model do not see a summation order: test_ops_indexer_fused checks that both
    kinds of forward give the same order."""
    kernel_switches(topk_order=order)
    ref = unconstrained(dsv32_path, hot_policy="score")
    batch = prompts(8, 90, 150, seed=33)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(10, 30),
                             ignore_eos=True) for i in range(8)]
    want = tokens(ref.generate(batch, params))
    llm = tiny_pool(dsv32_path, hot_policy="score")
    assert tokens(llm.generate(batch, params)) == want
    assert llm.stats()["host_read_switches"] > 0
