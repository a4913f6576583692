"""Issue 9: one bad request must not break the engine; every user error is a clear ValueError
raised before anything is queued or loaded; start-up faults name the knob to change."""

from __future__ import annotations

import json
import math
import random
import shutil
import warnings

import pytest
import torch

import hisparse.engine.sampling as sampling_mod
import hisparse.engine.startup as startup_mod
from hisparse import LLM, SamplingParams
from hisparse.cli import main as cli_main
from hisparse.config import Mode
from hisparse.engine.llm import EngineDeadError, EngineStartupError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VOCAB = 384


def prompt(n, seed):
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(n)]}


def small(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=96, max_num_seqs=4,
                num_gpu_blocks=40, hot_buffer_size=32, host_pool_gib=0.01,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, **base)


def assert_pools_full(llm):
    s = llm.stats()
    cfg = llm.kv_config
    assert s["free_gpu_blocks"] == cfg.num_gpu_blocks
    assert s["free_indexer_blocks"] == cfg.num_indexer_blocks
    if cfg.uses_host:
        assert s["free_host_blocks"] == cfg.num_host_blocks


@pytest.fixture(scope="module")
def engine(dsv32_path):
    return small(dsv32_path)


# ---------------------------------------------------------------- 1. failing requests
@pytest.mark.parametrize("kw", [dict(temperature=float("nan")), dict(temperature=math.inf),
                                dict(top_p=float("nan")), dict(top_k=2.5),
                                dict(max_tokens=2.5), dict(max_tokens=True)])
