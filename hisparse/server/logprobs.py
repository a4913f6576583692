"""OpenAI ``logprobs`` objects from the engine's per-token entries.

An engine entry (``CompletionOutput.logprobs[i]``) is ``{token id: log-probability}`` with the
sampled token first and then the request's top-n (the sampled token appears once, also when it
is among the top-n). Token strings are the tokenizer's decoding of the single token (``str(id)``
without a tokenizer). Completions' ``top_logprobs`` hold the top-n plus the sampled token (up
to n + 1 entries, as OpenAI's legacy API and vLLM); chat's hold exactly the top n, and its
``bytes`` are the UTF-8 bytes of that token string (a token holding part of a multi-byte
character decodes to U+FFFD, so its bytes are not the raw token bytes). ``text_offset`` is
each token's start in the completion text, from the same incremental detokenization as the
text (stop-string truncation cuts the text, not the token lists).
"""

from __future__ import annotations

from collections.abc import Sequence


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def top_n(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of an entry (the sampled one only if it is among them)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


class TextOffsets:
    """Start of each token in the detokenized completion text (one per choice; feed tokens in
    order, across streamed chunks)."""

    def __init__(self, tokenizer) -> None:
        from hisparse.engine.detokenizer import IncrementalDetokenizer

        self.ids: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.length = 0          # text length without a tokenizer (token strings joined)

    def add(self, token_ids: Sequence[int]) -> list[int]:
        starts = []
        for t in token_ids:
            if self.detok is None:
                starts.append(self.length)
                self.length += len(str(t))
                continue
            starts.append(len(self.detok.text))
            self.ids.append(t)
            self.detok.update(self.ids)
        return starts


def completion_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[dict],
                        offsets: TextOffsets) -> dict:
    """``/v1/completions`` ``choice.logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token ``{token: logprob}``: the top-n and the sampled token) and
    ``text_offset``."""
    return {"tokens": [token_text(tokenizer, t) for t in token_ids],
            "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
            "top_logprobs": [{token_text(tokenizer, k): v for k, v in e.items()}
                             for e in entries],
            "text_offset": offsets.add(token_ids)}


def _chat_item(tokenizer, token_id: int, logprob: float) -> dict:
    s = token_text(tokenizer, token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[dict],
                  n: int) -> dict:
    """``/v1/chat/completions`` ``choice.logprobs``: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``."""
    return {"content": [
        {**_chat_item(tokenizer, t, e[t]),
         "top_logprobs": [_chat_item(tokenizer, k, v) for k, v in top_n(e, n)]}
        for t, e in zip(token_ids, entries)]}
