"""The HTTP edge with the official ``openai`` client and raw httpx against a real uvicorn
server: the OpenAI error shape for every status, 413 without echo, the API key, CORS, the
tokenizer endpoints, models.retrieve, max_tokens past the context, refused fields, the access
log; the server keeps serving after every bad request."""

import json
import logging
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse import LLM
from hisparse.engine.async_engine import AsyncLLM
from hisparse.server.app import ServerThread, create_app
from hisparse.server.http import ACCESS_LOG, MAX_ERROR_CHARS

MAX_LEN = 96
ENGINE = dict(device="cpu", dtype="float32", block_size=8, max_model_len=MAX_LEN,
              max_num_seqs=4, host_pool_gib=0.01, max_num_batched_tokens=64)
KEY = "sekrit-123"
ORIGIN = "http://app.example"
LIMIT = 4096
GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


class Server:
    def __init__(self, model_dir, **app_kw):
        self.llm = LLM(model_dir, **ENGINE)
        self.engine = AsyncLLM(self.llm, log_interval=0)
        self.http = ServerThread(create_app(self.engine, model_name="tiny", **app_kw)).start()
        self.url = self.http.url

    def close(self):
        self.http.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def srv(model_dir):
    """An open server (no key, no CORS) with a small body limit."""
    s = Server(model_dir, max_request_bytes=LIMIT)
    yield s
    s.close()


@pytest.fixture(scope="module")
def locked(model_dir):
    s = Server(model_dir, api_key=KEY, allowed_origins=[ORIGIN])
    yield s
    s.close()


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert len(err["message"]) <= MAX_ERROR_CHARS
    assert err["param"] == param, err
    return err


def still_serves(url):
    r = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


def rejected(url):
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return {s.labels["status"]: s.value for s in fams["hisparse_requests_rejected"].samples
            if s.name == "hisparse_requests_rejected_total"}


def test_every_error_status_has_the_openai_shape_and_is_counted(srv):
    before = rejected(srv.url)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert_openai_error(c.get("/v1/nope"), 404)
        assert_openai_error(c.get("/v1/completions"), 405)
        assert_openai_error(c.options("/v1/completions"), 405)     # no CORS configured
        err = assert_openai_error(c.post("/v1/completions", content=b'{"prompt": [5, 6],,}',
                                         headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"] and not any(ch.isdigit() for ch in err["message"])
        assert_openai_error(c.post("/v1/completions", json=[1, 2]), 400)
        err = assert_openai_error(c.post("/v1/completions", json={**GOOD, "model": "other"}),
                                  404, "model")
        assert err["type"] == "not_found_error"
        err = assert_openai_error(c.post("/v1/completions", json={**GOOD, "top_p": "x" * 3000}),
                                  400, "top_p")
        assert "xxx" in err["message"] and len(err["message"]) < 200      # cut, not echoed
    after = rejected(srv.url)
    for status, n in (("404", 2), ("405", 2), ("400", 3)):
        assert after.get(status, 0) == before.get(status, 0) + n, (status, before, after)
    still_serves(srv.url)


def test_oversized_bodies_get_413_without_echo(srv):
    big = b"A" * (LIMIT * 4)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for ctype in ("text/plain", "application/json"):
            r = c.post("/v1/completions", content=big, headers={"content-type": ctype})
            err = assert_openai_error(r, 413)
            assert str(LIMIT) in err["message"] and len(r.content) < 400
        # No Content-Length (chunked): cut while streaming in.
        r = c.post("/v1/completions", content=iter([big[:LIMIT], big[LIMIT:]]),
                   headers={"content-type": "application/json"})
        assert_openai_error(r, 413)
        # A body under the limit that is not JSON: a 400 that does not echo it either.
        r = c.post("/v1/completions", content=b"B" * (LIMIT // 2),
                   headers={"content-type": "text/plain"})
        assert_openai_error(r, 400)
        assert b"BBBB" not in r.content
    still_serves(srv.url)


def test_unimplemented_fields_are_refused_by_name(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    for kw, field in (({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
                      ({"echo": True}, "echo"), ({"extra_body": {"no_such_field": 1}},
                                                 "no_such_field")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, **kw)
        assert e.value.body["param"] == field and field in e.value.body["message"], e.value.body
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "t5 t6"}]
    for kw, field in (({"tools": tools}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **kw)
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:         # unknown fields inside messages
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "t5", "name": "bob"}])
    assert e.value.body["param"] == "messages" and "name" in e.value.body["message"]
    # best_of=1, explicit nulls and neutral values are what not sending them means (vLLM's
    # benchmark client sends repetition_penalty=1.0).
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, best_of=1,
                                  suffix=None, user="u-1", frequency_penalty=0,
                                  extra_body={"repetition_penalty": 1.0})
    assert r.usage.completion_tokens == 2
    # JSON null for every kind of declared field (numbers with defaults included) is absent
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": None,
            "frequency_penalty": None, "repetition_penalty": None, "min_p": None,
            "min_tokens": None, "logit_bias": None, "response_format": None, "n": None}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    still_serves(srv.url)


def test_max_tokens_past_the_context_is_a_400_naming_the_limit(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    prompt = list(range(2, 42))                       # 40 tokens: 56 left of 96
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=57)
    assert e.value.body["param"] == "max_tokens"
    assert str(MAX_LEN) in e.value.body["message"] and "56" in e.value.body["message"]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=56, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 56            # exactly the limit is accepted
    msgs = [{"role": "user", "content": "t5 " * 20}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=90)
    assert e.value.body["param"] == "max_completion_tokens"
    r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_LEN   # default: the rest


