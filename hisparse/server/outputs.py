"""Running a request's prompts on the engine and answering: all-or-nothing submission, the
whole response (aborted when the client goes away) or its server-sent-event stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hisparse.engine.async_engine import Overloaded
from hisparse.engine.llm import EngineDeadError, RequestOutput
from hisparse.engine.sampling import SamplingParams
from hisparse.server import logprobs as lp
from hisparse.server.http import USAGE_KEY, error_body
from hisparse.server.inputs import APIError, ServerState, bad_request, constraint_field_of
from hisparse.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
)


async def _submit_all(st: ServerState, prompts: list[dict], params: SamplingParams, n: int,
                      stop: list[str], prompt_field: str,
                      constraint_field: str | None = None) -> list[tuple[str, object]]:
    """Queue prompts x n requests, all or nothing."""
    subs: list[tuple[str, object]] = []
    try:
        for prompt in prompts:
            for j in range(n):
                p = params
                if n > 1 and params.seed is not None:   # n distinct, reproducible samples
                    p = dataclasses.replace(params, seed=params.seed + j)
                subs.append(await st.engine.submit(
                    {"prompt_token_ids": prompt["prompt_token_ids"]}, p, stop=stop))
    except BaseException as e:
        for rid, _ in subs:
            st.engine.abort(rid)
        if isinstance(e, ValueError):
            raise bad_request(e, prompt_field, constraint_field) from None
        if isinstance(e, Overloaded):
            raise APIError(503, str(e), None, "overloaded_error") from None
        if isinstance(e, EngineDeadError):
            raise APIError(503, str(e), None, "server_error") from None
        raise
    return subs


class _Delta:
    """Text not yet sent of one choice; holds back what may still become a stop string or an
    incomplete UTF-8 sequence."""

    def __init__(self, holdback: int) -> None:
        self.sent_text = 0
        self.sent_tokens = 0
        self.holdback = holdback

    def take(self, out: RequestOutput) -> tuple[str, list[int]]:
        comp = out.outputs[0]
        text = comp.text or ""
        end = len(text)
        if not out.finished:
            end = max(self.sent_text, end - self.holdback)
            while end > self.sent_text and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_text:end]
        self.sent_text = end
        toks = comp.token_ids[self.sent_tokens:]
        self.sent_tokens = len(comp.token_ids)
        return delta, toks


def _finish_reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


async def serve(st: ServerState, req, prompts: list[dict], params: SamplingParams, chat: bool,
                raw: Request):
    prompt_field = "messages" if chat else "prompt"
    stop = req.stop_strings()
    if params.kv_transfer_params and (len(prompts) > 1 or req.n > 1):
        raise APIError(400, "kv_transfer_params: one prompt and n=1 per request",
                       "kv_transfer_params")
    if (params.kv_transfer_params or {}).get("do_remote_decode") and req.stream:
        raise APIError(400, "kv_transfer_params.do_remote_decode needs stream=false (the "
                       "prefill's answer carries the params)", "kv_transfer_params")
    subs = await _submit_all(st, prompts, params, req.n, stop, prompt_field,
                             constraint_field_of(req))
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts for _ in range(req.n)]
    usage_log = raw.scope.setdefault(USAGE_KEY, {})     # the access log line's token counts
    usage_log["prompt_tokens"] = sum(len(p["prompt_token_ids"]) for p in prompts)
    usage_log["user"] = req.user
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's extension: usage so far in every chunk (with include_usage only)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        holdback = max((len(s) for s in stop), default=1) - 1
        return StreamingResponse(
            _stream(st, subs, rid, chat, prompt_lens, (include_usage, continuous), holdback,
                    req.return_token_ids, params.logprobs, usage_log),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await _finals_unless_disconnected(st, subs, raw)
    if finals is None:      # the client went away: its requests are aborted, nobody reads this
        return Response(status_code=499)
    failed = [o for o in finals if o.outputs[0].finish_reason == "error"]
    if failed and len(failed) == len(finals):
        raise APIError(500, f"generation failed: {failed[0].outputs[0].error}", None,
                       "server_error")
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    usage = Usage(prompt_tokens=sum(len(p["prompt_token_ids"]) for p in prompts),
                  completion_tokens=completion)
    usage.total_tokens = usage.prompt_tokens + completion
    usage_log["completion_tokens"] = completion
    tok_ids = (lambda o: o.outputs[0].token_ids) if req.return_token_ids else (lambda o: None)
    n_top = params.logprobs

    def logprobs_of(o: RequestOutput) -> dict | None:
        comp = o.outputs[0]
        if comp.logprobs is None:
            return None
        if chat:
            return lp.chat_logprobs(st.tokenizer, comp.token_ids, comp.logprobs, n_top)
        return lp.completion_logprobs(st.tokenizer, comp.token_ids, comp.logprobs,
                                      lp.TextOffsets(st.tokenizer))

    if chat:
        choices = [ChatChoice(index=i, message=ChatMessageOut(content=o.outputs[0].text or ""),
                              logprobs=logprobs_of(o),
                              finish_reason=o.outputs[0].finish_reason, token_ids=tok_ids(o))
                   for i, o in enumerate(finals)]
        resp = ChatCompletionResponse(id=rid, model=st.model_name, choices=choices,
                                      usage=usage)
    else:
        choices = [CompletionChoice(index=i, text=o.outputs[0].text or "",
                                    logprobs=logprobs_of(o),
                                    finish_reason=o.outputs[0].finish_reason,
                                    token_ids=tok_ids(o))
                   for i, o in enumerate(finals)]
        resp = CompletionResponse(id=rid, model=st.model_name, choices=choices, usage=usage)
    body = resp.model_dump()
    kv = finals[0].kv_transfer_params
    if kv is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = kv
    if not req.return_token_ids:
        for c in body["choices"]:
            c.pop("token_ids", None)
    return JSONResponse(body)


DISCONNECT_POLL_S = 0.25


async def _finals_unless_disconnected(st: ServerState, subs, raw: Request
                                      ) -> list[RequestOutput] | None:
    """The last output of every sub-request, or None once the client has disconnected (polled
    every :data:`DISCONNECT_POLL_S`: a non-streaming response has no write that would fail);
    then, or if this handler is cancelled, every sub-request is aborted and its KV freed."""
    finals = asyncio.ensure_future(asyncio.gather(*(_last(st, s) for s in subs)))
    try:
        while True:
            done, _ = await asyncio.wait({finals}, timeout=DISCONNECT_POLL_S)
            if done:
                return finals.result()
            if await raw.is_disconnected():
                break
    except asyncio.CancelledError:
        _abort_all(st, subs, finals)
        raise
    _abort_all(st, subs, finals)
    return None


def _abort_all(st: ServerState, subs, finals: asyncio.Future) -> None:
    finals.cancel()
    for r, _ in subs:
        st.engine.abort(r)


async def _last(st: ServerState, sub) -> RequestOutput:
    last = None
    try:
        async for out in st.engine.stream(*sub):
            last = out
    except EngineDeadError as e:
        raise APIError(503, str(e), None, "server_error") from None
    return last


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(st: ServerState, subs, rid: str, chat: bool, prompt_lens: list[int],
                  usage_opts: tuple[bool, bool], holdback: int, return_token_ids: bool,
                  n_logprobs: int | None, usage_log: dict) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, sub) -> None:
        try:
            async for out in st.engine.stream(*sub):
                await merged.put((i, out))
        except BaseException as e:  # noqa: BLE001 - reported in the stream
            await merged.put((i, e))
        finally:
            await merged.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
    deltas = [_Delta(holdback) for _ in subs]
    offsets = [lp.TextOffsets(st.tokenizer) for _ in subs]
    completion = [0] * len(subs)
    left = len(subs)

    include_usage, continuous = usage_opts
    prompt_total = sum(prompt_lens)

    def chunk(choices, final: bool = False):
        body = {"id": rid, "object": obj, "created": created, "model": st.model_name,
                "choices": choices}
        if final or continuous:
            c = sum(completion)
            body["usage"] = {"prompt_tokens": prompt_total, "completion_tokens": c,
                             "total_tokens": prompt_total + c}
        return _sse(body)

    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(len(subs))])
        while left:
            i, item = await merged.get()
            if item is done:
                left -= 1
                continue
            if isinstance(item, BaseException):
                msg = str(item) if isinstance(item, EngineDeadError) else \
                    f"{type(item).__name__}: {item}"
                yield _sse(error_body(msg, None, "server_error", 500))
                continue
            sent = deltas[i].sent_tokens
            text, toks = deltas[i].take(item)
            completion[i] = len(item.outputs[0].token_ids)
            reason = _finish_reason(item)
            if not text and not toks and reason is None:
                continue
            logprobs = None
            entries = item.outputs[0].logprobs
            if n_logprobs is not None and entries is not None and toks:
                entries = entries[sent:sent + len(toks)]
                logprobs = (lp.chat_logprobs(st.tokenizer, toks, entries, n_logprobs) if chat
                            else lp.completion_logprobs(st.tokenizer, toks, entries,
                                                        offsets[i]))
            if chat:
                choice = {"index": i, "delta": {"content": text} if text else {},
                          "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs,
                          "finish_reason": reason}
            if return_token_ids:
                choice["token_ids"] = toks
            yield chunk([choice])
        if include_usage:
            yield chunk([], final=True)
        yield "data: [DONE]\n\n"
    finally:
        usage_log["completion_tokens"] = sum(completion)
        for t in tasks:   # a client that went away: its requests are aborted
            t.cancel()
