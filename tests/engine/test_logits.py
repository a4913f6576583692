"""Logits processors (penalties, logit bias, min_tokens, bad words, min-p): the vectorised
device pass against a plain per-request reference, and their effect in the engine in every
loop (sync, overlapped, preempted and resumed, speculative)."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import LLM, SamplingParams
from hisparse.engine.logits import LogitsState
from hisparse.engine.sampling import SamplingTensors, StructuredOutputsParams, filter_mask

V = 97
EOS = frozenset({1})


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
              out: list[int]) -> torch.Tensor:
    """One request's processed logits, written the obvious way (vLLM's definitions)."""
    x = logits.clone()
    for w in p.bad_words_token_ids or ():
        if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else EOS):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        if x[t] > 0:
            x[t] /= p.repetition_penalty
        else:
            x[t] *= p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.6:
        kw.update(repetition_penalty=rng.choice([0.7, 1.0, 1.3]),
                  frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2))
    if rng.random() < 0.5:
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randrange(0, 12)
        kw["stop_token_ids"] = [rng.randrange(V)]
        kw["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.6:
        kw["bad_words_token_ids"] = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))]
                                     for _ in range(3)]
    return SamplingParams(max_tokens=32, **kw)


class Handle:
    """A stand-in KV handle (the state keys its rows by handle identity)."""


@pytest.mark.parametrize("k", [0, 2])
def test_vectorised_processors_match_the_reference(k):
    """Random requests over several steps (state rebuilt on a new handle, updated on the
    device in between), with ``k`` speculative drafts per row: every processed row equals the
    per-request reference on the request's history plus the drafts before the row."""
    rng = random.Random(k)
    g = torch.Generator().manual_seed(k)
    R = 6
    state = LogitsState(R, V, torch.device("cpu"))
    reqs = []
    for slot in range(R):
        # small alphabet for outputs: bad-word prefixes and repeats actually occur
        reqs.append(dict(p=random_params(rng), slot=slot, handle=Handle(),
                         prompt=[rng.randrange(V) for _ in range(rng.randrange(1, 8))],
                         out=[rng.randrange(4) for _ in range(rng.randrange(0, 6))]))
    for step in range(6):
        if step == 3:     # one request is "preempted and resumed": a new handle, rebuilt
            reqs[2]["handle"] = Handle()
        drafts = [[rng.randrange(4) for _ in range(rng.randrange(0, k + 1))] for _ in reqs]
        rows = sum(len(d) + 1 for d in drafts)
        logits = torch.randn(rows, V, generator=g) * 3
        batch = state.prepare([r["p"] for r in reqs], [r["handle"] for r in reqs],
                              [r["slot"] for r in reqs],
                              lambda i: (reqs[i]["prompt"] + reqs[i]["out"],
                                         len(reqs[i]["prompt"])),
                              [len(r["out"]) for r in reqs], EOS, drafts if k else None)
        got = state.apply(batch, logits.clone())
        row = 0
        for r, d in zip(reqs, drafts):
            for j in range(len(d) + 1):
                want = reference(logits[row], r["p"], r["prompt"], r["out"] + d[:j])
                torch.testing.assert_close(got[row], want, msg=f"step {step} row {row}")
                row += 1
        new = [[rng.randrange(4) for _ in range(1 + (rng.randrange(k + 1) if k else 0))]
               for _ in reqs]
        if k:
            state.record_spec([r["slot"] for r in reqs], new, [r["p"] for r in reqs])
        else:
            state.record(batch, torch.tensor([t[0] for t in new]))
        for r, t in zip(reqs, new):
            r["out"] += t


def test_min_p_keeps_tokens_above_min_p_times_the_top_probability():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 200, generator=g) * 2
    params = [SamplingParams(temperature=t, min_p=m, seed=1)
              for t, m in [(1.0, 0.1), (0.5, 0.3), (2.0, 0.05), (1.0, 0.0), (1.0, 1.0)]]
    _, keep = filter_mask(logits, SamplingTensors.build(params, [0] * 5))
    for r, p in enumerate(params):
        probs = torch.softmax(logits[r] / p.temperature, dim=-1)
        want = probs >= p.min_p * probs.max()
        assert torch.equal(keep[r], want), r
    assert keep[4].sum() == 1 and keep[3].all()


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={3: 101}), r"logit_bias\[3\]"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1] * 40]), "bad_words_token_ids"),
    (dict(structured_outputs={"json": {}}), "structured_outputs"),
])
def test_new_fields_name_the_field_and_limit(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_structured_outputs_needs_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


# ---------------------------------------------------------------------- in the engine
BASE = dict(device="cpu", dtype="float32", block_size=8, max_model_len=160, max_num_seqs=4,
            host_pool_gib=0.02, max_num_batched_tokens=64)
PROMPT = [{"prompt_token_ids": [5, 9, 14, 3, 77, 21]}]


def run(llm, **kw):
    p = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24),
                       ignore_eos=kw.pop("ignore_eos", True), **kw)
    return llm.generate(PROMPT, p)[0].outputs[0]


@pytest.fixture(scope="module")
def llm(dsv32_path):
    return LLM(dsv32_path, **BASE)


