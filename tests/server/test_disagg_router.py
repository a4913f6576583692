"""Prefill/decode disaggregation through the router (issue 23): three processes (prefill,
decode, router) started here, driven with the official ``openai`` client; outputs equal a
colocated engine's, with the decode GPU pool too small for the prompts (rows land in its host
pool). Real NIXL over UCX on loopback."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse import LLM, SamplingParams

pytest.importorskip("nixl_cu13")
# NIXL listeners on free ports: these run on one pytest-xdist worker, one at a time
pytestmark = pytest.mark.xdist_group("nixl")

ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "8", "--max-model-len",
          "128", "--max-num-seqs", "8", "--host-pool-gib", "0.02", "--max-num-batched-tokens",
          "64", "--hot-buffer-size", "32", "--threads", "1"]
N_OUT = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "hisparse", *args, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(procs, urls, timeout=120.0):
    deadline = time.monotonic() + timeout
    for proc, url in zip(procs, urls):
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{url} exited: {proc.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not come up")
            time.sleep(0.2)


def metrics(url) -> dict:
    """``{(sample name, "label=value,..." without model_name): value}``."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def cluster(model_dir):
    procs, urls = [], []
    try:
        for role, extra in (("prefill", []), ("decode", ["--num-gpu-blocks", "16",
                                                          "--kv-load-timeout-s", "3"])):
            p, u = start(["serve", model_dir, *ENGINE, "--kv-role", role,
                          "--served-model-name", "tiny", *extra])
            procs.append(p)
            urls.append(u)
        # the router starts beside them (its /health answers once both of theirs do)
        p, u = start(["router", "--prefill", urls[0], "--decode", urls[1]])
        procs.append(p)
        urls.append(u)
        wait_up(procs, urls)
        yield urls, procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def colocated(model_dir, batch):
    ref = LLM(model_dir, device="cpu", dtype="float32", block_size=8, max_model_len=128,
              max_num_seqs=8, host_pool_gib=0.02)
    try:
        return [o.outputs[0].token_ids for o in ref.generate(
            [{"prompt_token_ids": ids} for ids in batch],
            SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True))]
    finally:
        ref.shutdown()


def test_router_outputs_equal_colocated(cluster, model_dir):
    (prefill_url, decode_url, router_url), _ = cluster
    rng = random.Random(7)
    batch = [[rng.randrange(2, 384) for _ in range(rng.randrange(20, 70))] for _ in range(16)]
    want = colocated(model_dir, batch)
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    extra = {"ignore_eos": True, "return_token_ids": True}

    def plain(ids):
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=N_OUT,
                                      temperature=0, extra_body=extra)
        return r.choices[0].model_extra["token_ids"]

    def streamed(ids):
        toks = []
        for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=N_OUT,
                                               temperature=0, stream=True, extra_body=extra):
            if chunk.choices:
                toks += chunk.choices[0].model_extra.get("token_ids") or []
        return toks

    with ThreadPoolExecutor(16) as pool:
        got_plain = list(pool.map(plain, batch))
        got_stream = list(pool.map(streamed, batch))
    assert got_plain == want
    assert got_stream == want
    # chat through the router equals chat on the decode instance alone (colocated there)
    msgs = [{"role": "user", "content": " ".join(f"t{i}" for i in batch[0][:40])}]
    direct = openai.OpenAI(base_url=decode_url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=msgs, max_tokens=N_OUT, temperature=0,
              extra_body={"ignore_eos": True})
    assert (client.chat.completions.create(**kw).choices[0].message.content
            == direct.chat.completions.create(**kw).choices[0].message.content)

    m = metrics(decode_url)
    assert m[("hisparse_kv_transfer_requests_total", "")] == 2 * len(batch) + 1
    assert m[("hisparse_kv_transfer_failures_total", "")] == 0
    assert m[("hisparse_kv_transfer_rows_landed_total", "tier=host")] > 0
    assert m[("hisparse_kv_transfer_bytes_total", "")] > 0
    # the streamed pass repeats the plain pass's prompts: the decode's prefix cache has them
    assert m[("hisparse_kv_transfer_prefix_hit_rows_total", "")] > 0
    # no READ outlived its deadline: nothing quarantined (the stalled-prefill engine tests)
    assert m[("hisparse_kv_transfer_stalled_total", "")] == 0
    assert m[("hisparse_kv_transfer_quarantined_blocks", "")] == 0
    assert m[("hisparse_kv_transfer_quarantined_loads", "")] == 0
    mr = metrics(router_url)
    for kind in ("prefill", "decode"):
        assert mr[("hisparse_router_requests_total", f"kind={kind},outcome=ok")] == (
            2 * len(batch) + 1)
    # both sides' pools return to full (the prefill frees each prompt on the decode's notice)
    deadline = time.monotonic() + 20
    while True:
        mp, md = metrics(prefill_url), metrics(decode_url)
        full = all(m[("hisparse_gpu_blocks_free", "")] == m[("hisparse_gpu_blocks_total", "")]
                   and m[("hisparse_host_blocks_used", "")] == 0 for m in (mp, md))
        if full and mp[("hisparse_kv_transfer_held_requests", "")] == 0:
            break
        assert time.monotonic() < deadline, (mp, md)
        time.sleep(0.2)
    assert mp[("hisparse_kv_transfer_released_total", "")] == 2 * len(batch) + 1
    assert httpx.get(router_url + "/health").json()["status"] == "ok"


def test_killed_prefill_decode_recomputes_and_router_falls_back(cluster, model_dir):
    """Runs last: kills the prefill process."""
    (prefill_url, decode_url, router_url), procs = cluster
    rng = random.Random(8)
    batch = [[rng.randrange(2, 384) for _ in range(rng.randrange(20, 70))] for _ in range(3)]
    want = colocated(model_dir, batch)
    body = {"model": "tiny", "max_tokens": N_OUT, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    params = [httpx.post(prefill_url + "/v1/completions", timeout=60,
                         json=dict(body, prompt=ids, kv_transfer_params={
                             "do_remote_decode": True})).json()["kv_transfer_params"]
              for ids in batch]
    failures = metrics(decode_url)[("hisparse_kv_transfer_failures_total", "")]
    procs[0].kill()
    procs[0].wait(10)
    with ThreadPoolExecutor(3) as pool:      # its KV is gone: the decode recomputes
        got = list(pool.map(lambda a: httpx.post(
            decode_url + "/v1/completions", timeout=60,
            json=dict(body, prompt=a[0], kv_transfer_params=a[1])).json(), zip(batch, params)))
    assert [g["choices"][0]["token_ids"] for g in got] == want
    assert metrics(decode_url)[("hisparse_kv_transfer_failures_total", "")] == failures + 3
    r = httpx.post(router_url + "/v1/completions", timeout=60, json=dict(body, prompt=batch[0]))
    assert r.json()["choices"][0]["token_ids"] == want[0]       # straight to the decode
    assert metrics(router_url)[("hisparse_router_prefill_fallbacks_total", "")] == 1
    assert httpx.get(router_url + "/health").status_code == 503
    deadline = time.monotonic() + 20
    while True:
        md = metrics(decode_url)
        if (md[("hisparse_gpu_blocks_free", "")] == md[("hisparse_gpu_blocks_total", "")]
                and md[("hisparse_host_blocks_used", "")] == 0):
            break
        assert time.monotonic() < deadline, md
        time.sleep(0.2)
