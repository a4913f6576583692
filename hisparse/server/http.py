"""The HTTP edge of the server, in front of every route (an ASGI middleware, :class:`Gate`):
the request-size limit (413 before the body is parsed), the API key on ``/v1/*`` (401), an
access log line per request, and a callback per error status (the rejection counter). Error
bodies have the OpenAI shape and never echo the request.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 32 << 20    # a 128k-token prompt as JSON ids is ~1 MiB
MAX_ERROR_CHARS = 512                   # error messages are cut to this many characters
ACCESS_LOG = "hisparse.server.access"

# What a handler records in ``scope["hisparse"]`` for the access log line.
USAGE_KEY = "hisparse"

Scope = dict[str, Any]   # (this module imports no pydantic / fastapi: the CLI reads its defaults)
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: int | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of an HTTP status."""
    return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            503: "overloaded_error"}.get(status, "invalid_request_error" if status < 500
                                         else "server_error")


def error_json(status: int, message: str, param: str | None = None,
               type_: str | None = None) -> bytes:
    return json.dumps(error_body(clip(message), param, type_ or error_type(status),
                                 status)).encode()


async def _send_error(send: Send, status: int, message: str, headers=()) -> None:
    body = error_json(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware: size limit, API key, access log, error callback.

    ``max_request_bytes``: bodies above it get 413 (by ``Content-Length`` before reading, or
    once the streamed body passes it). ``api_key``: when set, ``/v1/*`` needs
    ``Authorization: Bearer <api_key>`` (401 otherwise; ``OPTIONS`` preflights pass, as in
    vLLM). ``on_error(status)`` is called for every answer >= 400 except 499 (the client left).
    Handlers put ``prompt_tokens`` / ``completion_tokens`` (and the request's ``user``) into
    ``scope["hisparse"]`` for the access log line (method, path, status, latency, tokens).
    """

    def __init__(self, app, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_key: str | None = None,
                 on_error: Callable[[int], None] | None = None) -> None:
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive integer, got "
                             f"{max_request_bytes!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()
        self.on_error = on_error
        self.log = logging.getLogger(ACCESS_LOG)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500          # if nothing is sent (an exception escapes)
        usage = scope.setdefault(USAGE_KEY, {})

        async def send_(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            if not self._authorized(scope):
                await _send_error(send_, 401, "invalid or missing API key: send the header "
                                  "'Authorization: Bearer <key>'",
                                  [(b"www-authenticate", b"Bearer")])
                return
            body = await self._read_body(scope, receive)
            if body is None:
                await _send_error(send_, 413, f"the request body is larger than the server's "
                                  f"limit of {self.max_request_bytes} bytes "
                                  "(--max-request-bytes)", [(b"connection", b"close")])
                return
            await self.app(scope, _replay(body, receive), send_)
        finally:
            self._finished(scope, status, t0, usage)

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope["method"] == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if not (path == "/v1" or path.startswith("/v1/")):
            return True
        got = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(got, self.api_key)

    async def _read_body(self, scope: Scope, receive: Receive) -> list[dict] | None:
        """The request's messages (the body, or a disconnect), or None past the limit."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return None
        msgs, size = [], 0
        while True:
            msg = await receive()
            msgs.append(msg)
            if msg["type"] != "http.request":
                return msgs
            size += len(msg.get("body", b""))
            if size > self.max_request_bytes:
                return None
            if not msg.get("more_body", False):
                return msgs

    def _finished(self, scope: Scope, status: int, t0: float, usage: dict) -> None:
        if status >= 400 and status != 499 and self.on_error is not None:
            self.on_error(status)
        if self.log.isEnabledFor(logging.INFO):
            client = scope.get("client") or ("-", 0)
            user = usage.get("user")
            self.log.info("%s %s %s %d %.1f ms prompt_tokens=%s completion_tokens=%s%s",
                          client[0], scope["method"], clip(scope["path"], 200), status,
                          1e3 * (time.perf_counter() - t0), usage.get("prompt_tokens", "-"),
                          usage.get("completion_tokens", "-"),
                          "" if user is None else f" user={clip(user, 64)!r}")


def _replay(msgs: list[dict], receive: Receive) -> Receive:
    """A ``receive`` that returns ``msgs`` (the body already read), then waits on the real one
    (disconnects)."""
    pending = list(msgs)

    async def receive_() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return receive_
