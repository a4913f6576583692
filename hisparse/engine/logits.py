"""Logits processors that run before the sampler, vectorised over the batch: repetition,
frequency and presence penalties, logit bias, min_tokens and bad words (vLLM's semantics and
order: bad words, min_tokens, logit bias, then penalties; min-p is a sampler filter).

Token state lives on the device in :class:`LogitsState`, one row per KV slot, allocated once at
start-up: output-token counts ``[R, vocab]`` int32, a prompt-token mask ``[R, vocab]`` bool and
the last :data:`WINDOW` output tokens ``[R, WINDOW]`` int64 (``-1``: none). A row is (re)built
only when a request that needs it is first sampled under a new KV handle (admission, or
resumption after preemption: one upload from the host's token lists); afterwards
:meth:`LogitsState.record` adds every sampled token on the device. So the state is right in the
overlapped loop too, where the host does not know the token the step in flight sampled.

Per step the host packs only sparse per-row data (the rows' penalty scalars, bias entries,
banned ids, bad-word candidates) into two pinned buffers and uploads them in two copies; every
op after that is a batched tensor op (``index_put_``, ``gather``, ``where``), no host sync.

Speculative steps verify ``n_i`` positions of request ``i``: the row of its ``j``-th position
sees the slot's state plus the first ``j`` drafts (``extra`` tokens), so penalties and bans at
a draft position are exactly those the non-speculative loop applies after accepting the drafts
before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hisparse.engine.sampling import (
    BAD_WORDS,
    BIAS,
    MAX_BAD_WORD_TOKENS,
    MIN_TOKENS,
    PENALTIES,
    SamplingParams,
)
from hisparse.worker.step_state import _Staging

WINDOW = MAX_BAD_WORD_TOKENS - 1   # output tokens a bad word's prefix is matched against
_PAD = -2     # bad-word prefix padding: matches anything (SamplingParams.packed_bad_words)


STATE = PENALTIES | BAD_WORDS      # processors that read the device token state


def needs_state(p: SamplingParams) -> bool:
    """The request reads the device token state (penalties or bad words)."""
    return bool(p.processors & STATE)


@dataclass
class LogitsBatch:
    """One step's processor inputs on the device (``N`` logits rows). ``None`` fields are
    unused this step."""

    slots: Tensor                  # int64 [N] each row's KV slot (state row)
    tracked: bool                  # some row reads or writes the token state
    extra: Tensor | None           # int64 [N, k] drafts between the state and the row, -1 pad
    penalties: Tensor | None       # fp32 [3, N]: repetition, frequency, presence
    bias: tuple[Tensor, Tensor, Tensor] | None    # rows, token ids, values
    bans: tuple[Tensor, Tensor] | None            # rows, token ids (min_tokens)
    bad_words: tuple[Tensor, Tensor, Tensor] | None   # rows [C], last ids [C], prefixes [C, W]


class LogitsState:
    """Device token state of up to ``max_rows`` KV slots and the per-step processor pass."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.output_counts = torch.zeros(max_rows, vocab, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(max_rows, vocab, dtype=torch.bool, device=device)
        self.recent = torch.full((max_rows, WINDOW), -1, dtype=torch.int64, device=device)
        self._owner: list[object | None] = [None] * max_rows   # KV handle each row was built for
        self._ints = _Staging(device, 4096)
        self._floats = _Staging(device, 1024, torch.float32)
        self._window = torch.arange(WINDOW, device=device)

    @staticmethod
    def nbytes(max_rows: int, vocab: int) -> int:
        """Device bytes of the state (the KV sizing reserves them)."""
        return max_rows * (vocab * 5 + WINDOW * 8)

    # ------------------------------------------------------------------ per step (host)
    def prepare(self, params: Sequence[SamplingParams], handles: Sequence, slots: Sequence[int],
                token_lists: Callable[[int], tuple[list[int], int]], out_index: Sequence[int],
                eos_token_ids: frozenset[int],
                drafts: Sequence[Sequence[int]] | None = None) -> LogitsBatch | None:
        """Pack one step's processor inputs; None when no row uses a processor.

        Request ``i`` (``params[i]``, KV ``handles[i]`` and ``slots[i]``) owns ``1 +
        len(drafts[i])`` consecutive logits rows (one without ``drafts``); ``out_index[i]`` is
        the output index of its first row's token, ``token_lists(i)`` its ``(token_ids,
        prompt_len)`` (called only when its state row is rebuilt)."""
        flags = [p.processors for p in params]
        if not any(flags):
            return None     # the common case: one attribute per row
        n_req = len(params)
        k = max((len(d) for d in drafts), default=0) if drafts is not None else 0
        counts = [1 + len(drafts[i]) for i in range(n_req)] if drafts is not None \
            else [1] * n_req
        every = 0
        for f in flags:
            every |= f
        track = [bool(f & STATE) for f in flags]
        pen = bool(every & PENALTIES)
        has_bias = bool(every & BIAS)
        has_bw = bool(every & BAD_WORDS)
        has_min = bool(every & MIN_TOKENS) and any(
            out_index[i] < params[i].min_tokens for i in range(n_req) if flags[i] & MIN_TOKENS)
        if not (pen or has_bw or has_bias or has_min):
            return None
        N = sum(counts)
        row0 = list(itertools.accumulate([0] + counts[:-1]))
        ints: list[np.ndarray] = [np.asarray(slots, dtype=np.int64) if drafts is None
                                  else np.repeat(np.asarray(slots, dtype=np.int64), counts)]
        floats: list[np.ndarray] = []
        layout: dict[str, tuple[int, int]] = {}
        o = N

        def put(name: str, arr) -> None:
            nonlocal o
            arr = np.asarray(arr, dtype=np.int64).ravel()
            ints.append(arr)
            layout[name] = (o, arr.size)
            o += arr.size

        tracked = any(track)
        if tracked and k:
            ex = np.full((N, k), -1, dtype=np.int64)
            for i in range(n_req):
                for j in range(1, counts[i]):
                    ex[row0[i] + j, :j] = drafts[i][:j]
            put("extra", ex)
        # state rows to (re)build: a tracked request first sampled under this KV handle
        init = [i for i in range(n_req) if track[i] and self._owner[slots[i]] is not handles[i]]
        if init:
            p_rows, p_toks, o_rows, o_toks = [], [], [], []
            recent = np.full((len(init), WINDOW), -1, dtype=np.int64)
            for m, i in enumerate(init):
                ids, n_prompt = token_lists(i)
                prompt, out = ids[:n_prompt], ids[n_prompt:]
                p_rows.append(np.full(len(prompt), slots[i]))
                p_toks.append(prompt)
                o_rows.append(np.full(len(out), slots[i]))
                o_toks.append(out)
                tail = out[-WINDOW:]
                if tail:
                    recent[m, WINDOW - len(tail):] = tail
                self._owner[slots[i]] = handles[i]
            put("init_slots", [slots[i] for i in init])
            put("prompt_rows", np.concatenate(p_rows))
            put("prompt_toks", np.concatenate(p_toks))
            put("out_rows", np.concatenate(o_rows))
            put("out_toks", np.concatenate(o_toks))
            put("init_recent", recent)
        if pen:
            f = np.empty((3, N), dtype=np.float32)
            f[0] = np.repeat([p.repetition_penalty for p in params], counts)
            f[1] = np.repeat([p.frequency_penalty for p in params], counts)
            f[2] = np.repeat([p.presence_penalty for p in params], counts)
            floats.append(f.ravel())
        if has_bias:
            rows, toks, vals = _per_token_row(params, flags, BIAS, counts, row0,
                                              lambda p: p.packed_bias)
            put("bias_rows", rows)
            put("bias_toks", toks)
            floats.append(vals)
        if has_min:
            rows, toks = [], []
            eos = list(eos_token_ids)
            for i, p in enumerate(params):
                if not flags[i] & MIN_TOKENS or out_index[i] >= p.min_tokens:
                    continue
                stop = p.stop_token_ids + ([] if p.ignore_eos else eos)
                for j in range(min(counts[i], p.min_tokens - out_index[i])):
                    rows += [row0[i] + j] * len(stop)
                    toks += stop
            has_min = bool(rows)
            if has_min:
                put("ban_rows", rows)
                put("ban_toks", toks)
        if has_bw:
            rows, last, prefix = _per_token_row(params, flags, BAD_WORDS, counts, row0,
                                                lambda p: p.packed_bad_words)
            put("bw_rows", rows)
            put("bw_last", last)
            put("bw_prefix", prefix)
        dev_i = self._upload(self._ints, np.concatenate(ints))
        dev_f = self._upload(self._floats, np.concatenate(floats)) if floats else None

        def get(name: str) -> Tensor | None:
            if name not in layout:
                return None
            a, n = layout[name]
            return dev_i[a:a + n]

        if init:
            s = get("init_slots")
            self.output_counts.index_fill_(0, s, 0)
            self.prompt_seen.index_fill_(0, s, False)
            self.prompt_seen.index_put_((get("prompt_rows"), get("prompt_toks")),
                                        torch.ones((), dtype=torch.bool, device=self.device))
            self.output_counts.index_put_(
                (get("out_rows"), get("out_toks")),
                torch.ones((), dtype=torch.int32, device=self.device).expand(
                    layout["out_rows"][1]), accumulate=True)
            self.recent.index_copy_(0, s, get("init_recent").view(-1, WINDOW))
        fo = 0
        penalties = bias = bans = bad_words = None
        if pen:
            penalties = dev_f[:3 * N].view(3, N)
            fo = 3 * N
        if has_bias:
            nb = layout["bias_rows"][1]
            bias = (get("bias_rows"), get("bias_toks"), dev_f[fo:fo + nb])
        if has_min:
            bans = (get("ban_rows"), get("ban_toks"))
        if has_bw:
            bad_words = (get("bw_rows"), get("bw_last"), get("bw_prefix").view(-1, WINDOW))
        extra = get("extra")
        return LogitsBatch(slots=dev_i[:N], tracked=tracked,
                           extra=None if extra is None else extra.view(N, k),
                           penalties=penalties, bias=bias, bans=bans, bad_words=bad_words)

    @staticmethod
    def _upload(staging: _Staging, arr: np.ndarray) -> Tensor:
        buf = staging.begin(arr.size)
        buf[:] = arr
        return staging.upload(arr.size)

    # ------------------------------------------------------------------ per step (device)
    def apply(self, batch: LogitsBatch, logits: Tensor) -> Tensor:
        """Process ``logits [N, vocab]`` fp32 in place (bad words, min_tokens, bias,
        penalties) and return it."""
        neg_inf = float("-inf")
        if batch.bad_words is not None:
            rows, last, prefix = batch.bad_words
            window = self._windows(batch)[rows]                      # [C, W]
            match = ((window == prefix) | (prefix == _PAD)).all(dim=-1)
            logits.index_put_((rows, last), torch.where(match, neg_inf, 0.0), accumulate=True)
        if batch.bans is not None:
            logits.index_put_(batch.bans, torch.full((), neg_inf, device=logits.device))
        if batch.bias is not None:
            rows, toks, vals = batch.bias
            logits.index_put_((rows, toks), vals, accumulate=True)
        if batch.penalties is not None:
            rep, freq, pres = batch.penalties[:, :, None]
            counts = self._counts(batch)
            seen = self.prompt_seen[batch.slots] | (counts > 0)
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep),
                                     logits))
            logits -= freq * counts + pres * (counts > 0)
        return logits

    def _counts(self, batch: LogitsBatch) -> Tensor:
        counts = self.output_counts[batch.slots]
        if batch.extra is not None:
            counts.scatter_add_(1, batch.extra.clamp(min=0), (batch.extra >= 0).int())
        return counts

    def _windows(self, batch: LogitsBatch) -> Tensor:
        """``[N, W]``: each row's last ``W`` output tokens (its drafts included)."""
        recent = self.recent[batch.slots]
        if batch.extra is None:
            return recent
        n = (batch.extra >= 0).sum(dim=1, keepdim=True)
        return torch.cat([recent, batch.extra], dim=1).gather(1, n + self._window)

    def record(self, batch: LogitsBatch | None, tokens: Tensor) -> None:
        """The step sampled ``tokens [N]`` (int64, device, one per row; ``-1``: failed): add
        them to the state rows. Non-speculative steps only (one row per request)."""
        if batch is None or not batch.tracked:
            return
        self._append(batch.slots, tokens[:, None])

    def record_spec(self, slots: Sequence[int], outs: Sequence[Sequence[int]],
                    params: Sequence[SamplingParams]) -> None:
        """A speculative step produced ``outs[i]`` for the request in ``slots[i]`` (host lists:
        the loop is synchronous)."""
        keep = [i for i, p in enumerate(params) if needs_state(p)]
        if not keep:
            return
        width = max(len(outs[i]) for i in keep)
        toks = np.full((len(keep), width), -1, dtype=np.int64)
        for m, i in enumerate(keep):
            toks[m, :len(outs[i])] = outs[i]
        dev = self._upload(self._ints, np.concatenate(
            [np.asarray([slots[i] for i in keep], dtype=np.int64), toks.ravel()]))
        self._append(dev[:len(keep)], dev[len(keep):].view(len(keep), width))

    def _append(self, slots: Tensor, toks: Tensor) -> None:
        """Append ``toks [n, w]`` (left-aligned, ``-1`` pad) to the state rows ``slots``."""
        valid = toks >= 0
        self.output_counts.index_put_(
            (slots[:, None].expand_as(toks), toks.clamp(min=0)), valid.int(), accumulate=True)
        n = valid.sum(dim=1, keepdim=True)
        window = torch.cat([self.recent[slots], toks], dim=1).gather(1, n + self._window)
        self.recent.index_copy_(0, slots, window)


def _per_token_row(params, flags, bit, counts, row0, packed) -> tuple[np.ndarray, ...]:
    """The packed arrays (``packed(p)``: arrays of equal length ``n_p``) of every request whose
    processors include ``bit``, once per token row of the request (``counts[i]`` rows from
    ``row0[i]``), concatenated: ``(token rows int64 [sum], *arrays)``."""
    rows, parts = [], []
    for i, p in enumerate(params):
        if flags[i] & bit:
            arrays = packed(p)
            for j in range(counts[i]):
                rows.append(np.full(arrays[0].shape[0], row0[i] + j))
                parts.append(arrays)
    return (np.concatenate(rows), *(np.concatenate(a) for a in zip(*parts)))
