"""Sampling parameters and the vectorised sampler (greedy, temperature, top-k, top-p, seeds).

:func:`sample` draws one token per row of a ``[n, vocab]`` logits batch with no per-row Python
loop and one host sync (the final token fetch). Per-step parameters live in a
:class:`SamplingTensors` built once per step from the requests' :class:`SamplingParams`.

Seeded rows use a counter-based RNG written in torch integer ops: the uniform for vocabulary
entry ``v`` of output token ``i`` of a request with seed ``s`` is a hash of ``(s, i, v)``, so a
seeded request draws the same tokens whatever batch it runs in (and the draw is CUDA-graph
capturable: no generator state). Unseeded rows use the global generator. A token is the winner of
an exponential race (Gumbel-max) over the tempered logits that survive top-k and top-p, which is
an exact sample of the renormalised distribution.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
MAX_LOGPROBS = 20      # top log-probabilities per token, at most (OpenAI's limit)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Like vLLM's: ``temperature=0`` is greedy; ``top_k=-1`` and ``top_p=1`` disable those
    filters; ``seed`` makes one request's samples reproducible whatever its batch.

    Every field is checked here (types, finiteness, ranges): a ``ValueError`` names the field
    and the limit. The engine checks ``stop_token_ids`` against the model's vocabulary and takes
    its own validated copy when a request is added, so later mutation has no effect.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities of each sampled token and of the ``logprobs`` most likely tokens, from
    # the model's distribution (log-softmax of the raw logits: before temperature, top-k and
    # top-p, like vLLM's default). None: off.
    logprobs: int | None = None
    skip_special_tokens: bool = True   # leave special tokens (EOS...) out of the text
    # Prefill/decode disaggregation (vLLM's request-level protocol, issue 23):
    # ``{"do_remote_decode": true}`` on a prefill instance, the params it returned (with
    # ``do_remote_prefill``) on a decode instance; see :mod:`hisparse.kv.transfer_plan`.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        self.temperature = float(t)
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        self.top_p = float(p)
        k = self.top_k
        if not _is_int(k) or k == 0 or k < -1:
            raise ValueError(f"top_k must be an integer: -1 (off) or >= 1, got {k!r}")
        self.top_k = int(k)
        if self.seed is not None:
            if not _is_int(self.seed) or not -(1 << 63) <= self.seed < (1 << 64):
                raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), "
                                 f"got {self.seed!r}")
            self.seed = int(self.seed)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.max_tokens = int(self.max_tokens)
        stop = self.stop_token_ids
        if stop is None:
            stop = []
        if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop!r}")
        stop = list(stop)
        bad = [s for s in stop if not _is_int(s) or s < 0]
        if bad:
            raise ValueError(f"stop_token_ids entries must be integers >= 0, got {bad[0]!r}")
        self.stop_token_ids = [int(s) for s in stop]
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got "
                             f"{self.skip_special_tokens!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {lp!r}")

        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be None or an object, got "
                             f"{self.kv_transfer_params!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---------------------------------------------------------------------- counter-based RNG
def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow."""
    hi, lo = c >> 16, c & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _M32


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons): a well-mixed bijection of [0, 2**32), in int64 lanes."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """``[n, vocab]`` fp32 uniforms in (0, 1), a pure function of (seed, step, vocab index).

    ``seeds``: int64 ``[n]`` (any value; 64-bit seeds are folded as two 32-bit words),
    ``steps``: int64 ``[n]`` output-token index of each row.
    """
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    k1 = _hash32(lo ^ _hash32((steps & _M32) ^ 0x9E3779B9))
    k2 = _hash32(hi ^ _hash32(k1 ^ 0x85EBCA6B))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    v = _hash32(idx[None, :] ^ k1[:, None])
    v = _hash32(v ^ k2[:, None])
    return ((v >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


# ---------------------------------------------------------------------- per-step tensors
class SamplingStaging:
    """Host buffers (pinned on CUDA) for :meth:`SamplingTensors.build`, allocated once: two
    turns, so a step's parameters are written while the previous step's copy may be in flight
    (a turn is reused two steps later, after the engine waited for that step's tokens)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = torch.device(device).type == "cuda"
        self.max_rows = max_rows
        self.floats = [torch.empty(2, max_rows, dtype=torch.float32, pin_memory=pin)
                       for _ in range(2)]
        self.ints = [torch.empty(4, max_rows, dtype=torch.int64, pin_memory=pin)
                     for _ in range(2)]
        self.turn = 0

    def take(self, n: int) -> tuple[Tensor, Tensor]:
        self.turn ^= 1
        return self.floats[self.turn][:, :n], self.ints[self.turn][:, :n]


@dataclass
class SamplingTensors:
    """Per-step sampling parameters as device tensors, one row per sampled request."""

    temperature: Tensor   # fp32 [n], 0 = greedy
    top_p: Tensor         # fp32 [n]
    top_k: Tensor         # int64 [n], -1 = off
    seeds: Tensor         # int64 [n], meaningful where ``seeded``
    seeded: Tensor        # bool [n]
    steps: Tensor         # int64 [n] output-token index
    all_greedy: bool
    any_seeded: bool
    any_unseeded_random: bool
    any_filter: bool = True   # some sampled row uses top-k or top-p (else no sort is needed)

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int],
              device: torch.device | str = "cpu",
              staging: SamplingStaging | None = None) -> SamplingTensors:
        """Pack every row's parameters into two host tensors and move them in two copies
        (none when every row is greedy: only ``all_greedy`` is read then)."""
        device = torch.device(device)
        n = len(params)
        if all(p.greedy for p in params):
            f = torch.empty(0, device=device)
            i = torch.empty(0, dtype=torch.int64, device=device)
            return cls(temperature=f, top_p=f, top_k=i, seeds=i,
                       seeded=torch.empty(0, dtype=torch.bool, device=device), steps=i,
                       all_greedy=True, any_seeded=False, any_unseeded_random=False,
                       any_filter=False)
        if staging is not None and n <= staging.max_rows:
            f, i = staging.take(n)
        else:
            pin = device.type == "cuda"
            f = torch.empty(2, n, dtype=torch.float32, pin_memory=pin)
            i = torch.empty(4, n, dtype=torch.int64, pin_memory=pin)
        fv = f.numpy()
        iv = i.numpy()
        fv[0] = [p.temperature for p in params]
        fv[1] = [p.top_p for p in params]
        iv[0] = [p.top_k for p in params]
        # Seeds folded to signed 64 bits (the hash uses both 32-bit words).
        iv[1] = [0 if p.seed is None else ((p.seed + (1 << 63)) % (1 << 64)) - (1 << 63)
                 for p in params]
        iv[2] = [p.seed is not None for p in params]
        iv[3] = steps
        f, i = f.to(device, non_blocking=True), i.to(device, non_blocking=True)
        greedy = [p.greedy for p in params]
        return cls(temperature=f[0], top_p=f[1], top_k=i[0], seeds=i[1], seeded=i[2].bool(),
                   steps=i[3], all_greedy=all(greedy),
                   any_seeded=any(p.seed is not None and not p.greedy for p in params),
                   any_unseeded_random=any(p.seed is None and not p.greedy for p in params),
                   any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1)
                                  for p in params))

    def row(self, r: int) -> SamplingTensors:
        s = slice(r, r + 1)
        return SamplingTensors(self.temperature[s], self.top_p[s], self.top_k[s], self.seeds[s],
                               self.seeded[s], self.steps[s], self.all_greedy,
                               self.any_seeded, self.any_unseeded_random, self.any_filter)


