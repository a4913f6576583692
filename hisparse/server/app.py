"""OpenAI-compatible HTTP server over :class:`~hisparse.engine.async_engine.AsyncLLM`.

    engine = AsyncLLM(LLM(model_dir, ...))
    app = create_app(engine, model_name="my-model")
    uvicorn.run(app, host="0.0.0.0", port=8000)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes),
``GET /version``, ``GET /health``, ``GET /metrics``. Every error status has the OpenAI shape
(``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the request field where
one is at fault); bad requests and fields the server does not implement get 400, a full queue
503. :mod:`hisparse.server.http` adds the size limit (413), the API key (401) and the access log;
:mod:`hisparse.server.inputs` turns a request into the engine's inputs (or a 400), and
:mod:`hisparse.server.outputs` runs it and answers, whole or streamed.
"""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hisparse.engine.async_engine import AsyncLLM
from hisparse.engine.sampling import MAX_LOGPROBS
from hisparse.server.http import DEFAULT_MAX_REQUEST_BYTES, Gate, clip, error_body, error_type
from hisparse.server.inputs import (
    APIError,
    ServerState,
    chat_prompt,
    check_common,
    check_max_tokens,
    check_model,
    completion_prompts,
    encode,
    sampling_params,
)
from hisparse.server.metrics import ServerMetrics
from hisparse.server.outputs import serve
from hisparse.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    unsupported_message,
)


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
    st = ServerState(engine, model_name, _server_tokenizer(engine), metrics)
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
        check_model(st, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text) and messages (chat)",
                           "prompt" if req.prompt is None else "messages")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = encode(st, req.prompt, "prompt", special)["prompt_token_ids"]
        else:
            ids = chat_prompt(st, req.messages, req.add_generation_prompt,
                              bool(req.add_special_tokens))["prompt_token_ids"]
        body = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = st.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(st, req.model)
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
        check_common(st, req)
        if req.echo:
            raise APIError(400, "echo: prompt echo is not supported", "echo")
        if req.best_of is not None and req.best_of != 1:
            raise APIError(400, f"best_of: only best_of=1 is supported (use n for several "
                           f"samples), got {req.best_of}", "best_of")
        prompts = completion_prompts(st, req.prompt)
        check_max_tokens(st, prompts, req.max_tokens, "max_tokens")
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = sampling_params(req, max_tokens, req.logprobs)
        return await serve(st, req, prompts, params, chat=False, raw=raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_common(st, req)
        if req.top_logprobs is not None and (
                not req.logprobs or not 0 <= req.top_logprobs <= MAX_LOGPROBS):
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] and "
                           f"needs logprobs=true, got {req.top_logprobs!r}", "top_logprobs")
        prompt = chat_prompt(st, req.messages, req.add_generation_prompt)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        asked = req.max_completion_tokens or req.max_tokens
        check_max_tokens(st, [prompt], asked, field)
        max_tokens = asked or st.max_model_len
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        return await serve(st, req, [prompt], params, chat=True, raw=raw)

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
