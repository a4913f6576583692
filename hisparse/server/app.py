"""OpenAI-compatible HTTP server over :class:`~hisparse.engine.async_engine.AsyncLLM`.

    engine = AsyncLLM(LLM(model_dir, ...))
    app = create_app(engine, model_name="my-model")
    uvicorn.run(app, host="0.0.0.0", port=8000)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes),
``GET /version``, ``GET /health``, ``GET /metrics``. Every error status has the OpenAI shape
(``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the request field where
one is at fault); bad requests and fields the server does not implement get 400, a full queue
503. :mod:`hisparse.server.http` adds the size limit (413), the API key (401) and the access log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hisparse.engine.async_engine import AsyncLLM, Overloaded
from hisparse.engine.llm import EngineDeadError, RequestOutput
from hisparse.engine.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from hisparse.server import logprobs as lp
from hisparse.server.http import (
    DEFAULT_MAX_REQUEST_BYTES,
    USAGE_KEY,
    Gate,
    clip,
    error_body,
    error_type,
)
from hisparse.server.metrics import ServerMetrics
from hisparse.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    Usage,
    unsupported_message,
)

logger = logging.getLogger("hisparse.server")

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids",
                    "ignore_eos", "n", "stop", "logprobs", "top_logprobs", "model", "messages",
                    "prompt", "stream_options", "max_completion_tokens",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                    "min_p", "min_tokens", "bad_words", "kv_transfer_params")
# request fields that carry an output constraint (at most one per request)
_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structured_outputs")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _param_of(message: str, prompt_field: str) -> str | None:
    """The request field an engine ValueError names (its messages start with the field)."""
    m = re.match(r"\s*(?:prompt \d+: )?([a-z_]+)", message)
    if not m:
        return None
    word = m.group(1)
    if word in ("prompt_token_ids", "prompt", "text"):
        return prompt_field
    return word if word in _SAMPLING_FIELDS else None


def _bad(e: ValueError, prompt_field: str, constraint_field: str | None = None) -> APIError:
    msg = str(e)
    if constraint_field is not None and msg.startswith("structured_outputs"):
        # the engine names its own field; the client sent another (response_format, ...)
        head, _, rest = msg.partition(":")
        return APIError(400, f"{constraint_field}{head[len('structured_outputs'):]}:{rest}",
                        constraint_field)
    return APIError(400, msg, _param_of(msg, prompt_field))


def _constraint_field(req) -> str | None:
    """The request field that carries its output constraint (None: unconstrained); 400 when
    several do."""
    used = [f for f in _CONSTRAINT_FIELDS if getattr(req, f) is not None
            and not (f == "response_format" and req.response_format.type == "text")]
    if len(used) > 1:
        raise APIError(400, f"{used[1]}: only one output constraint per request (also got "
                       f"{used[0]})", used[1])
    return used[0] if used else None


def _structured(req) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field carries it."""
    field = _constraint_field(req)
    if field is None:
        return None
    try:
        if field == "response_format":
            rf = req.response_format
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format: type json_schema needs "
                               "json_schema.schema", field)
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        if field == "structured_outputs":
            known = {"json", "json_object", "regex", "choice", "grammar"}
            extra = sorted(set(req.structured_outputs) - known)
            if extra:
                raise APIError(400, f"structured_outputs: unsupported key {extra[0]!r} "
                               f"(supported: {sorted(known)})", field)
            return StructuredOutputsParams(**req.structured_outputs)
        kind = field.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: getattr(req, field)})
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", field) from None


class _State:
    def __init__(self, engine: AsyncLLM, model_name: str, tokenizer, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_model_len = engine.llm.max_model_len


def _server_tokenizer(engine: AsyncLLM):
    """A tokenizer of the server's own: the engine thread detokenizes with the engine's, and
    HF fast tokenizers must not be used from two threads at once."""
    tok = engine.tokenizer
    if tok is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok.name_or_path)
    except Exception:  # noqa: BLE001 - fall back to a deep copy
        import copy

        return copy.deepcopy(tok)


