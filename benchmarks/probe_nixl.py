"""NIXL READ rates between two processes on one host, in the shapes hisparse's disaggregation
moves (issue 23: the decode's READs ran at 0.6 GB/s into GPU pages, 1.26 GB/s into the host
pool, against a 55 GB/s pinned copy).

    python benchmarks/probe_nixl.py                               # CPU: DRAM -> DRAM
    python benchmarks/probe_nixl.py --src pinned --dst pinned     # H200: what a decode's loads do
    python benchmarks/probe_nixl.py --src pinned --dst vram       # H200: READs into GPU memory
    python benchmarks/probe_nixl.py --variants default,cma,tcp --shapes standin --json p.json

A *source* process (the prefill: its host pool, pageable or pinned) and a *reader* process
(the decode: DRAM or VRAM) each build a NIXL agent (UCX backend) with a variant's environment
and agent options, exchange metadata over a pipe, then the reader times READs of one 4k-token
prompt:

- ``plan``: the descriptors :func:`hisparse.kv.transfer_plan.transfer_descriptors` makes when the
  blocks are contiguous on both sides (one per layer and region), in one request;
- ``scattered``: every block its own descriptor (a fragmented pool), in one request;
- ``per-layer``: the ``plan`` descriptors split into one request per layer, posted together;
- ``bulk``: one descriptor of the whole rows region (every layer: the transport's ceiling);
- ``plan@2ms``: ``plan`` with completion checked every 2 ms (an engine step's cadence) instead
  of in a tight loop;
- ``copy``: the same bytes copied inside the reader (DRAM: a memcpy; VRAM: a pinned
  host-to-device copy), the local ceiling.

``--proto-info`` adds the protocol UCX chose for the reader's ``ucp_get`` (``UCX_PROTO_INFO``),
e.g. ``zero-copy cma/memory`` (one-sided, same host) or ``multi-frag copy-in tcp/lo``.

Shapes: ``standin`` (the 4-layer stand-in of bench_disagg) and ``v32`` (a DeepSeek-V3.2 TP-8
rank: 61 layers); FP8 rows (656 B) and keys (132 B), 64-token blocks. Each line is the median of
``--repeat`` READs after one warm-up, from posting (``initialize_xfer`` + ``transfer``) to
``DONE``. Variants: see :data:`VARIANTS` (``--list``). ``noprog`` (no NIXL progress thread)
never completes: the source agent, idle in its process, then never progresses UCX's wire-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

ROW_BYTES, KEY_BYTES, BLOCK = 656, 132, 64
SHAPES = {"standin": 4, "v32": 61}

# name -> (UCX environment, agent options: prog (progress thread), threads (num_threads),
# err (ucx_error_handling_mode))
VARIANTS: dict[str, tuple[dict[str, str], dict]] = {
    "default": ({}, {}),
    "tcp": ({"UCX_TLS": "tcp"}, {}),
    "cma": ({"UCX_TLS": "cma,tcp"}, {}),
    "sm": ({"UCX_TLS": "sm,tcp"}, {}),
    "posix": ({"UCX_TLS": "posix,cma,tcp"}, {}),
    "cma-noerr": ({"UCX_TLS": "cma,tcp"}, {"err": "none"}),
    "noerr": ({}, {"err": "none"}),
    "noprog": ({}, {"prog": False}),
    "threads4": ({}, {"threads": 4}),
    "rails1": ({"UCX_MAX_RMA_RAILS": "1"}, {}),
    "tcp-seg256k": ({"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k",
                     "UCX_TCP_RX_SEG_SIZE": "256k"}, {}),
    # the GPU side of one host: VRAM destinations
    "cuda": ({"UCX_TLS": "cuda_copy,cuda_ipc,cma,tcp"}, {}),
    "cuda-noerr": ({"UCX_TLS": "cuda_copy,cuda_ipc,cma,tcp"}, {"err": "none"}),
    "cuda-tcp": ({"UCX_TLS": "cuda_copy,tcp"}, {}),
}


def _agent(name: str, env: dict, opts: dict):
    os.environ.update(env)
    from nixl_cu13 import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=opts.get("prog", True),
                                               backends=[]))
    init = {}
    if opts.get("threads"):
        init["num_threads"] = str(opts["threads"])
    if opts.get("err"):
        init["ucx_error_handling_mode"] = opts["err"]
    agent.create_backend("UCX", init)
    return agent


def _regions(layers: int, blocks: int, mem: str):
    """The rows and keys regions ``[layers, blocks, block bytes]`` (uint8) on ``mem``."""
    import torch

    kw = {"dram": {}, "pinned": {"pin_memory": True}, "vram": {"device": "cuda"}}[mem]
    rows = torch.empty(layers, blocks, BLOCK * ROW_BYTES, dtype=torch.uint8, **kw)
    keys = torch.empty(layers, blocks, BLOCK * KEY_BYTES, dtype=torch.uint8, **kw)
    return rows, keys


def _layout(t, blocks: int):
    from hisparse.kv.transfer_plan import RegionLayout

    return RegionLayout(base=t.data_ptr(), layer_stride=t[0].numel(),
                        block_bytes=t.shape[2], num_layers=t.shape[0], num_blocks=blocks,
                        mem="VRAM" if t.is_cuda else "DRAM",
                        device=(t.device.index or 0) if t.is_cuda else 0)


def source(conn, env, opts, layers, blocks, mem) -> None:
    agent = _agent("probe-src", env, opts)
    rows, keys = _regions(layers, blocks, mem)
    rows.random_(0, 256)
    keys.random_(0, 256)
    regs = [agent.register_memory(t) for t in (rows, keys)]
    conn.send((agent.get_agent_metadata(), _layout(rows, blocks).to_dict(),
               _layout(keys, blocks).to_dict(), int(rows.sum()) + int(keys.sum())))
    conn.recv()                                         # the reader is done
    for r in regs:
        agent.deregister_memory(r)


def _wait(agent, handles, every_s: float) -> None:
    while True:
        states = [agent.check_xfer_state(h) for h in handles]
        if all(s == "DONE" for s in states):
            return
        if any(s not in ("DONE", "PROC") for s in states):
            raise RuntimeError(f"READ failed: {states}")
        if every_s:
            time.sleep(every_s)


def _time(agent, lists, mem, repeat, every_s=0.0) -> float:
    """Median seconds of READs of ``lists`` (one request per (local, remote) pair, together)."""
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        handles = []
        for ld, rd in lists:
            h = agent.initialize_xfer("READ", agent.get_xfer_descs(ld, mem),
                                      agent.get_xfer_descs(rd, "DRAM"), "probe-src")
            if agent.transfer(h) == "ERR":
                raise RuntimeError("posting a READ failed")
            handles.append(h)
        _wait(agent, handles, every_s)
        times.append(time.perf_counter() - t)
        for h in handles:
            agent.release_xfer_handle(h)
    return statistics.median(times[1:])


def _local_copy(rows, keys, repeat) -> float:
    """Median seconds of copying ``rows`` and ``keys`` from same-shaped local sources (pinned
    host ones for VRAM)."""
    import torch

    srcs = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in (rows, keys)]
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        for dst, src in zip((rows, keys), srcs):
            dst.copy_(src, non_blocking=True)
        if rows.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _proto_lines(text: str) -> str:
    """The ``ucp_get`` protocol tables of a ``UCX_PROTO_INFO`` log, one line."""
    out, on, rows = [], False, 0
    for line in text.splitlines():
        if "ucp_get" in line:
            out.append(line.split("|")[1].strip())
            on, rows = True, 0
        elif on and line.count("|") >= 4 and "Range" not in line:
            out.append(" ".join(c.strip() for c in line.split("|")[1:4]))
            rows += 1
        elif on and "+--" in line and rows:
            on = False
    return "; ".join(dict.fromkeys(out)) or "(no ucp_get table printed)"


def reader(conn, env, opts, layers, blocks, mem, repeat, out, proto_info=False) -> None:
    import tempfile

    import numpy as np

    from hisparse.kv.transfer_plan import RegionLayout, transfer_descriptors

    log, saved = None, None
    if proto_info:          # UCX prints its tables to stdout: catch them in a file
        env = dict(env, UCX_PROTO_INFO="y")
        log = tempfile.TemporaryFile(mode="w+")
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
    agent = _agent("probe-dst", env, opts)
    meta, rrows, rkeys, checksum = conn.recv()
    rrows, rkeys = RegionLayout.from_dict(rrows), RegionLayout.from_dict(rkeys)
    rows, keys = _regions(layers, blocks, mem)
    regs = [agent.register_memory(t) for t in (rows, keys)]
    agent.add_remote_agent(meta)
    lmem = "VRAM" if mem == "vram" else "DRAM"
    lrows, lkeys = _layout(rows, blocks), _layout(keys, blocks)
    every = np.arange(blocks)

    def plan(src_blocks):
        pairs = [transfer_descriptors(lrows, rrows, every, src_blocks),
                 transfer_descriptors(lkeys, rkeys, every, src_blocks)]
        return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])

    contiguous = plan(every)
    scattered = plan(np.random.default_rng(0).permutation(blocks))
    per_layer = [(np.ascontiguousarray(contiguous[0][i::layers]),
                  np.ascontiguousarray(contiguous[1][i::layers])) for i in range(layers)]
    for name, lists, every_s in (
            ("plan", [contiguous], 0.0), ("scattered", [scattered], 0.0),
            ("per-layer", per_layer, 0.0), ("plan@2ms", [contiguous], 0.002),
            ("bulk", [(contiguous[0][:1].copy(), contiguous[1][:1].copy())], 0.0)):
        if name == "bulk":   # the first descriptor (rows, layer 0) grown to every layer
            for d in lists[0]:
                d[0, 1] = rows.numel()
        nbytes = sum(int(x[0][:, 1].sum()) for x in lists)
        try:
            s = _time(agent, lists, lmem, repeat, every_s)
            row = {"case": name, "descs": sum(len(x[0]) for x in lists),
                   "requests": len(lists), "mb": nbytes / 1e6, "ms": s * 1e3,
                   "gb_s": nbytes / s / 1e9}
        except Exception as e:  # noqa: BLE001 - a variant's transport may refuse: report it
            row = {"case": name, "error": f"{type(e).__name__}: {e}"[:200]}
        out.append(row)
    # the last READs (bulk rows, plan@2ms keys) put every block in place: the source's bytes
    got = int(rows.sum()) + int(keys.sum())
    if got != checksum:
        out.append({"case": "check", "error": f"checksum {got} != {checksum}"})
    nbytes = int(contiguous[0][:, 1].sum())
    s = _local_copy(rows, keys, repeat)
    out.append({"case": "copy", "descs": 0, "requests": 0, "mb": nbytes / 1e6, "ms": s * 1e3,
                "gb_s": nbytes / s / 1e9})
    if log is not None:
        sys.stdout.flush()
        os.dup2(saved, 1)
        log.seek(0)
        out.append({"case": "proto", "info": _proto_lines(log.read())})
    for r in regs:
        agent.deregister_memory(r)
    conn.send(out)


def run_variant(name, shape, src_mem, dst_mem, repeat, timeout_s,
                proto_info=False) -> list[dict]:
    env, opts = VARIANTS[name]
    layers = SHAPES[shape]
    blocks = 4096 // BLOCK
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    src = ctx.Process(target=source, args=(a, env, opts, layers, blocks, src_mem))
    dst = ctx.Process(target=reader, args=(c, env, opts, layers, blocks, dst_mem, repeat, [],
                                           proto_info))
    src.start()
    dst.start()
    try:
        if not b.poll(timeout_s):
            raise TimeoutError("the source did not start")
        d.send(b.recv())
        if not d.poll(timeout_s):
            raise TimeoutError(f"the READs took over {timeout_s} s")
        rows = d.recv()
        b.send("done")
    except Exception as e:  # noqa: BLE001 - a variant that hangs or dies is a result too
        rows = [{"case": "-", "error": f"{type(e).__name__}: {e}"}]
    for p in (dst, src):
        p.join(10)
        if p.is_alive():
            p.kill()
    return [{"variant": name, "shape": shape, **r} for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="default,tcp,cma,cma-noerr,noprog,threads4",
                   help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--shapes", default="standin,v32", help=f"of {list(SHAPES)}")
    p.add_argument("--src", choices=("dram", "pinned"), default="dram")
    p.add_argument("--dst", choices=("dram", "pinned", "vram"), default="dram")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per variant")
    p.add_argument("--proto-info", action="store_true",
                   help="report the protocol UCX chose for the reader's GETs")
    p.add_argument("--json", default=None)
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    a = p.parse_args(argv)
    if a.list:
        for k, v in VARIANTS.items():
            print(f"{k:14} env={v[0]} opts={v[1]}")
        return 0
    names = a.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            p.error(f"--variants: unknown {n!r}; one of {list(VARIANTS)}")
    results = []
    print(f"{'variant':14} {'shape':8} {'case':10} {'descs':>6} {'reqs':>4} {'MB':>7} "
          f"{'ms':>8} {'GB/s':>7}", flush=True)
    for shape in a.shapes.split(","):
        for n in names:
            for r in run_variant(n, shape, a.src, a.dst, a.repeat, a.timeout, a.proto_info):
                results.append(r)
                if "error" in r:
                    print(f"{n:14} {shape:8} {r['case']:10} ERROR {r['error']}", flush=True)
                elif "info" in r:
                    print(f"{n:14} {shape:8} {r['case']:10} {r['info']}", flush=True)
                else:
                    print(f"{n:14} {shape:8} {r['case']:10} {r['descs']:6d} {r['requests']:4d} "
                          f"{r['mb']:7.1f} {r['ms']:8.2f} {r['gb_s']:7.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"src": a.src, "dst": a.dst, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
