"""Prefill/decode disaggregation, scheduler side: the request-level protocol and the descriptor
plans of a KV transfer (DESIGN.md §7, last bullet; issue 23). Pure Python and numpy.

Protocol (vLLM's ``kv_transfer_params``, so a vLLM-style disaggregation proxy can drive it):

- a prefill request carries ``{"do_remote_decode": true}``: the prefill instance computes its
  prompt (``max_tokens=1`` semantics), keeps the prompt's host blocks until the decode side
  notifies it read them (or a timeout frees them) and answers with the params of the decode
  request: ``do_remote_prefill``, ``remote_engine_id`` (its NIXL agent name),
  ``remote_request_id``, ``remote_block_ids`` (``{"host": [...]}``: one host block per prompt
  page; MLA rows and indexer keys share host block ids), ``remote_host`` / ``remote_port`` (its
  KV handshake server: :mod:`hisparse.worker.kv_handshake`), ``num_remote_tokens`` (the prompt
  rows held), ``first_token`` (sampled by the prefill), ``compat_hash`` and ``remote_layout``
  (its registered regions);
- a decode request carrying them is admitted in a *waiting for remote KV* state: the KV core
  allocates the destination blocks (:meth:`KVCoordinator.admit_remote
  <hisparse.kv.coordinator.KVCoordinator.admit_remote>`), the worker pulls with NIXL READs
  (decode-initiated) into its host pool and notifies the prefill instance, the KV core
  restores the GPU-resident pages from there (:class:`LoadJob`), then the request decodes
  from its first token.

Layouts: every registered region (host pool, host indexer keys) is ``[num_layers, num_blocks,
block_bytes]`` bytes at ``base + layer * layer_stride + block * block_bytes``
(:class:`RegionLayout`): MLA rows (656-B FP8 or bf16 rows, ``block_size`` per block), bf16
indexer keys and FP8 indexer key pages alike. A transfer moves the same blocks of every layer,
one descriptor per (layer, run of blocks contiguous on both sides).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

KV_ROLES = ("prefill", "decode")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# Region names: the registered host regions, MLA rows and indexer keys.
REGIONS = ("host", "host_indexer")


@dataclass(frozen=True)
class RegionLayout:
    """One registered region: ``num_layers`` layers of ``num_blocks`` blocks of ``block_bytes``
    bytes; ``mem`` is NIXL's memory type (``"DRAM"`` / ``"VRAM"``), ``device`` its device id."""

    base: int
    layer_stride: int
    block_bytes: int
    num_layers: int
    num_blocks: int
    mem: str
    device: int = 0

    def __post_init__(self) -> None:
        if self.mem not in ("DRAM", "VRAM"):
            raise ValueError(f"mem must be 'DRAM' or 'VRAM', got {self.mem!r}")
        for name in ("base", "layer_stride", "block_bytes", "num_layers", "num_blocks",
                     "device"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> RegionLayout:
        if not isinstance(d, dict):
            raise ValueError(f"a region layout must be an object, got {d!r}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"bad region layout {d!r}: {e}") from None


def block_runs(src_blocks, dst_blocks) -> np.ndarray:
    """Split two parallel block lists into runs contiguous on both sides.

    Returns int64 ``[n, 3]`` rows ``(src_start, dst_start, count)``; concatenating the runs
    gives back ``(src_blocks, dst_blocks)`` in order.
    """
    src = np.asarray(src_blocks, dtype=np.int64).ravel()
    dst = np.asarray(dst_blocks, dtype=np.int64).ravel()
    if src.shape != dst.shape:
        raise ValueError(f"block lists differ in length: {src.size} vs {dst.size}")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if (src < 0).any() or (dst < 0).any():
        raise ValueError("block ids must be >= 0")
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return np.stack((src[starts], dst[starts], counts), axis=1)


def run_descriptors(layout: RegionLayout, starts, counts) -> np.ndarray:
    """NIXL descriptors ``(addr, len, device)`` (uint64 ``[num_layers * n, 3]``, layer-major)
    of runs of ``counts[i]`` blocks from block ``starts[i]``, in every layer of ``layout``."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if starts.size and (starts.min() < 0 or (starts + counts).max() > layout.num_blocks):
        raise ValueError(f"block runs exceed the region's {layout.num_blocks} blocks")
    layers = np.arange(layout.num_layers, dtype=np.int64)[:, None]
    addr = layout.base + layers * layout.layer_stride + starts[None, :] * layout.block_bytes
    length = np.broadcast_to(counts[None, :] * layout.block_bytes, addr.shape)
    dev = np.full(addr.shape, layout.device, dtype=np.int64)
    return np.stack((addr.ravel(), length.ravel(), dev.ravel()), axis=1).astype(np.uint64)


def transfer_descriptors(local: RegionLayout, remote: RegionLayout, local_blocks,
                         remote_blocks) -> tuple[np.ndarray, np.ndarray]:
    """Matching local and remote descriptor lists (one per layer and contiguous run) that move
    ``remote_blocks[i]`` of ``remote`` to ``local_blocks[i]`` of ``local``, every layer."""
    if (local.num_layers, local.block_bytes) != (remote.num_layers, remote.block_bytes):
        raise ValueError(f"layouts differ: {local.num_layers} layers x {local.block_bytes} B "
                         f"here, {remote.num_layers} x {remote.block_bytes} B remote")
    runs = block_runs(remote_blocks, local_blocks)
    return (run_descriptors(local, runs[:, 1], runs[:, 2]),
            run_descriptors(remote, runs[:, 0], runs[:, 2]))


def compat_hash(**fields) -> str:
    """A digest of what both instances must agree on (model, block size, KV format, layers)."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's validated ``kv_transfer_params`` (``do_remote_prefill``)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    host_blocks: tuple[int, ...]
    num_tokens: int
    first_token: int
    compat_hash: str
    layout: dict            # region name -> RegionLayout (the remote's host regions)
    # wall-clock time (time.time()) after which the prefill may reuse the blocks; None: unknown
    hold_until: float | None = None

    @classmethod
    def parse(cls, params: dict, block_size: int) -> RemotePrefill:
        """Validate the params a prefill instance returned; ValueError names the field."""
        def need(name, kind):
            v = params.get(name)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a {kind.__name__}, "
                                 f"got {v!r}")
            return v

        ids = need("remote_block_ids", dict).get("host")
        if not isinstance(ids, list) or not all(isinstance(b, int) and b >= 0 for b in ids):
            raise ValueError(f"kv_transfer_params.remote_block_ids.host must be a list of "
                             f"block ids >= 0, got {ids!r}")
        n = need("num_remote_tokens", int)
        if n < 1 or len(ids) != -(-n // block_size):
            raise ValueError(f"kv_transfer_params: {len(ids)} remote blocks cannot hold "
                             f"num_remote_tokens={n} rows of block_size {block_size}")
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be in [1, 65535], got {port}")
        first = need("first_token", int)
        if first < 0:
            raise ValueError(f"kv_transfer_params.first_token must be >= 0, got {first}")
        layout = need("remote_layout", dict)
        regions = {}
        for name in REGIONS:
            if name not in layout:
                raise ValueError(f"kv_transfer_params.remote_layout lacks {name!r}")
            try:
                regions[name] = RegionLayout.from_dict(layout[name])
            except ValueError as e:
                raise ValueError(f"kv_transfer_params.remote_layout.{name}: {e}") from None
        hold_until = params.get("remote_hold_until")
        if hold_until is not None and (not isinstance(hold_until, (int, float))
                                       or isinstance(hold_until, bool)):
            raise ValueError(f"kv_transfer_params.remote_hold_until must be a number (seconds "
                             f"since the epoch), got {hold_until!r}")
        return cls(engine_id=need("remote_engine_id", str),
                   request_id=need("remote_request_id", str), host=need("remote_host", str),
                   port=port, host_blocks=tuple(ids), num_tokens=n, first_token=first,
                   compat_hash=need("compat_hash", str), layout=regions,
                   hold_until=None if hold_until is None else float(hold_until))


@dataclass(frozen=True)
class LoadJob:
    """What the worker pulls for one decode request: prompt page ``first_page + i`` from the
    remote host block ``remote.host_blocks[first_page + i]`` into ``host_blocks[i]`` of the
    host pool (its MLA rows) and of the host indexer keys (its keys). Every READ lands in host
    memory, the authoritative tier: one local memory type, and no READ into GPU memory, which
    UCX can only reach from a peer's host memory through bounce buffers (issue 23: 0.6 GB/s
    into GPU pages against 1.26 GB/s into the host pool). The KV core then restores the pages
    that live on GPU (``gpu_blocks[i] >= 0``; -1: the page is read from the host pool through
    the hot buffer) and every page's keys (into ``indexer_blocks[i]``) with host-to-device
    copies of the first plan after the load (:meth:`KVCoordinator.finish_remote
    <hisparse.kv.coordinator.KVCoordinator.finish_remote>`). All lists are int32 over the
    pulled pages; the pages before ``first_page`` were prefix-cache hits of the decode
    instance."""

    req_id: str
    remote: RemotePrefill
    gpu_blocks: np.ndarray
    host_blocks: np.ndarray
    indexer_blocks: np.ndarray
    first_page: int = 0

    @property
    def gpu_pages(self) -> np.ndarray:
        return np.flatnonzero(self.gpu_blocks >= 0)

    def read_targets(self) -> np.ndarray:
        """The host blocks this load's READs write (rows and keys: they share block ids)."""
        return self.host_blocks
