"""The OpenAI-compatible server end to end: a real uvicorn server on a free port, driven with
the official ``openai`` client; outputs equal ``LLM.generate``."""

import asyncio
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse import LLM, SamplingParams
from hisparse.engine.async_engine import AsyncLLM
from hisparse.server.app import ServerThread, create_app

BASE = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
            host_pool_gib=0.02, max_num_batched_tokens=64)
TINY = dict(BASE, num_gpu_blocks=30, hot_buffer_size=32)       # forces spills (test_engine)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def words(ids):
    return " ".join(f"t{i}" for i in ids)


def rand_prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


class Served:
    def __init__(self, model_dir, max_waiting=64, **kw):
        self.llm = LLM(model_dir, **kw)
        self.engine = AsyncLLM(self.llm, max_waiting_requests=max_waiting, log_interval=0)
        self.app = create_app(self.engine, model_name="tiny")
        self.http = ServerThread(self.app).start()
        self.url = self.http.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.http.stop()
        self.engine.shutdown()

    def wait_idle(self, timeout=20.0):
        """Until nothing is in flight and the engine published its idle stats."""
        kv = self.llm.kv_config
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.snapshot.stats
            if (self.engine.num_unfinished == 0 and s["free_gpu_blocks"] == kv.num_gpu_blocks
                    and s["free_host_blocks"] == kv.num_host_blocks
                    and s["free_indexer_blocks"] == kv.num_indexer_blocks):
                return s
            time.sleep(0.05)
        raise AssertionError(f"pools did not return to full: {self.engine.snapshot.stats}")


@pytest.fixture(scope="module")
def srv(model_dir):
    s = Served(model_dir, **BASE)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(model_dir):
    return LLM(model_dir, **BASE)


