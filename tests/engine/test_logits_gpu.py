"""Logits processors and structured output on CUDA: with CUDA-graph decode and the overlapped
loop, a mixed batch (penalties, bias, bad words, min_tokens, a JSON schema, a regex, plain
rows) gives the tokens of an eager synchronous run; speculative decoding with penalties
replays its graphs and equals k = 0."""

import importlib.util
import json
import random
import re

import pytest
from byte_tokenizer import write_byte_tokenizer

from hisparse import LLM, SamplingParams
from hisparse.engine.sampling import StructuredOutputsParams
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

pytestmark = pytest.mark.gpu
# without xgrammar (an offline GPU box) the constrained rows are left out
HAVE_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def checkpoint(tmp_path_factory, name, seed, **overrides):
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp(name), "deepseek_v32", seed=seed,
                                  hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128,
                                  first_k_dense_replace=100, **geo, **overrides)


def mixed_batch(n=8):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(80, 300))]}
               for _ in range(n)]
    kinds = [dict(frequency_penalty=1.5, logit_bias={42: 4.0}),
             dict(repetition_penalty=2.0, presence_penalty=0.5),
             dict(bad_words_token_ids=[[42, 42], [7]], logit_bias={42: 4.0}, min_tokens=5),
             dict(structured_outputs=StructuredOutputsParams(json=SCHEMA)),
             dict(structured_outputs=StructuredOutputsParams(regex=r"[a-f]{4}-[0-9]{3}")),
             {}]
    if not HAVE_XGRAMMAR:
        kinds[3] = kinds[4] = {}
    params = [SamplingParams(temperature=0.0, max_tokens=60, **kinds[i % len(kinds)])
              for i in range(n)]
    return prompts, params, kinds


def test_mixed_processors_graphs_and_async_equal_eager(tmp_path_factory):
    path = checkpoint(tmp_path_factory, "gpu_logits", 5, num_hidden_layers=2)
    write_byte_tokenizer(path)
    prompts, params, kinds = mixed_batch()
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=512, mode="gpu-only")
    eager = LLM(path, enforce_eager=True, async_scheduling=False, **common)
    want = [o.outputs[0] for o in eager.generate(prompts, params)]
    llm = LLM(path, **common)
    assert llm.runner.graphs is not None
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for i, o in enumerate(got):
        if i % len(kinds) == 3 and HAVE_XGRAMMAR:
            obj = json.loads(o.text)
            assert set(obj) == {"ok", "color"} and obj["color"] in ("red", "green")
        if i % len(kinds) == 4 and HAVE_XGRAMMAR:
            assert re.fullmatch(r"[a-f]{4}-[0-9]{3}", o.text)


def test_speculative_with_penalties_equals_k0_with_graphs(tmp_path_factory):
    path = checkpoint(tmp_path_factory, "gpu_logits_mtp", 6, num_hidden_layers=2,
                      num_nextn_predict_layers=1)
    prompts, params, kinds = mixed_batch(6)
    params = [p for p, i in zip(params, range(6)) if i % len(kinds) not in (3, 4)]
    prompts = prompts[:len(params)]
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=512, mode="gpu-only")
    ref = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, params)]
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref)}

    def hook(reqs, outs, drafts):
        return [(refs[tuple(r.prompt_token_ids)][r.num_output_tokens + len(o):] + d)[:len(d)]
                for r, o, d in zip(reqs, outs, drafts)]

    llm = LLM(path, num_speculative_tokens=2, **common)
    llm.core.draft_hook = hook
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.stats()["spec_accepted_tokens"] > 0
