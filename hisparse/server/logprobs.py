"""OpenAI ``logprobs`` objects from the engine's per-token entries.

An engine entry (``CompletionOutput.logprobs[i]``) is ``{token id: log-probability}`` with the
sampled token first and then the request's top-n (the sampled token appears once, also when it
is among the top-n). Token strings are the tokenizer's decoding of the single token (``str(id)``
without a tokenizer); chat entries also carry the UTF-8 bytes, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def top_n(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of an entry (the sampled one only if it is among them)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[dict],
                        n: int, text_offset: int = 0) -> dict:
    """``/v1/completions`` ``choice.logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` per token) and ``text_offset`` (character
    offsets into the completion text, starting at ``text_offset``)."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(text_offset)
        s = token_text(tokenizer, t)
        tokens.append(s)
        text_offset += len(s)
    return {"tokens": tokens,
            "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
            "top_logprobs": [{token_text(tokenizer, k): v for k, v in top_n(e, n)}
                             for e in entries],
            "text_offset": offsets}


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