def test_health_and_models(srv):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    models = srv.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completions_text_and_token_ids_equal_generate(srv, ref):
    batch = rand_prompts(3, 20, 60, seed=1)
    want = ref.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for p, w in zip(batch, want):
        r = srv.client.completions.create(model="tiny", prompt=words(p), max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
        c = r.choices[0]
        assert c.text == w.outputs[0].text and c.finish_reason == "length"
        assert c.model_extra["token_ids"] == w.outputs[0].token_ids
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 12
    # Token ids in, several prompts in one request (choices in order).
    r = srv.client.completions.create(model="tiny", prompt=batch, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert r.usage.completion_tokens == 36
    # Seeded sampling equals the offline engine's.
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    w = ref.generate([{"prompt_token_ids": batch[0]}], params)[0]
    r = srv.client.completions.create(model="tiny", prompt=batch[0], max_tokens=10,
                                      temperature=0.9, top_p=0.9, seed=7,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == w.outputs[0].text
    # n=2 with a seed: two reproducible samples (seed, seed+1).
    r = srv.client.completions.create(model="tiny", prompt=batch[0], max_tokens=10, n=2,
                                      temperature=0.9, top_p=0.9, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == w.outputs[0].text


def test_chat_and_streaming_equal_generate(srv, ref):
    msgs = [{"role": "user", "content": words(rand_prompts(1, 30, 31, seed=2)[0])}]
    prompt = ref.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = ref.tokenizer.encode(prompt, add_special_tokens=False)
    want = ref.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].text
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = srv.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 6
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    p = rand_prompts(1, 40, 41, seed=3)[0]
    want = ref.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].text
    stream = srv.client.completions.create(model="tiny", prompt=words(p), max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_truncate_and_free(srv, ref):
    p = rand_prompts(1, 25, 26, seed=4)[0]
    full = ref.generate([{"prompt_token_ids": p}], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = full.split(" ")[5]
    want = full[:full.find(stop)]
    for stream in (False, True):
        r = srv.client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                          stop=[stop], stream=stream,
                                          extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == want and reason == "stop"
    srv.wait_idle()


def test_client_disconnect_aborts_and_frees_every_pool(srv):
    body = {"model": "tiny", "prompt": rand_prompts(1, 60, 61, seed=5)[0], "max_tokens": 120,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert srv.engine.num_unfinished == 1
    s = srv.wait_idle()
    assert s["free_gpu_blocks"] == srv.llm.kv_config.num_gpu_blocks
    fams = _metrics(srv)
    assert _value(fams, "hisparse_requests_finished", finished_reason="abort") >= 1


def test_non_streaming_client_disconnect_aborts(srv, monkeypatch):
    """A non-streaming client that gives up: its request is aborted within the disconnect poll
    instead of decoding to max_tokens (each step slowed to >= 50 ms: 120 tokens take >= 6 s;
    the bound leaves room for a loaded CI box)."""
    real = srv.llm.runner.execute

    def slow(*args, **kw):
        time.sleep(0.05)
        return real(*args, **kw)

    monkeypatch.setattr(srv.llm.runner, "execute", slow)
    srv.wait_idle()
    before = _metrics(srv)
    body = {"model": "tiny", "prompt": rand_prompts(1, 60, 61, seed=9)[0], "max_tokens": 120,
            "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    srv.wait_idle(timeout=10)
    assert time.monotonic() - t0 < 4.0          # aborted, not decoded to the end
    after = _metrics(srv)
    assert (_value(after, "hisparse_requests_finished", finished_reason="abort")
            == _value(before, "hisparse_requests_finished", finished_reason="abort") + 1)


def test_logprobs_completions_chat_and_streams(srv, ref):
    """OpenAI logprobs objects carry the engine's values (LLM.generate with the same
    SamplingParams.logprobs); streamed chunks' logprobs concatenate to the non-streamed ones."""
    import math

    p = rand_prompts(1, 30, 31, seed=12)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = ref.generate([{"prompt_token_ids": p}], sp)[0].outputs[0]
    r = srv.client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    got = r.choices[0].logprobs
    assert got.tokens == [ref.tokenizer.decode([t]) for t in want.token_ids]
    assert all(math.isclose(a, e[t], abs_tol=1e-5)
               for a, t, e in zip(got.token_logprobs, want.token_ids, want.logprobs))
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in got.top_logprobs)
    text = r.choices[0].text
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    for token, off in zip(got.tokens, got.text_offset):      # offsets into the text itself
        assert text[off:].lstrip().startswith(token), (text, token, off)
    sampled = srv.client.completions.create(model="tiny", prompt=p, max_tokens=8, seed=3,
                                            temperature=1.5, logprobs=1,
                                            extra_body={"ignore_eos": True}).choices[0]
    for token, lp_, top in zip(sampled.logprobs.tokens, sampled.logprobs.token_logprobs,
                               sampled.logprobs.top_logprobs):
        assert top[token] == lp_ and 1 <= len(top) <= 2    # the top 1, plus the sampled token
    stream = srv.client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                           logprobs=2, stream=True,
                                           extra_body={"ignore_eos": True})
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    # (the second request reuses the first's cached prefix: same values up to rounding)
    flat = [x for s in streamed for x in s.token_logprobs]
    assert len(flat) == 8 and all(math.isclose(a, b, abs_tol=1e-5)
                                  for a, b in zip(flat, got.token_logprobs))
    assert [x for s in streamed for x in s.text_offset] == got.text_offset
    msgs = [{"role": "user", "content": words(p)}]
    chat = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob == max(t.logprob for t in item.top_logprobs)     # greedy: the top
        assert len(item.top_logprobs) == 3 and bytes(item.bytes).decode() == item.token
    plain = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_bad_requests_get_400_naming_the_field(srv):
    good = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    cases = [
        ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"), ({"prompt": [5, 999]}, "prompt"),
        ({"prompt": list(range(2, 202))}, "prompt"), ({"prompt": []}, "prompt"),
        ({"stop_token_ids": [999]}, "stop_token_ids"), ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"prompt": None}, "prompt"), ({"stream_options": {"include_usage": True}},
                                       "stream_options"),
    ]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for patch, field in cases:
            r = c.post("/v1/completions", json={**good, **patch})
            assert r.status_code == 400, (patch, r.text)
            err = r.json()["error"]
            assert err["param"] == field and err["type"] == "invalid_request_error", (patch, err)
            assert err["message"]
            assert c.post("/v1/completions", json=good).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "t5 t6"}],
                "max_tokens": 2}
        for patch, field in [({"messages": []}, "messages"),
                             ({"top_logprobs": 2}, "top_logprobs"),
                             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                             ({"temperature": "hot"}, "temperature")]:
            r = c.post("/v1/chat/completions", json={**chat, **patch})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (patch, r.text)
            assert c.post("/v1/chat/completions", json=chat).status_code == 200
        r = c.post("/v1/completions", json={**good, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = c.post("/v1/completions", content=b"{not json", headers={
            "content-type": "application/json"})
        assert r.status_code == 400
    with pytest.raises(openai.BadRequestError, match="top_p"):
        srv.client.completions.create(model="tiny", prompt=[5, 6], top_p=3)


def test_overload_answers_503_and_recovers(srv):
    saved = srv.engine.max_unfinished
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    srv.engine.max_unfinished = 0          # the queue is full
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={**body, "stream": stream})
                assert r.status_code == 503
                err = r.json()["error"]
                assert "capacity" in err["message"] and err["type"] == "overloaded_error"
            srv.engine.max_unfinished = saved
            assert c.post("/v1/completions", json=body).status_code == 200
    finally:
        srv.engine.max_unfinished = saved
    assert srv.engine.num_unfinished == 0


def _metrics(s):
    text = httpx.get(s.url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, name, suffix="_total", **labels):
    fam = fams[name]
    return sum(x.value for x in fam.samples if x.name == name + suffix
               and all(x.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_move(srv):
    before = _metrics(srv)
    srv.client.completions.create(model="tiny", prompt=rand_prompts(1, 30, 31, seed=6)[0],
                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    bad = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                        "max_tokens": -1})
    assert bad.status_code == 400
    time.sleep(0.6)    # the engine publishes its idle snapshot
    after = _metrics(srv)
    assert (_value(after, "hisparse_requests_finished", finished_reason="length")
            == _value(before, "hisparse_requests_finished", finished_reason="length") + 1)
    assert (_value(after, "hisparse_generation_tokens")
            == _value(before, "hisparse_generation_tokens") + 5)
    assert (_value(after, "hisparse_prompt_tokens")
            == _value(before, "hisparse_prompt_tokens") + 30)
    for h in ("hisparse_time_to_first_token_seconds", "hisparse_e2e_request_latency_seconds",
              "hisparse_time_per_output_token_seconds"):
        assert _value(after, h, "_count") == _value(before, h, "_count") + 1
    assert _value(after, "hisparse_d2h_bytes") > _value(before, "hisparse_d2h_bytes")
    assert (_value(after, "hisparse_requests_rejected", status="400")
            == _value(before, "hisparse_requests_rejected", status="400") + 1)
    for state in ("dirty", "clean", "host_only"):
        assert _value(after, "hisparse_gpu_pages", "", state=state) == 0   # idle
    for name in ("hisparse_hot_buffer_hits", "hisparse_hot_buffer_misses", "hisparse_h2d_bytes",
                 "hisparse_spilled_pages", "hisparse_restored_pages", "hisparse_preemptions",
                 "hisparse_host_read_switches", "hisparse_prefix_hit_tokens",
                 "hisparse_host_blocks_used", "hisparse_copies_in_flight",
                 "hisparse_requests_running", "hisparse_requests_waiting",
                 "hisparse_hot_buffer_demand_misses", "hisparse_hot_buffer_prefetched",
                 "hisparse_staged_rows", "hisparse_staged_bytes", "hisparse_topk_stalls",
                 "hisparse_hot_lru_corrupt_entries"):
        assert name in after, name


def test_32_concurrent_streams_under_a_tiny_gpu_pool(model_dir):
    batch = rand_prompts(32, 20, 100, seed=8)
    lens = [random.Random(i).randrange(4, 24) for i in range(32)]
    unconstrained = LLM(model_dir, **BASE)
    want = [o.outputs[0].text for o in unconstrained.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens])]
    del unconstrained
    s = Served(model_dir, **TINY)
    try:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        pages_seen = []

        async def one(p, n):
            stream = await client.completions.create(
                model="tiny", prompt=p, max_tokens=n, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            parts = []
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                pages_seen.append(dict(s.engine.snapshot.page_states))
            return "".join(parts)

        async def main():
            try:
                return await asyncio.gather(*(one(p, n) for p, n in zip(batch, lens)))
            finally:
                await client.close()

        got = asyncio.run(main())
        assert got == want
        stats = s.wait_idle()
        assert stats["spilled_pages"] > 0 and stats["host_read_switches"] > 0
        assert stats["hot_misses"] > 0
        assert any(p.get("host_only", 0) > 0 for p in pages_seen)
        fams = _metrics(s)
        assert _value(fams, "hisparse_spilled_pages") > 0
        assert _value(fams, "hisparse_requests_finished", finished_reason="length") == 32
    finally:
        s.close()


def test_async_engine_directly_streams_aborts_and_dies_cleanly(srv, ref):
    """AsyncLLM without HTTP: cumulative outputs, abort on close, a dead engine fails fast."""
    from hisparse.engine.llm import EngineDeadError

    p = rand_prompts(1, 30, 31, seed=9)[0]
    want = ref.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids

    async def run():
        outs = [o async for o in srv.engine.generate({"prompt_token_ids": p}, GREEDY)]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
        assert [len(o.outputs[0].token_ids) for o in outs] == sorted(
            len(o.outputs[0].token_ids) for o in outs)
        gen = srv.engine.generate({"prompt_token_ids": p}, SamplingParams(
            temperature=0, max_tokens=150, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()                       # a reader that went away: aborted
        with pytest.raises(ValueError, match="stop_token_ids"):
            async for _ in srv.engine.generate({"prompt_token_ids": p},
                                               SamplingParams(top_k=5, max_tokens=1,
                                                              stop_token_ids=[10**6])):
                pass

    asyncio.run(run())
    srv.wait_idle()
    eng = AsyncLLM(ref, log_interval=0)
    eng.shutdown()

    async def after():
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate({"prompt_token_ids": p}, GREEDY):
                pass

    asyncio.run(after())
