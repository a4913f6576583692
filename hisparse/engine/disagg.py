"""Prefill/decode disaggregation, engine side (issue 23; DESIGN.md §7, last bullet).

:class:`Disaggregation` is what ``LLM(kv_role=...)`` adds to the engine: the NIXL agent
(:class:`~hisparse.worker.kv_transfer.KVTransferAgent`) and the request-level protocol of
:mod:`hisparse.kv.transfer_plan`.

- ``kv_role="prefill"``: a request whose ``kv_transfer_params`` has ``do_remote_decode`` runs
  its prompt with ``max_tokens=1``; when it finishes, its prompt's host blocks are held
  (:meth:`KVCoordinator.hold <hisparse.kv.coordinator.KVCoordinator.hold>`), its output waits
  until the prompt's mirrors are durable, then carries the params a decode instance needs.
  Held blocks go back on the decode's ``read:`` notification or after ``hold_timeout_s``.
- ``kv_role="decode"``: a request carrying ``do_remote_prefill`` params enters the *waiting
  for remote KV* state (the scheduler admits it with :meth:`KVCoordinator.admit_remote
  <hisparse.kv.coordinator.KVCoordinator.admit_remote>`; the engine core starts and polls its
  load). A failed load recomputes the prompt (``load_failure="recompute"``) or fails the
  request (``"fail"``); a load that fails with its READs in flight (a stalled prefill) does
  so at once, in fresh blocks, while the blocks those READs target stay quarantined until
  they end (:mod:`hisparse.worker.kv_transfer`).

Either role still serves ordinary (colocated) requests.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams
from hisparse.kv.transfer_plan import (
    KV_ROLES,
    LOAD_FAILURE_POLICIES,
    RemotePrefill,
    compat_hash,
)
from hisparse.ops.quant import FP8_INDEX_KEY_FORMAT


def prompt_digest(ids: list[int]) -> str:
    """Identifies a prompt (the decode side checks it received the prompt the KV is of)."""
    return compat_hash(prompt=ids)


def check_disagg_args(kv_role, kv_host, kv_port, kv_load_failure, kv_load_timeout_s,
                      kv_hold_timeout_s) -> None:
    if kv_role is not None and kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be None or one of {list(KV_ROLES)}, got {kv_role!r}")
    if not isinstance(kv_host, str) or not kv_host:
        raise ValueError(f"kv_host must be a host name or address, got {kv_host!r}")
    if kv_port is not None and (not isinstance(kv_port, int) or isinstance(kv_port, bool)
                                or not 0 < kv_port < 65536):
        raise ValueError(f"kv_port must be None or an integer in [1, 65535], got {kv_port!r}")
    if kv_load_failure not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure must be one of {list(LOAD_FAILURE_POLICIES)}, got "
                         f"{kv_load_failure!r}")
    for name, v in (("kv_load_timeout_s", kv_load_timeout_s),
                    ("kv_hold_timeout_s", kv_hold_timeout_s)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{name} must be a number > 0, got {v!r}")


class Disaggregation:
    def __init__(self, role: str, scheduler, caches, model_config, host: str,
                 port: int | None, load_failure: str, load_timeout_s: float,
                 hold_timeout_s: float) -> None:
        from hisparse.worker.kv_transfer import KVTransferAgent

        geo = caches.geo
        self.role = role
        self.scheduler = scheduler
        self.block_size = caches.cfg.block_size
        self.vocab_size = model_config.vocab_size
        mc = {k: v for k, v in dataclasses.asdict(model_config).items()
              if k not in ("rope_parameters", "quantization_config", "eos_token_ids",
                           "bos_token_id", "pad_token_id", "max_position_embeddings")}
        self.compat = compat_hash(model=mc, block_size=self.block_size,
                                  kv_cache_dtype=geo.kv_cache_dtype,
                                  storage_dtype=str(geo.storage_dtype),
                                  num_layers=geo.num_layers,
                                  indexer_layers=list(geo.indexer_layers),
                                  row_bytes=geo.row_bytes, key_bytes=geo.key_bytes,
                                  index_key_format=(FP8_INDEX_KEY_FORMAT
                                                    if geo.kv_cache_dtype == "fp8" else None))
        self.engine_id = f"hisparse-{role}-{uuid.uuid4().hex[:12]}"
        self.host = host
        self.hold_timeout_s = hold_timeout_s
        self.agent = KVTransferAgent(caches, self.engine_id, host, port, self.compat,
                                     load_timeout_s)
        self.port = self.agent.port
        self.recompute = load_failure == "recompute"
        # prefill side: finished requests whose prompt mirrors are not durable yet, and the
        # held prompts by request id: (host blocks, deadline)
        self.handoffs: list[Request] = []
        self.held: dict[str, tuple[list[int], float]] = {}

    @property
    def metrics(self):
        return self.agent.metrics

    # ------------------------------------------------------------------ requests
    def prepare(self, ids: list[int], params: SamplingParams):
        """Validate a request's ``kv_transfer_params`` for this role. Returns its params (a
        prefill's capped to one token), the remote prefill to load (decode) or None, and
        whether its KV is held for a remote decode (prefill)."""
        kv = params.kv_transfer_params
        if not kv:
            return params, None, False
        if kv.get("do_remote_decode"):
            if self.role != "prefill":
                raise ValueError("kv_transfer_params.do_remote_decode needs an instance "
                                 "started with kv_role='prefill'")
            # one token here; min_tokens > 0 still bans EOS from that first token
            return (dataclasses.replace(params, max_tokens=1,
                                        min_tokens=min(params.min_tokens, 1)), None, True)
        if kv.get("do_remote_prefill"):
            if self.role != "decode":
                raise ValueError("kv_transfer_params.do_remote_prefill needs an instance "
                                 "started with kv_role='decode'")
            remote = RemotePrefill.parse(kv, self.block_size)
            if remote.num_tokens != len(ids) or kv.get("prompt_digest") != prompt_digest(ids):
                raise ValueError(f"kv_transfer_params: the remote KV is of another prompt "
                                 f"({remote.num_tokens} tokens) than this request's "
                                 f"({len(ids)} tokens)")
            if remote.first_token >= self.vocab_size:
                raise ValueError(f"kv_transfer_params.first_token {remote.first_token} is "
                                 f"outside the vocabulary [0, {self.vocab_size})")
            return params, remote, False
        return params, None, False

    def defer(self, req: Request) -> bool:
        """A finished request: True when its output must wait for its held KV to be durable
        (prefill side; :meth:`ready` returns it later)."""
        if req.held is None:
            return False
        self.handoffs.append(req)
        return True

    def ready(self) -> list[tuple[Request, dict]]:
        """Deferred requests whose held prompt rows are durable on host now, with the
        ``kv_transfer_params`` of their output (the blocks are held from now on)."""
        out, waiting = [], []
        now = time.monotonic()
        for req in self.handoffs:
            handle, blocks = req.held
            if handle.num_durable < handle.prompt_len:
                waiting.append(req)
                continue
            req.held = None
            self.held[req.req_id] = (blocks, now + self.hold_timeout_s)
            self.metrics.held += 1
            params = self.transfer_params(req, blocks)
            # the decode refuses rows whose READ ends after this (the blocks may be reused)
            params["remote_hold_until"] = time.time() + self.hold_timeout_s
            out.append((req, params))
        self.handoffs = waiting
        return out

    def transfer_params(self, req: Request, blocks: list[int]) -> dict:
        ids = req.prompt_token_ids
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_request_id": req.req_id,
                "remote_block_ids": {"host": list(blocks)},
                "remote_host": self.host, "remote_port": self.port,
                "num_remote_tokens": len(ids),
                "first_token": req.token_ids[len(ids)],
                "prompt_digest": prompt_digest(ids),
                "compat_hash": self.compat, "remote_layout": self.agent.remote_layout()}

    def service(self) -> None:
        """Prefill side: release the prompts the decode side read, and those past their
        timeout (a dead or slow decode instance). Decode side: tell prefill instances about
        failed loads; give back the quarantined blocks of failed loads whose READs ended."""
        if self.role == "decode":
            self.agent.flush_notifications()
            for job in self.agent.poll_quarantine():
                self.scheduler.kv.release_quarantine(job)
        if not self.held:
            return
        for req_id in self.agent.poll_notifications():
            entry = self.held.pop(req_id, None)
            if entry is not None:
                self.scheduler.kv.release_held(entry[0])
                self.metrics.released += 1
        now = time.monotonic()
        for req_id in [r for r, (_, deadline) in self.held.items() if deadline < now]:
            self.scheduler.kv.release_held(self.held.pop(req_id)[0])
            self.metrics.expired += 1

    def close(self) -> None:
        self.agent.close()
