"""Sampling parameters and the vectorised sampler (greedy, temperature, top-k, top-p, min-p,
seeds). Penalties, logit bias, min_tokens and bad words run before it
(:mod:`hisparse.engine.logits`), grammar masks too (:mod:`hisparse.engine.structured`).

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

import numpy as np
import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
MAX_LOGPROBS = 20      # top log-probabilities per token, at most (OpenAI's limit)
MAX_BAD_WORD_TOKENS = 32   # tokens of one bad word, at most (the device keeps the last 31)
MAX_BAD_WORDS = 128        # bad words of one request, at most (after tokenization)
MAX_LOGIT_BIAS = 100.0     # |logit_bias| values, at most (OpenAI's range)
# SamplingParams.processors bits
PENALTIES, BIAS, BAD_WORDS, MIN_TOKENS = 1, 2, 4, 8


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_penalty(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    ok = _is_real(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], "
                         f"got {v!r}")
    return float(v)


def _token_seqs(name: str, seqs) -> list[list[int]]:
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise ValueError(f"{name} must be a list of token id lists, got {seqs!r}")
    out = []
    for w in seqs:
        if isinstance(w, (str, bytes)) or not hasattr(w, "__iter__"):
            raise ValueError(f"{name} entries must be lists of token ids, got {w!r}")
        w = list(w)
        if not 1 <= len(w) <= MAX_BAD_WORD_TOKENS:
            raise ValueError(f"{name} entries must have 1 to {MAX_BAD_WORD_TOKENS} tokens, "
                             f"got {len(w)}")
        if any(not _is_int(t) or t < 0 for t in w):
            raise ValueError(f"{name} entries must be lists of integers >= 0, got {w!r}")
        out.append([int(t) for t in w])
    if len(out) > MAX_BAD_WORDS:
        raise ValueError(f"{name} must have at most {MAX_BAD_WORDS} entries, got {len(out)}")
    return out


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names): ``json`` (a JSON schema, dict or string),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (EBNF / GBNF, xgrammar's dialect). Exactly one is set. Needs the checkpoint's
    tokenizer (:mod:`hisparse.engine.structured` compiles it)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or "
                             f"string), got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got "
                                 f"{self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
        n = sum(x is not None for x in (self.json, self.regex, self.choice, self.grammar)) \
            + self.json_object
        if n != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice, grammar (got {n})")


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
    # vLLM's semantics. repetition_penalty (> 0, 1 = off): logits of tokens seen in the prompt
    # or the output are divided by it where positive, multiplied where negative.
    # frequency_penalty / presence_penalty ([-2, 2], OpenAI's): subtract penalty x count / x
    # (count > 0) over the output tokens. logit_bias: token id -> bias in [-100, 100] added
    # to its logit. min_p ([0, 1]): drop tokens whose probability (after temperature) is below
    # min_p x the top one's. min_tokens: EOS and stop_token_ids are banned until that many
    # tokens are out. bad_words (strings: needs the tokenizer) / bad_words_token_ids (token
    # sequences): a sequence's last token is banned where the output ends with the rest.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # which logits processors the request uses (PENALTIES | BIAS | BAD_WORDS | MIN_TOKENS
    # bits), computed by __post_init__: the engine reads one attribute per row per step
    processors: int = field(default=0, init=False, repr=False, compare=False)
    # the same, packed once for the per-step host work: logit_bias as (ids int64 [b], biases
    # fp32 [b]); bad words as (last ids int64 [w], prefixes int64 [w, MAX_BAD_WORD_TOKENS-1]
    # right-aligned, -2 padding)
    packed_bias: tuple | None = field(default=None, init=False, repr=False, compare=False)
    packed_bad_words: tuple | None = field(default=None, init=False, repr=False,
                                           compare=False)
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
        self.repetition_penalty = _check_penalty("repetition_penalty", self.repetition_penalty,
                                                 0.0, math.inf, lo_open=True)
        self.frequency_penalty = _check_penalty("frequency_penalty", self.frequency_penalty,
                                                -2.0, 2.0)
        self.presence_penalty = _check_penalty("presence_penalty", self.presence_penalty,
                                               -2.0, 2.0)
        self.min_p = _check_penalty("min_p", self.min_p, 0.0, 1.0)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens="
                             f"{self.max_tokens}], got {self.min_tokens!r}")
        self.min_tokens = int(self.min_tokens)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                                 f"{self.logit_bias!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                tok = int(k) if isinstance(k, str) and k.isdigit() else k
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), "
                                     f"got {k!r}")
                bias[int(tok)] = _check_penalty(f"logit_bias[{tok}]", v, -MAX_LOGIT_BIAS,
                                                MAX_LOGIT_BIAS)
            self.logit_bias = bias or None
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
                raise ValueError(f"bad_words must be a list of strings, got {words!r}")
            words = list(words)
            if any(not isinstance(w, str) or not w for w in words):
                raise ValueError("bad_words entries must be non-empty strings")
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must have at most {MAX_BAD_WORDS} entries, got "
                                 f"{len(words)}")
            self.bad_words = words or None
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = _token_seqs("bad_words_token_ids",
                                                   self.bad_words_token_ids) or None
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(so).__name__}")
        self.packed_bias = self.packed_bad_words = None
        if self.logit_bias:
            self.packed_bias = (np.fromiter(self.logit_bias, dtype=np.int64),
                                np.fromiter(self.logit_bias.values(), dtype=np.float32))
        if self.bad_words_token_ids:
            words, width = self.bad_words_token_ids, MAX_BAD_WORD_TOKENS - 1
            prefix = np.full((len(words), width), -2, dtype=np.int64)
            for r, w in enumerate(words):
                if len(w) > 1:
                    prefix[r, width - len(w) + 1:] = w[:-1]
            self.packed_bad_words = (np.asarray([w[-1] for w in words], dtype=np.int64), prefix)
        self.processors = ((PENALTIES if self.uses_penalties else 0)
                           | (BIAS if self.logit_bias else 0)
                           | (BAD_WORDS if self.bad_words_token_ids else 0)
                           | (MIN_TOKENS if self.min_tokens else 0))

        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be None or an object, got "
                             f"{self.kv_transfer_params!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


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
        self.floats = [torch.empty(3, max_rows, dtype=torch.float32, pin_memory=pin)
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
    min_p: Tensor         # fp32 [n], 0 = off
    top_k: Tensor         # int64 [n], -1 = off
    seeds: Tensor         # int64 [n], meaningful where ``seeded``
    seeded: Tensor        # bool [n]
    steps: Tensor         # int64 [n] output-token index
    all_greedy: bool
    any_seeded: bool
    any_unseeded_random: bool
    any_filter: bool = True   # some sampled row uses top-k, top-p or min-p

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
            return cls(temperature=f, top_p=f, min_p=f, top_k=i, seeds=i,
                       seeded=torch.empty(0, dtype=torch.bool, device=device), steps=i,
                       all_greedy=True, any_seeded=False, any_unseeded_random=False,
                       any_filter=False)
        if staging is not None and n <= staging.max_rows:
            f, i = staging.take(n)
        else:
            pin = device.type == "cuda"
            f = torch.empty(3, n, dtype=torch.float32, pin_memory=pin)
            i = torch.empty(4, n, dtype=torch.int64, pin_memory=pin)
        fv = f.numpy()
        iv = i.numpy()
        fv[0] = [p.temperature for p in params]
        fv[1] = [p.top_p for p in params]
        fv[2] = [p.min_p for p in params]
        iv[0] = [p.top_k for p in params]
        # Seeds folded to signed 64 bits (the hash uses both 32-bit words).
        iv[1] = [0 if p.seed is None else ((p.seed + (1 << 63)) % (1 << 64)) - (1 << 63)
                 for p in params]
        iv[2] = [p.seed is not None for p in params]
        iv[3] = steps
        f, i = f.to(device, non_blocking=True), i.to(device, non_blocking=True)
        greedy = [p.greedy for p in params]
        return cls(temperature=f[0], top_p=f[1], min_p=f[2], top_k=i[0], seeds=i[1],
                   seeded=i[2].bool(), steps=i[3], all_greedy=all(greedy),
                   any_seeded=any(p.seed is not None and not p.greedy for p in params),
                   any_unseeded_random=any(p.seed is None and not p.greedy for p in params),
                   any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)
                                  for p in params))

    def row(self, r: int) -> SamplingTensors:
        s = slice(r, r + 1)
        return SamplingTensors(self.temperature[s], self.top_p[s], self.min_p[s], self.top_k[s],
                               self.seeds[s],
                               self.seeded[s], self.steps[s], self.all_greedy,
                               self.any_seeded, self.any_unseeded_random, self.any_filter)


def filter_mask(logits: Tensor, st: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Tempered logits and the min-p / top-k / top-p keep mask ``[n, vocab]`` (bool).

    min-p comes first (vLLM's order): ``p >= min_p * p_max`` is ``x >= x_max + log(min_p)``
    on tempered logits (``log 0 = -inf`` keeps all); top-k and top-p then see the survivors."""
    n, vocab = logits.shape
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = logits.float() / temp[:, None]
    if not st.any_filter:
        return x, torch.ones_like(x, dtype=torch.bool)
    x = x.masked_fill(x < x.amax(dim=-1, keepdim=True) + torch.log(st.min_p)[:, None],
                      float("-inf"))
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
    return x, keep & (x > float("-inf"))


