"""KV transfer between a prefill and a decode instance over NIXL (issue 23; DESIGN.md §7).

:class:`KVTransferAgent` registers this engine's host regions (host pool, host indexer keys:
DRAM, pinned on CUDA) with a NIXL agent (UCX backend) whose handshake server
(:mod:`hisparse.worker.kv_handshake`) tells peers who it is. Both sides read and write host
memory only: a READ lands in the decode's host pool, and the KV core restores the GPU pages
from there (:class:`~hisparse.kv.transfer_plan.LoadJob`). The request protocol and the
descriptor plans are in :mod:`hisparse.kv.transfer_plan`; this module moves bytes and reports,
it decides nothing. UCX's transports are UCX's own settings (``UCX_TLS`` and the other
``UCX_*`` variables of the server's environment; ``benchmarks/probe_nixl.py`` compares them).

- Prefill side: the held prompt rows are read from its host pool (the authoritative, durable
  copy: write-through mirrors). :meth:`KVTransferAgent.poll_notifications` returns the request
  ids the decode side finished reading.
- Decode side: :meth:`KVTransferAgent.start_load` takes a :class:`LoadJob` and, like
  :meth:`poll` (once per engine step), walks it as far as it goes without blocking: the
  handshake (the peer at ``remote_host:remote_port`` must be the engine the params name, with
  our compatibility hash; then its NIXL metadata is loaded), one READ (descriptors per layer,
  region and run of blocks contiguous on both sides), then a ``read:<request id>``
  notification to the prefill instance. On CUDA a READ waits for the device work queued
  before its load started: its host blocks come fresh from the pool, but a block can return
  there while a queued step still reads it (a request freed after the plan that restores its
  landed rows into GPU pages was built, before that copy ran), and a READ landing then would
  tear the GPU pages being restored. Elsewhere it is posted at once. A load fails on a
  hash mismatch, a wrong peer, a NIXL error (a prefill instance that dies mid-READ) or its
  deadline (a dead, stalled or unreachable prefill instance): ``load_timeout_s`` after it
  started, in any state, or, once its READs are posted, the prefill's hold of the blocks
  (``remote_hold_until`` less :data:`HOLD_MARGIN_S`: READs are not posted past it, and READs
  ending after it are refused).
- Stuck READs: a load that fails or is aborted while a READ of it is in flight is
  *quarantined*: the request is reported failed at once (it recomputes in fresh blocks),
  but the blocks the READ targets stay out of the pools (:meth:`take_quarantined`; the KV
  core holds them) until NIXL reports the READ ``DONE`` or ``ERR``
  (:meth:`poll_quarantine`). Nothing else is safe with NIXL 1.5.1's UCX backend: releasing
  a handle in ``PROC`` cancels nothing of an RMA READ (``ucp_request_cancel`` cancels tag
  receives only; ``ucp_request_free`` lets the READ run on and free itself when it
  completes), and ``remove_remote_agent`` neither ends it (every in-flight handle keeps a
  reference to the connection) nor closes the endpoint by force (1.5.1 closes in flush
  mode). So a stalled prefill that resumes writes into quarantined blocks only, and a
  prefill that never resumes (nor dies) keeps its loads' blocks quarantined until this
  agent closes: a bounded leak of the prompts it had handed off, shown by
  ``hisparse_kv_transfer_quarantined_blocks``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hisparse.kv.transfer_plan import (
    REGIONS,
    LoadJob,
    RegionLayout,
    RemotePrefill,
    transfer_descriptors,
)
from hisparse.worker.cache import KVCaches
from hisparse.worker.kv_handshake import HandshakeServer, fetch_peer

logger = logging.getLogger(__name__)

NOTIF_READ = b"read:"
# READs must end this long before the prefill's hold expires (``remote_hold_until``; covers
# the clock skew of two hosts on NTP): after it the prefill may reuse the blocks being read
HOLD_MARGIN_S = 2.0
READY = "ready"


def region_layout(t: torch.Tensor, num_blocks: int) -> RegionLayout:
    """The :class:`RegionLayout` of a ``[layers, ...]`` cache tensor of ``num_blocks`` blocks
    per layer (rows ``[L, blocks * block_size, W]`` or FP8 key pages ``[L, blocks, bytes]``)."""
    if not t.is_contiguous():
        raise ValueError("a registered cache region must be contiguous")
    es = t.element_size()
    layer_bytes = t[0].numel() * es if t.shape[0] else 0
    return RegionLayout(base=t.data_ptr(), layer_stride=layer_bytes,
                        block_bytes=layer_bytes // num_blocks if num_blocks else 0,
                        num_layers=t.shape[0], num_blocks=num_blocks,
                        mem="VRAM" if t.is_cuda else "DRAM",
                        device=(t.device.index or 0) if t.is_cuda else 0)


@dataclass
class TransferMetrics:
    """Counters of both roles (``hisparse_kv_transfer_*`` in the server's /metrics)."""

    requests: int = 0          # loads completed (decode)
    failures: int = 0          # loads failed: hash mismatch, NIXL error, timeout (decode)
    bytes: int = 0             # bytes read by completed loads (decode)
    seconds: float = 0.0       # summed start-to-done time of completed loads (decode)
    rows_gpu: int = 0          # prompt rows landed for GPU pages (restored there) (decode)
    rows_host: int = 0         # prompt rows landed for the host tier only (decode)
    prefix_hit_rows: int = 0   # prompt rows not pulled: prefix-cache hits here (decode)
    stalled: int = 0           # failed or aborted loads whose READs were still in flight (decode)
    quarantined_loads: int = 0  # ... of them whose READs have not ended yet (a gauge) (decode)
    held: int = 0              # prompts held for a remote decode (prefill)
    released: int = 0          # held prompts released on the decode's notification (prefill)
    expired: int = 0           # held prompts freed by the timeout (prefill)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Load:
    job: LoadJob
    started: float
    deadline: float
    event: object = None                      # torch.cuda.Event on CUDA: the device gate
    state: str = "handshake"                  # (device ->) handshake -> reading -> done
    handles: list = field(default_factory=list)
    nbytes: int = 0
    error: str | None = None                  # set when cancelled

    def expired(self, now: float) -> str | None:
        """Why the load is past its deadline (None: it is not): ``load_timeout_s`` since it
        started, or, once its READs are posted, the prefill's hold of the blocks less
        :data:`HOLD_MARGIN_S` (before, the handshake's verdict comes first; READs are not
        posted past the hold: :meth:`hold_expired`)."""
        remote = self.job.remote
        if now > self.deadline:
            return (f"KV load timed out after {self.deadline - self.started:g} s in state "
                    f"{self.state!r} (prefill instance {remote.engine_id!r} at "
                    f"{remote.host}:{remote.port})")
        return self.hold_expired() if self.state == "reading" else None

    def hold_expired(self) -> str | None:
        """Why rows read now may be stale: the prefill's hold of them ends within
        :data:`HOLD_MARGIN_S` (None: they are held)."""
        remote = self.job.remote
        if remote.hold_until is None or time.time() <= remote.hold_until - HOLD_MARGIN_S:
            return None
        return (f"the hold of the prompt's blocks by prefill instance {remote.engine_id!r} at "
                f"{remote.host}:{remote.port} ends before the READs from it (in state "
                f"{self.state!r}; margin {HOLD_MARGIN_S:g} s): the rows may be overwritten")


class KVTransferAgent:
    """One NIXL agent over an engine's caches. ``name`` is the agent (and engine) id peers
    address; ``host:port`` its handshake server (port 0: a free one, :attr:`port` after);
    ``compat`` the compatibility hash both sides must share."""

    def __init__(self, caches: KVCaches, name: str, host: str, port: int | None, compat: str,
                 load_timeout_s: float = 30.0) -> None:
        try:
            from nixl_cu13 import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError("prefill/decode disaggregation needs NIXL: pip install "
                               "--no-deps nixl-cu13==1.5.1") from e
        cfg = caches.cfg
        self.name, self.host, self.compat = name, host, compat
        self.load_timeout_s = load_timeout_s
        self.device = caches.device
        # NIXL's progress thread (its default) is needed: without it an idle prefill agent
        # never progresses UCX's connection wire-up and the READs never complete
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True,
                                                        enable_listen_thread=False,
                                                        backends=["UCX"]))
        # (no host tier: nothing to register; the KV core refuses remote prefills then)
        n = cfg.num_host_blocks if cfg.uses_host else 0
        tensors = {"host": (caches.host, n), "host_indexer": (caches.host_indexer, n)}
        self.layouts: dict[str, RegionLayout] = {}
        self._registered = []
        for region, (t, blocks) in tensors.items():
            self.layouts[region] = region_layout(t, blocks)
            if t.numel():
                self._registered.append(self.agent.register_memory(t))
        self._server = HandshakeServer(host, port or 0, name, compat,
                                       self.agent.get_agent_metadata())
        self.port = self._server.port
        self._handshakes = ThreadPoolExecutor(2, thread_name_prefix="kv-handshake")
        self.block_size = cfg.block_size
        self.metrics = TransferMetrics()
        self._loads: dict[str, _Load] = {}
        # (engine id, host, port) -> the handshake in progress or done (a Future), or READY
        self._remotes: dict[tuple[str, str, int], Future | str] = {}
        self._done: list[tuple[str, str | None]] = []
        # (peer, its request id, deadline): failed loads whose peer is still to be told
        self._goodbyes: list[tuple[str, str, float]] = []
        # failed loads whose READs may still write their blocks: the ones the KV core has
        # not quarantined yet (take_quarantined), and all of them until the READs end
        self._new_quarantine: list[LoadJob] = []
        self._quarantine: list[_Load] = []

    def remote_layout(self) -> dict:
        """What a decode instance needs to address our held rows (``remote_layout``)."""
        return {r: self.layouts[r].to_dict() for r in REGIONS}

    # ------------------------------------------------------------------ prefill side
    def poll_notifications(self) -> list[str]:
        """Request ids whose held rows a decode instance finished reading."""
        done = []
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(NOTIF_READ):
                    done.append(msg[len(NOTIF_READ):].decode())
        return done

    # ------------------------------------------------------------------ decode side
    def start_load(self, job: LoadJob) -> None:
        """Begin pulling ``job`` (never blocks; :meth:`poll` reports its end). A
        compatibility-hash mismatch fails it at once: no byte is read."""
        now = time.monotonic()
        load = _Load(job, now, now + self.load_timeout_s)
        remote = job.remote
        if remote.compat_hash != self.compat:
            self._done.append((job.req_id, f"KV compatibility hash mismatch: remote "
                                           f"{remote.compat_hash}, local {self.compat} (model, "
                                           f"block size, KV format or layer count differ)"))
            self.metrics.failures += 1
            return
        if self.device.type == "cuda":
            load.event = torch.cuda.Event()
            load.event.record()
            load.state = "device"
        key = (remote.engine_id, remote.host, remote.port)
        peer = self._remotes.get(key)
        if peer is None or (peer is not READY and peer.done() and peer.exception()):
            self._remotes[key] = self._handshakes.submit(fetch_peer, remote.host, remote.port,
                                                         self.load_timeout_s)
        self._loads[job.req_id] = load
        self._service(job.req_id, load, now)    # a known peer, no device work: posted now

    def cancel(self, req_id: str) -> None:
        """Stop a load (the request was aborted); :meth:`poll` reports it failed."""
        load = self._loads.get(req_id)
        if load is not None:
            load.error = "aborted"

    def poll(self) -> list[tuple[str, str | None]]:
        """Loads that ended since the last call: ``(request id, None)`` when every row landed,
        ``(request id, why)`` when the load failed or was cancelled. A failed load whose READs
        are still in flight is in :meth:`take_quarantined` too: take those first."""
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            self._service(req_id, load, now)
        if self._goodbyes:
            self._send_goodbyes(now)
        done, self._done = self._done, []
        return done

    def _service(self, req_id: str, load: _Load, now: float) -> None:
        """Advance one load; one that ended (landed, failed or cancelled) goes to the next
        :meth:`poll`'s answer."""
        error = load.error
        if error is None:
            try:
                error = self._advance(load)
            except Exception as e:  # noqa: BLE001 - NIXL's own error, reported
                error = f"NIXL transfer failed: {type(e).__name__}: {e}"
        if error is None and load.state != "done":
            error = load.expired(now)
            if error is None:
                return
        del self._loads[req_id]
        if error is not None:
            self._end_failed(load, error)
        self._done.append((req_id, error))

    def _end_failed(self, load: _Load, error: str) -> None:
        """A failed or cancelled load: release its READs, or quarantine it while one is still
        in flight (or cannot be released); tell the prefill instance either way."""
        if load.error is None:      # not a cancellation
            self.metrics.failures += 1
        if self._in_flight(load) or not self._release(load):
            load.error = error
            self._quarantine.append(load)
            self._new_quarantine.append(load.job)
            self.metrics.stalled += 1
            self.metrics.quarantined_loads += 1
            remote = load.job.remote
            logger.warning("request %s: its NIXL READs from %r at %s:%s are still in flight; "
                           "%d blocks quarantined until they end", load.job.req_id,
                           remote.engine_id, remote.host, remote.port,
                           len(load.job.read_targets()))
        self._notify_done(load)

    def take_quarantined(self) -> list[LoadJob]:
        """The jobs of loads :meth:`poll` reported failed whose READs may still write their
        blocks: the caller keeps those blocks out of its pools (KVCoordinator.quarantine)
        before freeing the requests, until :meth:`poll_quarantine` returns the job."""
        jobs, self._new_quarantine = self._new_quarantine, []
        return jobs

    def poll_quarantine(self) -> list[LoadJob]:
        """Quarantined jobs whose READs all ended (NIXL reports each ``DONE``, or ``ERR``: the
        peer died or dropped the connection) and whose handles are released: their blocks
        may be reused."""
        if not self._quarantine:
            return []
        ended, left = [], []
        for load in self._quarantine:
            if not self._in_flight(load) and self._release(load):
                ended.append(load.job)
            else:
                left.append(load)
        self._quarantine = left
        self.metrics.quarantined_loads = len(left)
        return ended

    def _advance(self, load: _Load) -> str | None:
        remote = load.job.remote
        if load.state == "device":
            if not load.event.query():
                return None
            load.state = "handshake"
        if load.state == "handshake":
            ready, error = self._peer(remote)
            if not ready:
                return error
            error = load.hold_expired()
            if error is not None:
                return error
            self._post_reads(load)
            load.state = "reading"
        try:
            states = [self.agent.check_xfer_state(h) for h in load.handles]
        except Exception as e:  # noqa: BLE001 - NIXL raises on a peer that went away
            states = [f"{type(e).__name__}: {e}"]
        if any(st not in ("DONE", "PROC") for st in states):
            bad = next(st for st in states if st not in ("DONE", "PROC"))
            return (f"NIXL READ from {remote.engine_id!r} at {remote.host}:{remote.port} failed "
                    f"({bad}): the prefill instance died or dropped the connection mid-transfer")
        if all(s == "DONE" for s in states):
            error = load.hold_expired()
            if error is not None:
                return error
            self._release(load)
            self.agent.send_notif(remote.engine_id, NOTIF_READ + remote.request_id.encode())
            self._landed(load)
            load.state = "done"
        return None

    def _peer(self, remote: RemotePrefill) -> tuple[bool, str | None]:
        """Whether the handshake with ``remote``'s instance is done: ``(True, None)``, not
        yet ``(False, None)``, or failed ``(False, why)`` (a later load asks again)."""
        key = (remote.engine_id, remote.host, remote.port)
        peer = self._remotes.get(key)
        if peer is None:   # another load's failed answer was dropped: ask again
            peer = self._remotes[key] = self._handshakes.submit(
                fetch_peer, remote.host, remote.port, self.load_timeout_s)
        if peer is READY:
            return True, None
        if not peer.done():
            return False, None
        if peer.exception() is not None:
            return False, str(peer.exception())
        ok, why = self._admit_peer(peer.result(), remote)
        if not ok:   # ask again next time: the right instance may answer there later
            self._remotes.pop(key, None)
        return ok, why

    def _admit_peer(self, info, remote) -> tuple[bool, str | None]:
        """Check a handshake's answer against the params and load the peer's metadata."""
        where = f"{remote.host}:{remote.port}"
        key = (remote.engine_id, remote.host, remote.port)
        if info.engine_id != remote.engine_id:
            return False, (f"the KV peer at {where} is engine {info.engine_id!r}, not "
                           f"{remote.engine_id!r} (another instance answers there)")
        if info.compat_hash != self.compat:
            return False, (f"KV compatibility hash mismatch at the handshake with "
                           f"{remote.engine_id!r} at {where}: remote {info.compat_hash}, local "
                           f"{self.compat} (model, block size, KV format or layer count "
                           f"differ)")
        name = self.agent.add_remote_agent(info.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != remote.engine_id:    # metadata of another agent than the one it claims
            self.agent.remove_remote_agent(name)
            return False, (f"the KV peer at {where} sent the NIXL metadata of agent {name!r}, "
                           f"not of {remote.engine_id!r}")
        self._remotes[key] = READY
        return True, None

    def _in_flight(self, load: _Load) -> bool:
        """Whether a READ of ``load`` is still in progress (an errored one is not)."""
        for h in load.handles:
            try:
                if self.agent.check_xfer_state(h) == "PROC":
                    return True
            except Exception:  # noqa: BLE001 - NIXL raises on a peer that went away
                pass
        return False

    def _notify_done(self, load: _Load) -> None:
        """Tell the prefill instance a failed or cancelled load is done with its blocks (it
        frees them at once instead of at its timeout): now, or once its metadata arrives
        (until the load's deadline). Best effort: a gone peer's timeout frees them."""
        remote = load.job.remote
        if load.job.remote.compat_hash == self.compat:
            self._goodbyes.append((remote.engine_id, remote.request_id, load.deadline))

    def flush_notifications(self) -> None:
        """Send the pending notifications of failed loads (also done by :meth:`poll`)."""
        if self._goodbyes:
            self._send_goodbyes(time.monotonic())

    def _send_goodbyes(self, now: float) -> None:
        left = []
        for name, req_id, deadline in self._goodbyes:
            try:
                if self.agent.check_remote_metadata(name):
                    self.agent.send_notif(name, NOTIF_READ + req_id.encode())
                    continue
            except Exception:  # noqa: BLE001 - the peer may be gone
                continue
            if now < deadline:
                left.append((name, req_id, deadline))
        self._goodbyes = left

    def _post_reads(self, load: _Load) -> None:
        job, remote = load.job, load.job.remote
        rblocks = np.asarray(remote.host_blocks, dtype=np.int64)[job.first_page:]
        ld, rd = zip(*(transfer_descriptors(self.layouts[r], remote.layout[r], job.host_blocks,
                                            rblocks) for r in REGIONS))
        local, remote_descs = np.concatenate(ld), np.concatenate(rd)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote_descs, "DRAM"),
                                            remote.engine_id)
        load.handles.append(handle)
        load.nbytes += int(local[:, 1].sum())
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("posting the READ failed")

    def _landed(self, load: _Load) -> None:
        job, bs, m = load.job, self.block_size, self.metrics
        n = job.remote.num_tokens - job.first_page * bs        # rows pulled
        rows = np.minimum(n - np.arange(len(job.gpu_blocks)) * bs, bs)
        gpu = int(rows[job.gpu_pages].sum())
        m.requests += 1
        m.bytes += load.nbytes
        m.seconds += time.monotonic() - load.started
        m.rows_gpu += gpu
        m.rows_host += n - gpu
        m.prefix_hit_rows += job.first_page * bs

    def _release(self, load: _Load) -> bool:
        """Release the transfer handles of ``load`` (call once none is in flight: a release
        in ``PROC`` would not stop the READ); False if one could not be (try again later)."""
        kept = []
        for h in load.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - NIXL could not cancel it yet
                kept.append(h)
        load.handles = kept
        return not kept

    def close(self) -> None:
        """Shut the agent down (``engine.startup.stop``: before the caches are freed). The
        NIXL agent is dropped last: destroying it destroys its UCX workers, and a READ still
        in flight (a stalled peer's) was not seen landing after that (UCX over TCP; the
        stall-fail case of test_prefill_stopped_or_killed_mid_read). Handles in flight are
        released only because the agent goes: that alone would not stop them."""
        self._server.close()
        self._handshakes.shutdown(wait=False, cancel_futures=True)
        for load in [*self._loads.values(), *self._quarantine]:
            self._release(load)
        self._loads.clear()
        self._quarantine.clear()
        self._new_quarantine.clear()
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self._registered = []
        self.agent = None
