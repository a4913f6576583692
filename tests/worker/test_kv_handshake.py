"""The KV handshake (hisparse/worker/kv_handshake.py): what a peer answers arrives whole, and
an address where no handshake server answers fails with an error naming it."""

import os
import socket
import threading

import pytest

from hisparse.worker.kv_handshake import HandshakeServer, fetch_peer


def test_a_peer_answers_its_id_hash_and_metadata():
    md = os.urandom(200_000)        # larger than one recv: the reply is read whole
    srv = HandshakeServer("127.0.0.1", 0, "engine-a", "f" * 32, md)
    try:
        for _ in range(2):          # every connection gets the answer
            info = fetch_peer("127.0.0.1", srv.port, 5.0)
            assert (info.engine_id, info.compat_hash, info.metadata) == ("engine-a", "f" * 32, md)
    finally:
        srv.close()


def test_no_handshake_at_the_address_is_a_clear_error():
    with socket.socket() as s:      # a closed port: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        fetch_peer("127.0.0.1", port, 2.0)
    lst = socket.socket()           # something else listens there and answers garbage
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)

    def answer():
        conn, _ = lst.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    port = lst.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=f"127.0.0.1:{port} did not answer a KV handshake"):
            fetch_peer("127.0.0.1", port, 2.0)
    finally:
        t.join(5)
        lst.close()