def sample_tensor(logits: Tensor, st: SamplingTensors, finite: Tensor | None = None) -> Tensor:
    """int64 ``[n]`` tokens on the device; ``-1`` where a row's logits are not finite (or
    ``finite [n]`` is False: the caller's check of the raw logits, when ``logits`` were masked
    with ``-inf`` on purpose)."""
    if finite is None:
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
           tensors: SamplingTensors | None = None, finite: Tensor | None = None) -> list[int]:
    """One token per row of ``logits [n, vocab]``; ``-1`` marks a row with non-finite logits.

    ``steps[r]``: the output-token index of row ``r`` (the seeded RNG's counter).
    """
    if not params:
        return []
    if tensors is None:
        tensors = SamplingTensors.build(params, steps or [0] * len(params), logits.device)
    return sample_tensor(logits, tensors, finite).tolist()


def sample_rows(logits: Tensor, params: list[SamplingParams], steps: list[int],
                finite: Tensor | None = None) -> list[int | Exception]:
    """Row-by-row fallback: each row's token, or the exception its row raised."""
    out: list[int | Exception] = []
    for r, p in enumerate(params):
        try:
            out.append(sample(logits[r:r + 1], [p], [steps[r]],
                              finite=None if finite is None else finite[r:r + 1])[0])
        except Exception as e:  # noqa: BLE001 - reported per request
            out.append(e)
    return out
