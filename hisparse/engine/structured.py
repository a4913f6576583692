"""Structured output through xgrammar: constraints compiled against the engine's tokenizer,
one grammar matcher per constrained request, token bitmasks applied on the device.

Per step the host fills a bitmask row (``ceil(vocab / 32)`` int32) for each constrained
sampling row only, in a pinned buffer (two turns), uploads the rows in one copy and masks those
rows of the batch's logits on the device (disallowed tokens -> ``-inf``); unconstrained rows are
untouched, so constrained requests batch with the others, and CUDA graphs (which capture the
forward, not the sampler) replay as before. The engine advances a matcher with each token it
appends and finishes the request when the grammar terminates (:mod:`hisparse.engine.core`).
The host needs a request's last token before filling its next mask: with the overlapped loop
the engine applies the step in flight before sampling a step that has constrained rows.

JSON (schemas and ``json_object``) is compiled without free whitespace (xgrammar's
``any_whitespace=False``: the separators ``", "`` and ``": "``, like vLLM's
``disable_any_whitespace``): a model that favours whitespace (a weak or random one) could
otherwise spend every token on it and never close the object.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from torch import Tensor

from hisparse.engine.sampling import StructuredOutputsParams


class GrammarBackend:
    """Compiles constraints (cached by content) and masks logits, for up to ``max_rows``
    constrained rows per step."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_rows: int, device: torch.device) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = [torch.empty(max_rows, words, dtype=torch.int32, pin_memory=pin)
                      for _ in range(2)]
        self._host_rows = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pin)
                           for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._dev = torch.empty(max_rows, words, dtype=torch.int32, device=device)
        self._dev_rows = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._full = torch.empty(max_rows, words, dtype=torch.int32, device=device)
        self._turn = 0
        self.device = device

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of ``so``; ``ValueError`` naming the field when xgrammar
        rejects it."""
        c = self.compiler
        if so.json is not None:
            name = "structured_outputs.json"
            schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
            build = lambda: c.compile_json_schema(schema, any_whitespace=False)
        elif so.json_object:
            name = "structured_outputs.json_object"
            build = lambda: c.compile_json_schema(
                '{"type": "object"}', any_whitespace=False)
        elif so.regex is not None:
            name = "structured_outputs.regex"
            build = lambda: c.compile_regex(so.regex)
        elif so.choice is not None:
            name = "structured_outputs.choice"
            ebnf = "root ::= " + " | ".join(json.dumps(ch, ensure_ascii=False)
                                            for ch in so.choice)
            build = lambda: c.compile_grammar(ebnf)
        else:
            name = "structured_outputs.grammar"
            build = lambda: c.compile_grammar(so.grammar)
        try:
            return build()
        except Exception as e:  # noqa: BLE001 - xgrammar's own parse / schema error
            raise ValueError(f"{name}: xgrammar could not compile it: "
                             f"{str(e).strip().splitlines()[-1][:300]}") from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def prepare(self, rows: list[int], matchers: list) -> tuple[Tensor, Tensor] | None:
        """Fill and upload the bitmasks of logits rows ``rows`` (their matchers): the device
        row indices and masks. None when there is none (or every matcher
        terminated)."""
        live = [(r, m) for r, m in zip(rows, matchers) if not m.is_terminated()]
        if not live:
            return None
        self._turn ^= 1
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()   # the copy that read this turn is done
        host = self._host[self._turn]
        for i, (_, m) in enumerate(live):
            m.fill_next_token_bitmask(host, i)
        n = len(live)
        host_rows = self._host_rows[self._turn][:n]
        host_rows.numpy()[:] = [r for r, _ in live]
        dev, dev_rows = self._dev[:n], self._dev_rows[:n]
        cuda = self.device.type == "cuda"
        dev.copy_(host[:n], non_blocking=cuda)
        dev_rows.copy_(host_rows, non_blocking=cuda)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._turn] = ev
        return dev_rows, dev

    def apply(self, mask: tuple[Tensor, Tensor], logits: Tensor) -> None:
        """Disallowed tokens of the masked rows -> ``-inf`` (in place, on the device): the
        masks are scattered into an all-allowed ``[N, words]`` mask, then xgrammar's kernel."""
        rows, bitmask = mask
        full = self._full[:logits.shape[0]].fill_(-1)
        full.index_copy_(0, rows, bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, full, vocab_size=self.vocab)
