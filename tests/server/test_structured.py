"""Sampling fields and structured output through the OpenAI-compatible server, driven with
the official ``openai`` client against a real uvicorn server. The checkpoint has random
weights and a byte-level BPE tokenizer (every string is expressible), so only the grammar
makes the output parse."""

from __future__ import annotations

import concurrent.futures
import json
import re

import openai
import pytest
from byte_tokenizer import write_byte_tokenizer

from hisparse import LLM, SamplingParams
from hisparse.engine.async_engine import AsyncLLM
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.server.app import ServerThread, create_app

pytest.importorskip("xgrammar")

BASE = dict(device="cpu", dtype="float32", block_size=8, max_model_len=320, max_num_seqs=4,
            host_pool_gib=0.02, max_num_batched_tokens=64)
PROMPT = [7, 30, 55, 91, 120, 4, 66]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("bytes"), "deepseek_v32", seed=17,
                                  index_topk=16, num_hidden_layers=2)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def srv(byte_model):
    llm = LLM(byte_model, **BASE)
    engine = AsyncLLM(llm, max_waiting_requests=16, log_interval=0)
    http = ServerThread(create_app(engine, model_name="tiny")).start()
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0)
    yield client
    http.stop()
    engine.shutdown()


def complete(client, max_tokens=24, temperature=0.0, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=temperature, **kw).choices[0]


def ids(choice):
    return choice.model_extra["token_ids"]


def test_sampling_fields_change_the_output_as_defined(srv, byte_model):
    kw = dict(extra_body={"return_token_ids": True, "ignore_eos": True})
    assert ids(complete(srv, logit_bias={"42": 100}, **kw)) == [42] * 24
    # the smallest bias that makes a fully repetitive greedy run: every penalty breaks it
    bias = next(b for b in range(1, 30)
                if ids(complete(srv, logit_bias={"42": b}, **kw)) == [42] * 24)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 8.0}}):
        body = {**kw["extra_body"], **extra.pop("extra_body", {})}
        out = ids(complete(srv, logit_bias={"42": bias}, extra_body=body, **extra))
        assert out[0] == 42 and out.count(42) < 24, extra
    # bad words (strings, tokenized by the server: one byte token per character here): "a"
    # forced by bias, "aa" banned, so every other character is something else
    from transformers import AutoTokenizer
    a = AutoTokenizer.from_pretrained(byte_model).convert_tokens_to_ids("a")
    assert complete(srv, logit_bias={str(a): 100}).text == "a" * 24
    out = ids(complete(srv, logit_bias={str(a): 100},
                       extra_body={"bad_words": ["aa"], "return_token_ids": True}))
    assert out[::2] == [a] * 12 and a not in out[1::2]
    # EOS forced by bias ends at once; min_tokens holds it back
    eos = complete(srv, logit_bias={"1": 100}, extra_body={"return_token_ids": True})
    assert ids(eos) == [1] and eos.finish_reason == "stop"
    late = complete(srv, logit_bias={"1": 100},
                    extra_body={"return_token_ids": True, "min_tokens": 4})
    assert len(ids(late)) == 5 and ids(late)[4] == 1 and late.finish_reason == "stop"
    # min_p with a seed: reproducible; min_p = 1 is greedy
    seeded = dict(temperature=1.5, seed=3, max_tokens=16, prompt=PROMPT, model="tiny")
    a = srv.completions.create(extra_body={"min_p": 0.3}, **seeded).choices[0].text
    assert a == srv.completions.create(extra_body={"min_p": 0.3}, **seeded).choices[0].text
    top = srv.completions.create(extra_body={"min_p": 1.0}, **seeded).choices[0].text
    assert top == complete(srv, max_tokens=16).text


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


def check_schema(obj) -> None:
    assert set(obj) == {"ok", "color", "n"}
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99


def test_response_format_json_schema_parses_against_the_schema(srv):
    for temperature, seed in ((0.0, None), (1.0, 5)):
        r = srv.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "give me json"}],
            max_tokens=200, temperature=temperature, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "thing", "schema": SCHEMA}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        check_schema(json.loads(choice.message.content))


def test_json_object_choice_regex_and_grammar(srv):
    out = complete(srv, max_tokens=250, temperature=0.0,
                   extra_body={"response_format": {"type": "json_object"}})
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    choices = ["alpha", "beta gamma", "d\"elta"]
    for seed in range(3):
        c = srv.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, seed=seed,
                                   extra_body={"guided_choice": choices}).choices[0]
        assert c.text in choices and c.finish_reason == "stop"
    r = complete(srv, max_tokens=40, extra_body={"guided_regex": r"[a-c]{3}-[0-9]{2,4}"})
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", r.text) and r.finish_reason == "stop"
    g = complete(srv, max_tokens=40, extra_body={
        "guided_grammar": 'root ::= "yes" | "no" | ("maybe " [0-9])'})
    assert re.fullmatch(r"yes|no|maybe [0-9]", g.text)
    s = complete(srv, max_tokens=40, extra_body={"structured_outputs": {"choice": ["x", "y"]}})
    assert s.text in ("x", "y")


def test_constrained_requests_batch_with_unconstrained_ones(srv, byte_model):
    """Unconstrained requests running next to constrained ones give exactly their outputs
    alone (the masks touch only the constrained rows)."""
    alone = complete(srv, max_tokens=20).text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(complete, srv, 20) for _ in range(2)]
        futs += [pool.submit(complete, srv, 100, extra_body={"guided_json": SCHEMA}),
                 pool.submit(complete, srv, 20, extra_body={"guided_regex": "[0-9]+"})]
        outs = [f.result() for f in futs]
    assert outs[0].text == outs[1].text == alone
    check_schema(json.loads(outs[2].text))
    assert outs[3].text.isdigit()


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 50}, "min_tokens"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
])
def test_bad_fields_get_400_naming_them(srv, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(srv, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert complete(srv, max_tokens=2).text is not None      # still serving


def test_structured_output_without_a_tokenizer_is_a_400(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("notok"), "deepseek_v32", seed=3,
                                  index_topk=16, num_hidden_layers=1)
    engine = AsyncLLM(LLM(path, **BASE), log_interval=0)
    with ServerThread(create_app(engine, model_name="tiny")) as http:
        client = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0)
        for extra, param in (({"response_format": {"type": "json_object"}},
                              "response_format"),
                             ({"guided_regex": "a+"}, "guided_regex"),
                             ({"bad_words": ["a"]}, "bad_words")):
            with pytest.raises(openai.BadRequestError) as e:
                complete(client, extra_body=extra)
            assert e.value.body["param"] == param and "tokenizer" in e.value.body["message"]
    engine.shutdown()


def test_engine_structured_output_matches_the_schema(byte_model):
    """The engine API: SamplingParams(structured_outputs=...) in a batch with free rows."""
    from hisparse.engine.sampling import StructuredOutputsParams

    llm = LLM(byte_model, **BASE)
    p = [{"prompt_token_ids": PROMPT}] * 2
    outs = llm.generate(p, [
        SamplingParams(temperature=0.0, max_tokens=120,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=10)])
    check_schema(json.loads(outs[0].outputs[0].text))
    assert outs[1].outputs[0].text == llm.generate(
        p[:1], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].text
