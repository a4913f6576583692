"""Prefill/decode disaggregation on one machine (issue 23): TTFT and TPOT at a Poisson load
through ``hisparse router`` (a prefill and a decode process sharing the GPU) against one
colocated server, and the NIXL transfer rate against a bulk pinned host-to-device copy.

    python benchmarks/bench_disagg.py --out disagg.json            # H200: the stand-in model
    python benchmarks/bench_disagg.py --model CKPT --device cpu ... # any checkpoint

Every server is a ``hisparse serve`` process (``--load-format dummy`` for the stand-in shape);
the load is :func:`hisparse.bench.serve.run_load` (streaming, random token-id prompts).
``transfer_gb_s`` is the decode's pulled bytes over the summed load times (loads overlap, so
it is a per-load rate); ``transfer_wall_gb_s`` is the bytes over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hisparse.bench.serve import run_load, wait_healthy


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: str) -> tuple[subprocess.Popen, str, str]:
    """A ``python -m hisparse ARGS --port P`` process logging to ``log``: (process, url, log)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "hisparse", *args, "--port", str(port)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def wait_up(proc: subprocess.Popen, url: str, log: str) -> None:
    wait_healthy(proc, url, 600.0, log)


def stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def counters(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name.startswith("hisparse_kv_transfer"):
                out[s.name + (f"_{s.labels['tier']}" if "tier" in s.labels else "")] = s.value
    return out


def bulk_h2d_gb_s(device: str, nbytes: int = 1 << 30) -> float:
    import torch

    if not device.startswith("cuda"):
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the stand-in shape)")
    p.add_argument("--layers", type=int, default=4, help="stand-in depth (default: 4)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="per disaggregated process (the colocated one gets twice)")
    p.add_argument("--host-pool-gib", type=float, default=8.0)
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this")
    p.add_argument("--engine-args", default="", help="more `hisparse serve` flags, one string")
    p.add_argument("--decode-args", default="",
                   help="flags for the decode instance only, e.g. '--mode always-host': every "
                        "prompt row lands in its host pool")
    p.add_argument("--skip-colocated", action="store_true",
                   help="measure only the disaggregated pair (no colocated baseline)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench_disagg_")
    model, extra = a.model, a.engine_args.split()
    if model is None:
        from hisparse.bench.decode import model_shape_config

        model = os.path.join(tmp, "stand_in")
        os.makedirs(model)
        cfg = model_shape_config("tp8-stand-in", a.layers)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(cfg, f)
        extra += ["--load-format", "dummy"]
    with open(os.path.join(model, "config.json")) as f:
        vocab = a.vocab or json.load(f)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(a.input_len)]
               for _ in range(a.num_prompts)]
    common = ["serve", model, "--device", a.device, "--host-pool-gib", str(a.host_pool_gib),
              "--max-model-len", str(a.input_len + a.output_len + 64),
              "--served-model-name", "bench", "--log-interval", "0", *extra]
    util = a.gpu_memory_utilization
    res: dict = {"input_len": a.input_len, "output_len": a.output_len,
                 "num_prompts": a.num_prompts, "request_rate": a.request_rate}

    # two requests before each measurement, prompts not among the measured ones: the first
    # requests compile the prefill kernels (seconds) and the first READs set up NIXL's paths
    warm_prompts = [[rng.randrange(2, vocab) for _ in range(a.input_len)] for _ in range(2)]

    def load(url):
        asyncio.run(run_load(url, "bench", warm_prompts, 8, math.inf, 0))
        return asyncio.run(run_load(url, "bench", prompts, a.output_len, a.request_rate, 0))

    if not a.skip_colocated:
        proc, url, log = start([*common, "--gpu-memory-utilization", str(2 * util)],
                               os.path.join(tmp, "colocated.log"))
        try:
            wait_up(proc, url, log)
            res["colocated"] = load(url)
        finally:
            stop([proc])
    procs = []
    try:
        pre, pre_url, pre_log = start([*common, "--gpu-memory-utilization", str(util), "--kv-role",
                              "prefill"], os.path.join(tmp, "prefill.log"))
        procs.append(pre)
        dec, dec_url, dec_log = start([*common, "--gpu-memory-utilization", str(util), "--kv-role",
                                       "decode", *a.decode_args.split()],
                                      os.path.join(tmp, "decode.log"))
        procs.append(dec)
        wait_up(pre, pre_url, pre_log)
        wait_up(dec, dec_url, dec_log)
        rt, rt_url, rt_log = start(["router", "--prefill", pre_url, "--decode", dec_url],
                           os.path.join(tmp, "router.log"))
        procs.append(rt)
        wait_up(rt, rt_url, rt_log)
        asyncio.run(run_load(rt_url, "bench", warm_prompts, 8, math.inf, 0))
        kv0 = counters(dec_url)     # the warm-up's transfers are not measured
        t = time.perf_counter()
        res["disaggregated"] = asyncio.run(run_load(rt_url, "bench", prompts, a.output_len,
                                                    a.request_rate, 0))
        wall = time.perf_counter() - t
        kv = {k: v - kv0.get(k, 0.0) for k, v in counters(dec_url).items()}
        res["kv_transfer"] = kv
        nbytes = kv.get("hisparse_kv_transfer_bytes_total", 0.0)
        secs = kv.get("hisparse_kv_transfer_seconds_total", 0.0)
        res["transfer_gb_s"] = nbytes / secs / 1e9 if secs else float("nan")
        res["transfer_wall_gb_s"] = nbytes / wall / 1e9
    finally:
        stop(procs)
    res["bulk_h2d_gb_s"] = bulk_h2d_gb_s(a.device)
    c, d = res.get("colocated", {}), res["disaggregated"]
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        if key in c and key in d and c[key]:
            res[f"{key}_ratio"] = d[key] / c[key]
    res["logs"] = tmp
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
