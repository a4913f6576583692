"""The vectorised sampler against a plain per-row PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch

from hisparse.engine.sampling import (
    SamplingParams,
    SamplingTensors,
    counter_uniform,
    filter_mask,
    sample,
    sample_tensor,
)


def reference_keep(row: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row reference (the old per-row sampler): tokens that survive top-k and top-p, and
    the distribution one token is drawn from."""
    x = row.float() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        keep &= x >= kth
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep_p = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep &= torch.zeros_like(keep).scatter(0, order, keep_p)
    probs = probs * keep
    return keep, probs / probs.sum()


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return reference_keep(row, p)[1]


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
          SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=3),
          SamplingParams(top_k=1, seed=4), SamplingParams(top_p=1e-6, seed=5)]


def test_greedy_is_argmax():
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(0))
    toks = sample(logits, [SamplingParams(temperature=0.0)] * 9)
    assert toks == logits.argmax(-1).tolist()


def test_top_k_top_p_masks_are_exact():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 257, generator=g) * 3
    st = SamplingTensors.build(PARAMS, [0] * len(PARAMS))
    _, keep = filter_mask(logits, st)
    for r, p in enumerate(PARAMS):
        if p.greedy:
            continue
        want = reference_keep(logits[r], p)[0]
        assert torch.equal(keep[r], want), r


def test_seeded_rows_are_reproducible_across_batch_compositions():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 500, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = [sample(row, [p], [i])[0] for i in range(20)]
    for batch in (3, 8):
        others = torch.randn(batch - 1, 500, generator=g)
        for pos in (0, batch - 1):
            logits = torch.cat([others[:pos], row, others[pos:]])
            params = [SamplingParams(temperature=0.5)] * (batch - 1)
            params.insert(pos, p)
            got = [sample(logits, params, [i] * batch)[pos] for i in range(20)]
            assert got == alone
    assert len(set(alone)) > 1                       # the counter advances the stream
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=1235)
    assert [sample(row, [other_seed], [i])[0] for i in range(20)] != alone


def test_unseeded_rows_use_the_global_generator():
    logits = torch.randn(4, 100)
    params = [SamplingParams()] * 4
    torch.manual_seed(7)
    a = sample(logits, params)
    torch.manual_seed(7)
    assert sample(logits, params) == a


@pytest.mark.parametrize("p", PARAMS[1:5], ids=lambda p: f"t{p.temperature}k{p.top_k}p{p.top_p}")
def test_sample_distribution_matches_the_reference(p):
    torch.manual_seed(0)
    vocab, n = 12, 40000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    want = reference_probs(row, p)
    # Seeded draws over many seeds (counter RNG) and unseeded draws (global generator).
    for seeded in (True, False):
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 seed=i if seeded else None) for i in range(n)]
        toks = torch.tensor(sample(row.expand(n, vocab).contiguous(), params))
        freq = torch.bincount(toks, minlength=vocab).float() / n
        assert (freq[want == 0] == 0).all()
        tol = 4 * torch.sqrt(want * (1 - want) / n) + 1e-3
        assert ((freq - want).abs() <= tol).all(), (freq, want)


def test_counter_uniforms_are_uniform_and_keyed():
    seeds = torch.tensor([0, 1, -1, 2**62 + 5, 0])
    steps = torch.tensor([0, 0, 0, 3, 1])
    u = counter_uniform(seeds, steps, 50000)
    assert u.min() > 0 and u.max() < 1
    assert torch.allclose(u.mean(1), torch.full((5,), 0.5), atol=0.01)
    assert torch.allclose(u.var(1), torch.full((5,), 1 / 12), atol=0.003)
    # Every key gives a different stream (seed and step both matter).
    for a in range(5):
        for b in range(a + 1, 5):
            assert not torch.equal(u[a], u[b])
    # Values for one (seed, step) do not depend on the batch.
    assert torch.equal(counter_uniform(seeds[3:4], steps[3:4], 50000)[0], u[3])


def test_non_finite_rows_are_flagged_without_affecting_others():
    logits = torch.randn(3, 64)
    logits[1, 5] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(seed=2)]
    toks = sample(logits, params, [0, 0, 0])
    assert toks[1] == -1 and toks[0] == int(logits[0].argmax())
    assert toks[2] == sample(logits[2:], params[2:], [0])[0]


def test_sample_tensor_stays_on_the_device():
    logits = torch.randn(2, 32)
    st = SamplingTensors.build([SamplingParams(seed=1), SamplingParams()], [0, 0])
    out = sample_tensor(logits, st)
    assert out.dtype == torch.int64 and out.shape == (2,) and out.device == logits.device


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_p=1.1), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(top_k=True), "top_k"), (dict(seed=1.0), "seed"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids="12"), "stop_token_ids"), (dict(stop_token_ids=[1.0]),
                                                    "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_sampling_params_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_normalise_types():
    p = SamplingParams(temperature=1, top_p=1, stop_token_ids=(3, 4), seed=2**64 - 1)
    assert isinstance(p.temperature, float) and p.stop_token_ids == [3, 4]
    assert sample(torch.randn(1, 10), [p], [0])[0] in range(10)
