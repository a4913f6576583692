"""The handshake of a KV transfer (issue 23): how a decode instance learns who answers at a
prefill instance's ``remote_host:remote_port`` before it reads a byte from it.

NIXL's own metadata listener loads whatever agent answers at an address (a restarted or
different instance there is loaded under its own name, and the expected one never appears: a
load would only time out). So, as vLLM's NIXL connector does with its side channel, each
instance answers one JSON line on its KV port: its engine (NIXL agent) id, its compatibility
hash and its NIXL agent metadata. The decode side checks the id and the hash against what
the request's ``kv_transfer_params`` name, and only then loads the metadata into its agent.

:class:`HandshakeServer` answers (a daemon thread); :func:`fetch_peer` asks (blocking, with a
timeout: the agent runs it off the engine thread).
"""

from __future__ import annotations

import base64
import json
import socket
import socketserver
import threading
from dataclasses import dataclass

MAX_REPLY_BYTES = 64 << 20      # NIXL metadata of a few registered regions is kilobytes


@dataclass(frozen=True)
class PeerInfo:
    """What a peer answered: its engine id, compatibility hash and NIXL agent metadata."""

    engine_id: str
    compat_hash: str
    metadata: bytes


class HandshakeServer:
    """Answers every connection on ``(host, port)`` (port 0: a free one, see :attr:`port`)
    with one JSON line ``{"engine_id", "compat_hash", "metadata"}`` (metadata base64)."""

    def __init__(self, host: str, port: int, engine_id: str, compat_hash: str,
                 metadata: bytes) -> None:
        reply = (json.dumps({"engine_id": engine_id, "compat_hash": compat_hash,
                             "metadata": base64.b64encode(metadata).decode()}) + "\n").encode()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(5.0)   # a peer that never reads frees its thread
                self.request.sendall(reply)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"kv-handshake-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fetch_peer(host: str, port: int, timeout_s: float) -> PeerInfo:
    """Ask the instance at ``host:port`` who it is. Raises ConnectionError (refused, closed,
    timed out) or ValueError (an answer that is not a handshake) naming the address."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            chunks, n = [], 0
            while not chunks or not chunks[-1].endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if n > MAX_REPLY_BYTES:
                    raise ValueError(f"the handshake reply of {where} exceeds "
                                     f"{MAX_REPLY_BYTES} bytes")
    except OSError as e:
        raise ConnectionError(f"no KV handshake from {where}: {type(e).__name__}: {e}") from None
    try:
        d = json.loads(b"".join(chunks))
        return PeerInfo(str(d["engine_id"]), str(d["compat_hash"]),
                        base64.b64decode(d["metadata"], validate=True))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where} did not answer a KV handshake ({type(e).__name__}: "
                         f"{str(e)[:100]})") from None
