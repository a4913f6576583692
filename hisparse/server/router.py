"""Disaggregation router: an OpenAI-compatible front over prefill and decode instances
(``hisparse router --prefill URL ... --decode URL ... --port N``; issue 23).

Each completion (``/v1/completions``, ``/v1/chat/completions``, streaming or not) goes first
to a prefill instance as a one-token, non-streaming request with ``kv_transfer_params:
{"do_remote_decode": true}``; the params it answers with are added to the original request,
which goes to a decode instance; the decode's answer (or its event stream) is returned as is.
This is vLLM's disaggregation-proxy protocol, so either side may be another vLLM-style engine.
A prefill instance that cannot be reached or fails sends the request straight to a decode
instance, which then computes the prompt itself. Instances are picked by ``least-loaded``
(fewest requests in flight from this router; ties round-robin) or ``round-robin``.
Its own ``/health`` (ok while at least one instance of each kind answers its ``/health``) and
``/metrics`` (``hisparse_router_*``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from hisparse.server.http import error_body

logger = logging.getLogger("hisparse.router")

POLICIES = ("least-loaded", "round-robin")


@dataclass
class Upstream:
    url: str
    kind: str               # "prefill" | "decode"
    in_flight: int = 0


class Pool:
    """Instances of one kind and the pick policy."""

    def __init__(self, urls: list[str], kind: str, policy: str) -> None:
        if not urls:
            raise ValueError(f"the router needs at least one --{kind} URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--{kind} {u!r}: expected an http(s):// URL")
        self.members = [Upstream(u.rstrip("/"), kind) for u in urls]
        self.policy = policy
        self._turn = itertools.count()

    def pick(self) -> Upstream:
        start = next(self._turn) % len(self.members)
        order = self.members[start:] + self.members[:start]
        if self.policy == "round-robin":
            return order[0]
        return min(order, key=lambda u: u.in_flight)


def create_router(prefill: list[str], decode: list[str], policy: str = "least-loaded",
                  timeout_s: float = 600.0) -> FastAPI:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    prefills, decodes = Pool(prefill, "prefill", policy), Pool(decode, "decode", policy)
    registry = CollectorRegistry()
    requests = Counter("hisparse_router_requests", "Requests sent upstream by kind and "
                       "outcome", ["kind", "outcome"], registry=registry)
    in_flight = Gauge("hisparse_router_in_flight", "Requests in flight per upstream",
                      ["kind", "url"], registry=registry)
    fallbacks = Counter("hisparse_router_prefill_fallbacks", "Requests sent to a decode "
                        "instance without remote KV (the prefill failed)", registry=registry)
    for u in prefills.members + decodes.members:
        in_flight.labels(u.kind, u.url).set(0)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
    app = FastAPI(title="hisparse-router")
    app.state.client = client

    def enter(u: Upstream) -> None:
        u.in_flight += 1
        in_flight.labels(u.kind, u.url).set(u.in_flight)

    def leave(u: Upstream) -> None:
        u.in_flight -= 1
        in_flight.labels(u.kind, u.url).set(u.in_flight)

    async def run_prefill(path: str, body: dict, headers: dict) -> dict | None:
        """The decode params from a prefill instance, or None (it failed: recompute)."""
        pre = dict(body, stream=False, max_tokens=1, n=1,
                   kv_transfer_params={"do_remote_decode": True})
        if pre.get("min_tokens"):       # the prefill samples one token
            pre["min_tokens"] = 1
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        u = prefills.pick()
        enter(u)
        try:
            r = await client.post(u.url + path, json=pre, headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill %s unreachable: %s", u.url, e)
            requests.labels("prefill", "unreachable").inc()
            return None
        finally:
            leave(u)
        if r.status_code in (400, 401):   # the request itself is refused: so would the decode
            requests.labels("prefill", "rejected").inc()
            raise _Upstream(r)
        kv = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        if kv is None:
            logger.warning("prefill %s answered %d without kv_transfer_params", u.url,
                           r.status_code)
            requests.labels("prefill", "failed").inc()
            return None
        requests.labels("prefill", "ok").inc()
        return kv

    async def route(path: str, raw: Request):
        try:
            body = await raw.json()
        except ValueError:
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        # the client's API key goes to the instances (each checks it, as vLLM's servers do)
        headers = {k: raw.headers[k] for k in ("authorization",) if k in raw.headers}
        try:
            kv = await run_prefill(path, body, headers)
        except _Upstream as e:
            return Response(e.response.content, status_code=e.response.status_code,
                            media_type="application/json")
        if kv is None:
            fallbacks.inc()
            body.pop("kv_transfer_params", None)
        else:
            body["kv_transfer_params"] = kv
        u = decodes.pick()
        enter(u)
        if body.get("stream"):
            req = client.build_request("POST", u.url + path, json=body, headers=headers)
            try:
                upstream = await client.send(req, stream=True)
            except httpx.HTTPError as e:
                leave(u)
                requests.labels("decode", "unreachable").inc()
                return JSONResponse(error_body(f"decode instance unreachable: {e}", None,
                                               "server_error", 502), status_code=502)

            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()
                    leave(u)
            requests.labels("decode", "ok" if upstream.status_code == 200 else "failed").inc()
            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"))
        try:
            r = await client.post(u.url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            requests.labels("decode", "unreachable").inc()
            return JSONResponse(error_body(f"decode instance unreachable: {e}", None,
                                           "server_error", 502), status_code=502)
        finally:
            leave(u)
        requests.labels("decode", "ok" if r.status_code == 200 else "failed").inc()
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await route("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models():
        r = await client.get(decodes.members[0].url + "/v1/models")
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    async def healthy(u: Upstream) -> bool:
        try:
            return (await client.get(u.url + "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    @app.get("/health")
    async def health():
        ups = prefills.members + decodes.members
        ok = await asyncio.gather(*(healthy(u) for u in ups))
        status = {u.url: ("ok" if good else "down") for u, good in zip(ups, ok)}
        kinds_up = {u.kind for u, good in zip(ups, ok) if good}
        if kinds_up != {"prefill", "decode"}:
            return JSONResponse({"status": "degraded", "upstreams": status}, status_code=503)
        return {"status": "ok", "upstreams": status}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Upstream(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response
