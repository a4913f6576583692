"""`hisparse.bench.serve.wait_healthy`: a server that dies says why (its log's last lines)."""

import subprocess
import sys

import pytest

from hisparse.bench.serve import wait_healthy


def test_a_server_that_exits_raises_with_its_log_tail(tmp_path):
    log = tmp_path / "server.log"
    code = "import sys; print('starting'); print('error: host_pool_gib 8 cannot be pinned'); " \
           "sys.exit(2)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    with pytest.raises(RuntimeError, match=r"exited with 2(.|\n)*host_pool_gib 8 cannot"):
        wait_healthy(proc, "http://127.0.0.1:9", timeout=30, log=str(log))