def filter_mask(logits: Tensor, st: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Tempered logits and the top-k / top-p keep mask ``[n, vocab]`` (bool)."""
    n, vocab = logits.shape
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = logits.float() / temp[:, None]
    if not st.any_filter:
        return x, torch.ones_like(x, dtype=torch.bool)
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    kth = sorted_x.gather(1, (k - 1)[:, None])
    keep_sorted = sorted_x >= kth                       # top-k (ties at the k-th value kept)
    sorted_p = torch.softmax(sorted_x.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the top token always stays).
    # (top_p == 1 is off: a rounded cumsum must not drop the tail.)
    keep_sorted &= ((sorted_p.cumsum(-1) - sorted_p) < st.top_p[:, None]) \
        | (st.top_p >= 1)[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x, keep


def sample_tensor(logits: Tensor, st: SamplingTensors) -> Tensor:
    """int64 ``[n]`` tokens on the device; ``-1`` where a row's logits are not finite."""
    finite = torch.isfinite(logits).all(dim=-1)
    greedy_tok = logits.argmax(dim=-1)
    if st.all_greedy:
        return torch.where(finite, greedy_tok, -1)
    x, keep = filter_mask(logits, st)
    n, vocab = x.shape
    if st.any_seeded:
        u = counter_uniform(st.seeds, st.steps, vocab)
        if st.any_unseeded_random:
            u = torch.where(st.seeded[:, None], u, torch.rand_like(u).clamp_(min=1e-38))
    else:
        u = torch.rand(n, vocab, device=x.device).clamp_(min=1e-38)
    # Exponential race: argmax x - log(E), E = -log(u) ~ Exp(1)  (Gumbel-max).
    score = (x - torch.log(-torch.log(u))).masked_fill(~keep, float("-inf"))
    tok = torch.where(st.temperature > 0, score.argmax(dim=-1), greedy_tok)
    return torch.where(finite, tok, -1)


def token_logprobs(logits: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-softmax of the raw ``logits [n, vocab]``: the sampled ``tokens``' (``[n]`` fp32; a
    ``-1`` row gets the log-probability of token 0, unused) and the ``top`` largest per row
    (``[n, top]`` fp32 and int64 ids, descending)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    if top:
        vals, ids = lp.topk(top, dim=-1)
    else:
        vals = lp.new_empty(lp.shape[0], 0)
        ids = tokens.new_empty(lp.shape[0], 0)
    return chosen, vals, ids


def sample(logits: Tensor, params: list[SamplingParams], steps: list[int] | None = None,
           tensors: SamplingTensors | None = None) -> list[int]:
    """One token per row of ``logits [n, vocab]``; ``-1`` marks a row with non-finite logits.

    ``steps[r]``: the output-token index of row ``r`` (the seeded RNG's counter).
    """
    if not params:
        return []
    if tensors is None:
        tensors = SamplingTensors.build(params, steps or [0] * len(params), logits.device)
    return sample_tensor(logits, tensors).tolist()


def sample_rows(logits: Tensor, params: list[SamplingParams], steps: list[int]
                ) -> list[int | Exception]:
    """Row-by-row fallback: each row's token, or the exception its row raised."""
    out: list[int | Exception] = []
    for r, p in enumerate(params):
        try:
            out.append(sample(logits[r:r + 1], [p], [steps[r]])[0])
        except Exception as e:  # noqa: BLE001 - reported per request
            out.append(e)
    return out