def test_bad_sampling_values_are_rejected_up_front(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_a_failing_sampler_row_finishes_that_request_with_an_error(engine, monkeypatch):
    real = sampling_mod.sample_tensor

    def flaky(logits, st, finite=None):
        if bool((st.seeded & (st.seeds == 666)).any()):
            raise RuntimeError("probability tensor contains nan")
        return real(logits, st, finite)

    good, bad = prompt(20, 1), prompt(25, 2)
    want = engine.generate([good], GREEDY)[0].outputs[0].token_ids
    monkeypatch.setattr(sampling_mod, "sample_tensor", flaky)
    outs = engine.generate([good, bad], [GREEDY, SamplingParams(seed=666, max_tokens=6)])
    assert outs[0].outputs[0].token_ids == want and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error"
    assert "contains nan" in outs[1].outputs[0].error
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_pools_full(engine)


def test_non_finite_logits_fail_only_their_request(engine, monkeypatch):
    victim = {}
    real = engine.runner.execute

    def poisoned(plan, input_ids):
        logits, acks = real(plan, input_ids)
        logits = logits.clone()
        rows = [s.req_id for s in plan.seqs if s.sample]
        if victim.get("id") in rows:
            logits[rows.index(victim["id"])] = float("nan")
        return logits, acks

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    ok = engine.add_request(prompt(12, 3), GREEDY)
    victim["id"] = engine.add_request(prompt(14, 4), GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[ok].outputs[0].finish_reason == "length"
    assert outs[victim["id"]].outputs[0].finish_reason == "error"
    assert "non-finite" in outs[victim["id"]].outputs[0].error
    assert_pools_full(engine)


def test_a_detokenizer_error_fails_only_that_request(dsv32_path):
    class Tok:
        def encode(self, text):
            return [int(w) for w in text.split()]

        def decode(self, ids, skip_special_tokens=True):
            if 7 in ids[:1]:
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")
            return " ".join(map(str, ids))

    llm = small(dsv32_path)
    llm.tokenizer = Tok()
    outs = llm.generate(["5 6 7 8", "9 10 11"], SamplingParams(temperature=0.0, max_tokens=3,
                                                               ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert all(o.outputs[0].finish_reason in ("length", "error") for o in outs)
    assert all((o.outputs[0].error is None) == (o.outputs[0].text is not None) for o in outs)


def test_a_streamed_detokenizer_error_finishes_that_request(dsv32_path):
    """Streaming: the request whose text cannot be decoded finishes with an error at once (it
    would fail again every step); the other one runs to its length."""
    class Tok:
        failed = False

        def encode(self, text):
            return [int(w) for w in text.split()]

        def decode(self, ids, skip_special_tokens=True):
            if len(ids) == 2 and not Tok.failed:
                Tok.failed = True
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")
            return " ".join(map(str, ids))

    llm = small(dsv32_path)
    llm.tokenizer = Tok()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [llm.add_request("5 6 7 8", sp), llm.add_request("9 10 11", sp)]
    last = {}
    for _ in range(100):
        for out in llm.step():
            last[out.request_id] = out
        if not llm.has_unfinished_requests():
            break
    reasons = sorted(last[i].outputs[0].finish_reason for i in ids)
    assert reasons == ["error", "length"] and all(last[i].finished for i in ids)
    bad = next(last[i] for i in ids if last[i].outputs[0].finish_reason == "error")
    assert "detokenizing failed" in bad.outputs[0].error
    assert len(bad.outputs[0].token_ids) == 2        # stopped at the step that failed
    assert llm.stats()["free_gpu_blocks"] == llm.kv_config.num_gpu_blocks


def test_an_engine_wide_fault_stops_the_engine_with_a_clear_error(dsv32_path, monkeypatch):
    llm = small(dsv32_path)
    monkeypatch.setattr(llm.runner, "execute",
                        lambda plan, ids: (_ for _ in ()).throw(RuntimeError("device lost")))
    llm.add_request(prompt(10, 5), GREEDY)
    with pytest.raises(EngineDeadError, match="device lost"):
        llm.step()
    for _ in range(2):   # not "engine is stuck" forever: the same clear error
        with pytest.raises(EngineDeadError, match="device lost"):
            llm.step()
    with pytest.raises(EngineDeadError):
        llm.generate([prompt(5, 6)], GREEDY)


# ---------------------------------------------------------------- 2. half-registered requests
def test_bad_seed_is_rejected_and_nothing_is_queued(engine):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed="x")
    params = SamplingParams(max_tokens=3)
    params.seed = "x"                       # mutated after construction
    with pytest.raises(ValueError, match="seed"):
        engine.add_request(prompt(5, 7), params, request_id="mine")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.add_request(prompt(5, 7), GREEDY, request_id="mine") == "mine"
    while engine.has_unfinished_requests():
        engine.step()


# ---------------------------------------------------------------- 3. id collisions
def test_generate_never_collides_with_caller_ids_nor_leaves_part_of_a_batch(engine):
    mine = engine.add_request(prompt(8, 8), GREEDY, request_id="req-1")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt(8, 8), GREEDY, request_id="req-1")
    outs = engine.generate([prompt(9, 9), prompt(10, 10)], GREEDY)
    assert "req-1" not in [o.request_id for o in outs] and len(outs) == 2
    later = engine.step()   # the caller's request (finished during generate) comes back
    while engine.has_unfinished_requests():
        later += engine.step()
    assert [o.request_id for o in later if o.finished] == [mine]
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(prompt(8, 8), GREEDY, request_id="")
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate([prompt(9, 9), {"prompt_token_ids": [1.5]}], GREEDY)
    assert not engine.has_unfinished_requests()   # nothing of that batch was queued


# ---------------------------------------------------------------- 4. clear errors
def test_stop_ids_and_token_ids_are_checked(engine):
    with pytest.raises(ValueError, match=r"stop_token_ids.*389.*\[0, 384\)"):
        engine.add_request(prompt(5, 1), SamplingParams(stop_token_ids=[VOCAB + 5]))
    with pytest.raises(ValueError, match="stop_token_ids entries must be integers >= 0"):
        SamplingParams(stop_token_ids=[3, -1])
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    with pytest.raises(ValueError, match="token id 1.5 is not an integer"):
        engine.add_request({"prompt_token_ids": [3, 1.5]}, GREEDY)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        engine.add_request(prompt(5, 1), {"temperature": 0})
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kw, match", [
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 2"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens"),
    (dict(num_gpu_blocks=-1), "num_gpu_blocks must be an integer"),
    (dict(host_pool_gib=1e-7), r"host_pool_gib \(1e-07\) holds 0 blocks"),
    (dict(host_pool_gib=float("nan")), "host_pool_gib must be a number"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(mode="fast"), "mode must be one of"),
    (dict(device="tpu"), "device must be"),
])
def test_engine_arguments_name_the_field_and_limit(dsv32_path, kw, match):
    with pytest.raises(ValueError, match=match):
        small(dsv32_path, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda_is_a_value_error(dsv32_path):
    with pytest.raises(ValueError, match="CUDA is not available"):
        small(dsv32_path, device="cuda")


def test_config_is_validated_before_any_weight_is_loaded(dsv32_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights loaded before the config was validated")

    monkeypatch.setattr(startup_mod, "load_model", boom)
    with pytest.raises(ValueError, match="hot_buffer_size must be >= index_topk"):
        small(dsv32_path, hot_buffer_size=8)
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= "):
        small(dsv32_path, num_gpu_blocks=3)


def test_malformed_config_json_names_the_file(dsv32_path, tmp_path):
    bad = tmp_path / "broken"
    shutil.copytree(dsv32_path, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken/config.json.*JSON"):
        LLM(str(bad), device="cpu")
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        LLM(str(tmp_path / "missing"), device="cpu")


def test_cli_user_errors_are_one_line_with_exit_status_2(dsv32_path, capsys):
    assert cli_main(["demo", "--prompts", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --prompts must be >= 1, got 0"
    assert cli_main(["generate", "--model", dsv32_path, "--prompt-ids", "5,6", "--device",
                     "cpu", "--block-size", "12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: block_size must be a power of two, got 12"]
    assert cli_main(["generate", "--model", dsv32_path, "--prompt-ids", "5,x"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_cli_mode_flag_and_deprecated_hisparse_alias(dsv32_path, capsys):
    common = ["generate", "--model", dsv32_path, "--prompt-ids", "5,6,7", "--max-tokens", "2",
              "--device", "cpu", "--dtype", "float32", "--block-size", "8",
              "--host-pool-gib", "0.01", "--max-model-len", "64"]
    assert cli_main(common + ["--mode", "always-host"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mode"] == "always-host"
    assert cli_main(common + ["--hisparse", "off"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["mode"] == "gpu-only"
    assert "deprecated" in cap.err


# ---------------------------------------------------------------- 5. valid configurations
def test_small_valid_configurations_are_accepted(dsv32_path):
    llm = LLM(dsv32_path, device="cpu", dtype="float32", block_size=8, max_model_len=128,
              max_num_seqs=4, host_pool_gib=0.01)
    assert llm.kv_config.chunk_pages == 16
    out = llm.generate([prompt(30, 11)], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 6
    llm = LLM(dsv32_path, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=1,
              host_pool_gib=0.01)
    assert llm.kv_config.num_gpu_blocks >= llm.kv_config.min_gpu_blocks
    assert len(llm.generate([prompt(30, 12)], GREEDY)[0].outputs[0].token_ids) == 6


def test_mode_keyword_and_deprecated_hisparse_keyword(dsv32_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert small(dsv32_path, mode="gpu-only").kv_config.mode is Mode.GPU_ONLY
        assert small(dsv32_path, mode=Mode.ALWAYS_HOST).kv_config.mode is Mode.ALWAYS_HOST
    with pytest.warns(DeprecationWarning, match="mode="):
        assert small(dsv32_path, hisparse=False).kv_config.mode is Mode.GPU_ONLY
    with pytest.warns(DeprecationWarning):
        assert small(dsv32_path, hisparse="always-host").kv_config.mode is Mode.ALWAYS_HOST
    with pytest.raises(ValueError, match="mode=... only"):
        small(dsv32_path, hisparse=True, mode="hisparse")


# ---------------------------------------------------------------- start-up faults
def test_host_pool_allocation_failure_names_host_pool_gib(dsv32_path, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(startup_mod, "KVCaches", fail)
    with pytest.raises(EngineStartupError, match=r"host_pool_gib=0.01.*GiB host memory "
                                                 r"available: lower host_pool_gib"):
        small(dsv32_path)


def test_gpu_oom_at_start_up_names_the_pool_to_shrink(dsv32_path, monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(startup_mod, "KVCaches", oom)
    with pytest.raises(EngineStartupError, match="num_gpu_blocks=40.*lower num_gpu_blocks"):
        small(dsv32_path)


def test_weights_oom_names_the_model_size(dsv32_path, monkeypatch):
    """Loading weights that do not fit: the model's size (parameters and buffers, counted on
    the meta device) and what to change, not torch's allocator message."""
    from hisparse.models.loader import load_model, model_bytes

    real, cfg = load_model(dsv32_path, dtype="float32")
    assert model_bytes(cfg, "float32") == sum(t.numel() * t.element_size() for t in
                                              (*real.parameters(), *real.buffers()))

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(startup_mod, "load_model", oom)
    size = model_bytes(cfg, "float32") / (1 << 30)
    assert size > 0
    with pytest.raises(EngineStartupError, match=rf"loading the weights on cpu: the model is "
                                                 rf"{size:.1f} GiB \({cfg.num_layers} layers.*"
                                                 r"--layers N"):
        small(dsv32_path)


# ---------------------------------------------------------------- 6. idle engine, release
def test_idle_step_returns_nothing_and_generate_releases_every_block(dsv32_path):
    llm = small(dsv32_path)
    assert llm.step() == [] and llm.step() == []
    outs = llm.generate([prompt(40, 13), prompt(50, 14)], GREEDY)
    assert all(o.outputs[0].error is None for o in outs)
    assert_pools_full(llm)
    assert llm.step() == []