def create_app(engine: AsyncLLM, model_name: str | None = None,
               metrics: ServerMetrics | None = None, *, api_key: str | None = None,
               allowed_origins: list[str] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name`` (default: the model directory's
    name). Owns nothing: the caller shuts the engine down.

    ``api_key``: ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (None: open).
    ``allowed_origins``: CORS origins (``["*"]``: any; None: no CORS headers, preflights get
    405). ``max_request_bytes``: larger bodies get 413."""
    import os

    model_name = model_name or os.path.basename(os.path.normpath(engine.llm.model_dir))
    if metrics is None:
        metrics = ServerMetrics(model_name)
    metrics.attach(engine)
    prev = engine.on_request_finished
    if prev is None:
        engine.on_request_finished = metrics.on_request_finished
    else:
        def both(m, prev=prev):
            prev(m)
            metrics.on_request_finished(m)
        engine.on_request_finished = both
    st = _State(engine, model_name, _server_tokenizer(engine), metrics)
    app = FastAPI(title="hisparse", version=_version())
    app.state.hisparse = st
    if allowed_origins:     # inside the gate (as vLLM): every request is logged and counted
        app.add_middleware(_CORS, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(Gate, max_request_bytes=max_request_bytes, api_key=api_key,
                       on_error=lambda status: metrics.rejected.labels(
                           model_name, str(status)).inc())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(_validation_api_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {404: "no such endpoint", 405: "method not allowed"}.get(
            e.status_code, str(e.detail))
        return _error_response(APIError(e.status_code, f"{request.method} "
                                        f"{clip(request.url.path, 100)}: {what}", None,
                                        error_type(e.status_code)),
                               headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)      # uvicorn logs the traceback (re-raised after this)
    async def _internal_error(request: Request, e: Exception):
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", None,
                                        "server_error"))

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse(error_body(f"engine stopped: {engine.dead}", None,
                                           "server_error", 503), status_code=503)
        return {"status": "ok"}

    card = ModelCard(id=model_name, max_model_len=st.max_model_len)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {clip(model_id, 100)!r} does not exist; this server "
                           f"serves {model_name!r}", "model", "not_found_error")
        return card

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _check_model(st, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text) and messages (chat)",
                           "prompt" if req.prompt is None else "messages")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = _encode(st, req.prompt, "prompt", special)["prompt_token_ids"]
        else:
            ids = _chat_prompt(st, req.messages, req.add_generation_prompt,
                               bool(req.add_special_tokens))["prompt_token_ids"]
        body = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = st.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _check_model(st, req.model)
        if st.tokenizer is None:
            raise APIError(400, "detokenize needs a tokenizer in the model directory",
                           "tokens")
        vocab = engine.llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab})", "tokens")
        return {"prompt": st.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics_endpoint():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        _check_common(st, req)
        if req.echo:
            raise APIError(400, "echo: prompt echo is not supported", "echo")
        if req.best_of is not None and req.best_of != 1:
            raise APIError(400, f"best_of: only best_of=1 is supported (use n for several "
                           f"samples), got {req.best_of}", "best_of")
        prompts = _completion_prompts(st, req.prompt)
        _check_max_tokens(st, prompts, req.max_tokens, "max_tokens")
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = _sampling(req, max_tokens, req.logprobs)
        return await _serve(st, req, prompts, params, chat=False, raw=raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        _check_common(st, req)
        if req.top_logprobs is not None and (
                not req.logprobs or not 0 <= req.top_logprobs <= MAX_LOGPROBS):
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] and "
                           f"needs logprobs=true, got {req.top_logprobs!r}", "top_logprobs")
        prompt = _chat_prompt(st, req.messages, req.add_generation_prompt)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        asked = req.max_completion_tokens or req.max_tokens
        _check_max_tokens(st, [prompt], asked, field)
        max_tokens = asked or st.max_model_len
        params = _sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        return await _serve(st, req, [prompt], params, chat=True, raw=raw)

    return app


class _CORS(CORSMiddleware):
    """Starlette's CORS middleware; a refused preflight gets the OpenAI error shape."""

    def preflight_response(self, request_headers) -> Response:
        r = super().preflight_response(request_headers)
        if r.status_code < 400:
            return r
        return _error_response(APIError(r.status_code, f"CORS preflight refused: "
                                        f"{clip(r.body.decode(errors='replace'), 200)}"))


def _error_response(e: APIError, headers=None) -> JSONResponse:
    return JSONResponse(error_body(clip(e.message), e.param, e.type, e.status),
                        status_code=e.status, headers=headers)


def _validation_api_error(errs) -> APIError:
    """The 400 of pydantic's first error: the field it names, never the input's offset or
    the body itself."""
    first = errs[0] if errs else {}
    kind = first.get("type", "")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    if not loc:
        return APIError(400, "the request body must be a JSON object "
                        "(content-type: application/json)")
    param, where = loc[0], ".".join(loc)
    if kind == "extra_forbidden":
        field = loc[-1]
        msg = unsupported_message(field) if len(loc) == 1 else \
            f"{where}: this field is not supported"
        return APIError(400, msg, param)
    msg = f"{where}: {first.get('msg', 'invalid value')}"
    got = first.get("input")
    if got is not None and not isinstance(got, (dict, list)):
        msg += f" (got {clip(repr(got), 60)})"
    return APIError(400, msg, param)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hisparse")
    except Exception:  # noqa: BLE001
        return "0"


# ---------------------------------------------------------------------- request preparation
def _check_model(st: _State, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise APIError(404, f"model {clip(model, 100)!r} does not exist; this server serves "
                       f"{st.model_name!r}", "model", "not_found_error")


def _check_max_tokens(st: _State, prompts: list[dict], max_tokens: int | None,
                      field: str) -> None:
    """An explicit ``max_tokens`` beyond the context a prompt leaves is a 400 naming the limit
    (as vLLM); a default one is cut to it. A prompt that leaves nothing is the engine's 400."""
    if max_tokens is None:
        return
    for p in prompts:
        n = len(p["prompt_token_ids"])
        if n < st.max_model_len and n + max_tokens > st.max_model_len:
            raise APIError(400, f"{field}: this model's maximum context length is "
                           f"{st.max_model_len} tokens and the prompt has {n}, so at most "
                           f"{st.max_model_len - n} can be generated; got {field}={max_tokens}",
                           field)


def _check_common(st: _State, req) -> None:
    _check_model(st, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.stop is not None:
        if any(not s for s in req.stop_strings()):
            raise APIError(400, "stop strings must not be empty", "stop")
        if st.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer in the model directory; use "
                           "stop_token_ids", "stop")


def _sampling(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, max_tokens=max_tokens,
                              stop_token_ids=list(req.stop_token_ids or []),
                              ignore_eos=req.ignore_eos, logprobs=logprobs,
                              skip_special_tokens=req.skip_special_tokens,
                              frequency_penalty=req.frequency_penalty,
                              presence_penalty=req.presence_penalty,
                              repetition_penalty=req.repetition_penalty,
                              logit_bias=req.logit_bias, min_p=req.min_p,
                              min_tokens=req.min_tokens, bad_words=req.bad_words,
                              structured_outputs=_structured(req),
                              kv_transfer_params=req.kv_transfer_params)
    except ValueError as e:
        raise _bad(e, "prompt") from None


def _encode(st: _State, text: str, field: str, special: bool = True) -> dict:
    if st.tokenizer is None:
        raise APIError(400, "text prompts need a tokenizer in the model directory; send token "
                       "ids", field)
    try:
        ids = st.tokenizer.encode(text, add_special_tokens=special)
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error
        raise APIError(400, f"{field}: the tokenizer failed: {e}", field) from None
    return {"prompt_token_ids": [int(t) for t in ids], "text": text}


def _completion_prompts(st: _State, prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [_encode(st, prompt, "prompt")]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_encode(st, p, "prompt") for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt), "text": None}]
    return [{"prompt_token_ids": list(p), "text": None} for p in prompt]


