"""MTP speculative decoding: draft distributions, exact rejection sampling, statistics.

A speculative step verifies, per decoding request, its last token and ``k`` draft tokens in one
forward (``k + 1`` positions), then runs the MTP layer to draft the next ``k``. Verification is
the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), which keeps
the output distribution exactly the target's: draft ``d_i`` (drawn from ``q_i``) is accepted
with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is drawn from
``norm(max(0, p_i - q_i))``; when every draft is accepted a bonus token is drawn from
``p_{k+1}``. ``p`` and ``q`` are the *filtered* distributions the non-speculative sampler draws
from (temperature, top-k, top-p: :func:`hisparse.engine.sampling.filter_mask`); for a greedy
request both are one-hot argmaxes, so a draft is accepted iff it equals the target's argmax and
the output is token for token the non-speculative greedy output.

Seeded requests draw their uniforms from a generator seeded by ``(seed, output index)``: the
same request gives the same tokens whatever its batch (not the same tokens as the
non-speculative sampler, whose draws differ; the distribution is the same).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hisparse.engine.sampling import SamplingParams, SamplingTensors, filter_mask

_SALT = 0x5EC0DE


def filtered_probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """``[n, vocab]`` fp32: the distribution each row's sampler draws from (one-hot argmax for
    greedy rows). Rows with non-finite logits give NaN rows (the caller fails them)."""
    n, vocab = logits.shape
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=logits.device)
    onehot = torch.zeros(n, vocab, device=logits.device)
    onehot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if bool(greedy.all()):
        return onehot
    st = SamplingTensors.build(params, [0] * n, logits.device)
    x, keep = filter_mask(logits, st)
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.where(greedy[:, None], onehot, probs)


def _generator(params: SamplingParams, index: int, device) -> torch.Generator | None:
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(hash((params.seed, index, _SALT)) & ((1 << 63) - 1))
    return g


def draw(probs: Tensor, gen: torch.Generator | None) -> int:
    """One token from a ``[vocab]`` distribution."""
    return int(torch.multinomial(probs, 1, generator=gen))


def verify(p: Tensor, q: Tensor | None, drafts: list[int], params: SamplingParams,
           out_index: int) -> list[int]:
    """Rejection-sample one request's step: ``p [k + 1, vocab]`` target distributions at the
    verified positions, ``q [k, vocab]`` the drafts' distributions (``None``: one-hot drafts,
    the greedy case), ``drafts`` the ``k`` draft tokens. Returns the accepted drafts followed
    by one corrected or bonus token (``k + 1`` tokens at most); ``[-1]`` if ``p`` is not
    finite. ``out_index``: the output index of the first token (seeds the uniforms)."""
    if not bool(torch.isfinite(p).all()):
        return [-1]
    k = len(drafts)
    if params.greedy:
        return verify_greedy(p.argmax(dim=-1).tolist(), drafts)
    gen = _generator(params, out_index, p.device)
    if q is None:
        q = torch.zeros(k, p.shape[1], device=p.device)
        if k:
            q.scatter_(1, torch.tensor(drafts, device=p.device)[:, None], 1.0)
    d = torch.tensor(drafts, dtype=torch.long, device=p.device)
    if k:
        pd = p[:k].gather(1, d[:, None]).squeeze(1)
        qd = q[:k].gather(1, d[:, None]).squeeze(1)
        u = torch.rand(k, generator=gen, device=p.device)
        ok = (u * qd <= pd).tolist()        # u < p/q without dividing (q(d) > 0: d ~ q)
    else:
        ok = []
    out = []
    for i in range(k):
        if ok[i]:
            out.append(drafts[i])
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if float(residual.sum()) <= 0:      # p == q up to rounding: p itself
            residual = p[i]
        out.append(draw(residual / residual.sum(), gen))
        return out
    out.append(draw(p[k], gen))
    return out


def verify_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification: ``targets`` are the target argmaxes at the ``len(drafts) + 1``
    verified positions; drafts are accepted while they equal them, then the target's token."""
    out = []
    for d, t in zip(drafts, targets):
        if d != t:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out


def draft_tokens(logits: Tensor, params: list[SamplingParams], out_index: list[int],
                 j: int) -> tuple[Tensor, Tensor | None]:
    """Draft tokens ``[S]`` from MTP logits ``[S, vocab]``: greedy rows take the argmax, the
    others draw from their filtered distribution ``q`` (returned ``[S, vocab]``; ``None`` when
    every row is greedy). ``out_index[i] + j``: the output index the draft stands for."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1), None
    q = filtered_probs(logits, params)
    q = torch.nan_to_num(q, nan=0.0)
    toks = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy and float(q[i].sum()) > 0:
            gen = _generator(p, (out_index[i] + j) ^ 0x9E37, logits.device)
            toks[i] = draw(q[i], gen)
    return toks, q


@dataclass
class SpecStats:
    """Speculative decoding counters (``LLM.stats()``)."""

    verify_steps: int = 0         # request-steps that verified at least one draft
    drafted: int = 0              # draft tokens verified
    accepted: int = 0             # of them accepted
    emitted: int = 0              # tokens produced by those request-steps (accepted + 1)
    union_count: int = 0          # verify groups whose union size was measured
    union_sum: int = 0
    union_max: int = 0
    union_recent: deque = field(default_factory=lambda: deque(maxlen=64))

    def add_unions(self, sizes: list[int]) -> None:
        for n in sizes:
            self.union_count += 1
            self.union_sum += n
            self.union_max = max(self.union_max, n)
            self.union_recent.append(n)

    def as_dict(self) -> dict:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_mean_accepted_length": (self.emitted / self.verify_steps
                                          if self.verify_steps else 0.0),
            "spec_union_size_mean": (self.union_sum / self.union_count
                                     if self.union_count else 0.0),
            "spec_union_size_max": self.union_max,
            "spec_union_sizes_recent": list(self.union_recent),
        }