def test_tokenize_detokenize_version_and_models_retrieve(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.model_extra["max_model_len"] == MAX_LEN
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["param"] == "model"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/tokenize", json={"model": "tiny", "prompt": "t7 t8 t9",
                                      "return_token_strs": True}).json()
        assert r["tokens"][-3:] == [7, 8, 9] and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == MAX_LEN and r["token_strs"][-3:] == ["t7", "t8", "t9"]
        plain = c.post("/tokenize", json={"prompt": "t7 t8 t9",
                                          "add_special_tokens": False}).json()
        assert plain["tokens"] == [7, 8, 9] and "token_strs" not in plain
        assert c.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {
            "prompt": "t7 t8 t9"}
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "t5"}]})
        assert chat.json()["tokens"] == [2, 5, 3]          # the conftest template: t2 .. t3
        assert_openai_error(c.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
        assert_openai_error(c.post("/tokenize", json={}), 400, "prompt")
        assert_openai_error(c.post("/tokenize", json={"prompt": "t5", "model": "x"}), 404,
                            "model")
        v = c.get("/version").json()
        assert set(v) == {"version"} and v["version"]
    still_serves(srv.url)


def test_api_key_guards_v1_and_cors_preflight(locked):
    url = locked.url
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").status_code == 200                 # open, as in vLLM
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            err = assert_openai_error(c.post("/v1/completions", json=GOOD, headers=headers),
                                      401)
            assert KEY not in err["message"]
        assert_openai_error(c.get("/v1/models"), 401)
        pre = c.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        other = c.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        assert "origin" in assert_openai_error(other, 400)["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.post(url + "/v1/completions", json=GOOD, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    counted = rejected(url)
    assert counted["401"] == 5 and counted["400"] == 1        # the refused preflight too


def test_access_log_line_per_request(srv, caplog):
    log = logging.getLogger(ACCESS_LOG)
    log.addHandler(caplog.handler)       # the hisparse logger does not propagate to root
    try:
        with caplog.at_level(logging.INFO, logger=ACCESS_LOG):
            httpx.post(srv.url + "/v1/completions", json={**GOOD, "max_tokens": 3,
                                                          "ignore_eos": True}, timeout=30)
            httpx.get(srv.url + "/v1/missing", timeout=30)
            deadline = time.monotonic() + 10      # the line is written once the response is sent
            while time.monotonic() < deadline and not all(
                    any(path in r.getMessage() for r in caplog.records)
                    for path in ("/v1/missing", "/v1/completions")):
                time.sleep(0.02)
    finally:
        log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOG]
    ok = [x for x in lines if "POST /v1/completions 200" in x]
    assert ok and "prompt_tokens=3 completion_tokens=3" in ok[-1] and " ms " in ok[-1]
    assert any("GET /v1/missing 404" in x for x in lines)


def test_bench_serve_url_finds_the_model_and_sends_the_key(srv, locked, capsys):
    from hisparse.cli import main

    flags = ["--vocab-size", "384", "--num-prompts", "2", "--input-len", "10",
             "--output-len", "3", "--json"]
    assert main(["bench-serve", "--url", srv.url, *flags]) == 0       # no --served-model-name
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["completed"] == 2 and res["failed"] == 0
    assert main(["bench-serve", "--url", locked.url, "--api-key", KEY, *flags]) == 0
    assert main(["bench-serve", "--url", locked.url, *flags]) == 2      # 401 listing models
    assert "--served-model-name" in capsys.readouterr().err


def test_load_generator_bodies_with_continuous_usage(srv):
    """The bodies guidellm sends (stream_options.continuous_usage_stats, "stop": null,
    ignore_eos, chat content as text parts): accepted, and usage so far rides every chunk."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    bodies = [("/v1/completions", {"model": "tiny", "prompt": "t5 t6 t7", "max_tokens": 6,
                                   "stop": None, "ignore_eos": True, "stream": True,
                                   "stream_options": opts}),
              ("/v1/chat/completions", {"model": "tiny", "max_completion_tokens": 6,
                                        "stop": None, "ignore_eos": True, "stream": True,
                                        "stream_options": opts, "messages": [
                                            {"role": "user", "content": [
                                                {"type": "text", "text": "t5 t6"}]}]})]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for path, body in bodies:
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            used = [ch["usage"]["completion_tokens"] for ch in chunks]
            assert len(used) == len(chunks) and used == sorted(used) and used[-1] == 6, used
            assert len(set(used)) >= 4 and chunks[-1]["choices"] == []
            assert all(ch["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0
                       for ch in chunks)
            plain = {**body, "stream_options": {"include_usage": True}}
            with c.stream("POST", path, json=plain) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert ["usage" in ch for ch in chunks] == [False] * (len(chunks) - 1) + [True]


def test_an_internal_error_is_a_500_in_the_openai_shape(srv, monkeypatch):
    import hisparse.server.app as app_module

    def broken(*args):
        raise ZeroDivisionError("secret detail")

    monkeypatch.setattr(app_module, "completion_prompts", broken)
    err = assert_openai_error(httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30),
                              500)
    assert err["type"] == "server_error" and "secret" not in err["message"]
    monkeypatch.undo()
    still_serves(srv.url)