def _chat_prompt(st: _State, chat: list, add_generation_prompt: bool,
                 add_special_tokens: bool = False) -> dict:
    tok = st.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template (tokenizer_config.json "
                       "chat_template): use /v1/completions", "messages")
    messages = []
    for m in chat:
        content = m.content
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if p.get("type") == "text"]
            if len(parts) != len(content):
                raise APIError(400, "messages: only text content parts are supported",
                               "messages")
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - the template's own error
        raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
    return _encode(st, text, "messages", special=add_special_tokens)


# ---------------------------------------------------------------------- running requests
async def _submit_all(st: _State, prompts: list[dict], params: SamplingParams, n: int,
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
            raise _bad(e, prompt_field, constraint_field) from None
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


async def _serve(st: _State, req, prompts: list[dict], params: SamplingParams, chat: bool,
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
                             _constraint_field(req))
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


async def _finals_unless_disconnected(st: _State, subs, raw: Request
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


def _abort_all(st: _State, subs, finals: asyncio.Future) -> None:
    finals.cancel()
    for r, _ in subs:
        st.engine.abort(r)


async def _last(st: _State, sub) -> RequestOutput:
    last = None
    try:
        async for out in st.engine.stream(*sub):
            last = out
    except EngineDeadError as e:
        raise APIError(503, str(e), None, "server_error") from None
    return last


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(st: _State, subs, rid: str, chat: bool, prompt_lens: list[int],
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


# ---------------------------------------------------------------------- in-process server
class ServerThread:
    """Run ``app`` under uvicorn in a background thread (tests, benchmarks)::

        with ServerThread(app) as srv:
            url = srv.url          # http://127.0.0.1:<free port>
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                     lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="hisparse-http",
                                       daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