def test_each_field_changes_greedy_output_as_defined(llm):
    base = run(llm).token_ids
    assert run(llm, logit_bias={42: 100.0}).token_ids == [42] * 24
    # a repetitive run (a biased token wins) that penalties break up
    rep = run(llm, logit_bias={42: 6.0}).token_ids
    assert rep.count(42) >= 20
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
               dict(repetition_penalty=8.0)):
        out = run(llm, logit_bias={42: 6.0}, **kw).token_ids
        assert out[0] == 42 and out.count(42) < rep.count(42), kw
    # EOS forced by bias: out at once, unless min_tokens holds it back
    eos = run(llm, logit_bias={1: 100.0}, ignore_eos=False)
    assert eos.token_ids == [1] and eos.finish_reason == "stop"
    late = run(llm, logit_bias={1: 100.0}, ignore_eos=False, min_tokens=5)
    assert late.token_ids[:5] != [1] * 5 and 1 not in late.token_ids[:5]
    assert late.token_ids[5] == 1 and late.finish_reason == "stop"
    # bad words: a single token never appears; a pair never appears in sequence
    out = run(llm, bad_words_token_ids=[[base[0]]]).token_ids
    assert base[0] not in out
    pair = base[3:5]
    out = run(llm, bad_words_token_ids=[pair]).token_ids
    assert out[:4] == base[:4] and out[4] != base[4]
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))


def test_logit_bias_and_bad_word_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"logit_bias: token id 384"):
        run(llm, logit_bias={384: 1.0})
    with pytest.raises(ValueError, match="bad_words_token_ids: token id 999"):
        run(llm, bad_words_token_ids=[[3, 999]])
    with pytest.raises(ValueError, match="bad_words: needs a tokenizer"):
        run(llm, bad_words=["x"])
    with pytest.raises(ValueError, match="structured_outputs: structured output needs a "
                                         "tokenizer"):
        run(llm, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_min_p_with_a_seed_is_reproducible_and_filters(llm):
    kw = dict(temperature=1.5, seed=7, max_tokens=24, ignore_eos=True)
    a = llm.generate(PROMPT, SamplingParams(min_p=0.5, **kw))[0].outputs[0].token_ids
    b = llm.generate(PROMPT, SamplingParams(min_p=0.5, **kw))[0].outputs[0].token_ids
    free = llm.generate(PROMPT, SamplingParams(**kw))[0].outputs[0].token_ids
    one = llm.generate(PROMPT, SamplingParams(min_p=1.0, **kw))[0].outputs[0].token_ids
    greedy = run(llm).token_ids
    assert a == b and a != free
    assert one == greedy           # min_p = 1 keeps only the top token


PENALIZED = [dict(frequency_penalty=1.5, logit_bias={42: 5.0}),
             dict(repetition_penalty=3.0, presence_penalty=0.5, logit_bias={42: 5.0}),
             dict(bad_words_token_ids=[[42, 42]], logit_bias={42: 5.0}, min_tokens=3)]


def penalized_batch():
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]}
               for n in (40, 70, 100, 55, 90, 120)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             **PENALIZED[i % 3]) for i in range(len(prompts))]
    return prompts, params


def test_penalties_equal_in_sync_async_and_under_preemption(dsv32_path):
    """The device token state is right in the overlapped loop (the host lags a token) and
    after preemption (rebuilt from the host's lists on resumption)."""
    prompts, params = penalized_batch()
    outs = {}
    for name, kw in [("sync", dict(async_scheduling=False)), ("async", {}),
                     ("tiny", dict(num_gpu_blocks=24, hot_buffer_size=32))]:
        llm = LLM(dsv32_path, **{**BASE, "max_num_seqs": 6, **kw})
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name == "tiny":
            assert llm.stats()["num_preempted"] > 0
    assert outs["async"] == outs["sync"] == outs["tiny"]
    assert any(o.count(42) for o in outs["sync"])


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    from hisparse.models.random_checkpoint import make_random_checkpoint
    return make_random_checkpoint(tmp_path_factory.mktemp("mtp_pen"), "deepseek_v32", seed=11,
                                  index_topk=16, num_hidden_layers=3,
                                  num_nextn_predict_layers=1)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_with_penalties_equals_k0(mtp_path, k):
    """Greedy with penalties, bias, bad words and min_tokens: the verify step processes each
    draft position with the drafts before it, so outputs equal k = 0 token for token (drafts
    from the known k = 0 output, most right: many accepted)."""
    prompts, params = penalized_batch()
    kw = dict(BASE, max_num_seqs=6, hot_buffer_size=(k + 1) * 16)
    ref = [o.outputs[0].token_ids for o in LLM(mtp_path, **kw).generate(prompts, params)]
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref)}
    rng = random.Random(k)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            want = refs[tuple(req.prompt_token_ids)][req.num_output_tokens + len(out):]
            want = want[:len(dr)]
            new.append([t if rng.random() < 0.8 else 42 for t in want] + dr[len(want):])
        return new

    llm = LLM(mtp_path, num_speculative_tokens=k, **kw)
    llm.core.draft_hook = hook
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.stats()["spec_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="structured_outputs: not supported with "
                                         "num_speculative_tokens"):
        llm.generate(PROMPT, SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a")))
