"""Tensor parallelism: N ranks execute every StepPlan, one host pool shared by all of them.

Process layout (``LLM(..., tensor_parallel_size=N)``):

- **rank 0** is the caller's process: it runs the scheduler (pure Python, no device work), plans,
  samples, and executes its own shard of the model through :class:`TPRunner`, which sends every
  plan to the other ranks (a :class:`PlanMessage`) before running it and broadcasts the sampled
  tokens (``dist.broadcast`` on the device group: NCCL on CUDA, gloo on CPU) after.
- **ranks 1..N-1** are processes started with ``torch.multiprocessing`` (spawn). Each loads the
  checkpoint, keeps its shard (:mod:`hisparse.models.tp`), builds its own GPU arena / indexer
  cache / hot state, and runs :func:`_worker_main`'s loop: receive a command over its pipe,
  execute the same plan. Control messages travel over ``multiprocessing`` pipes (an idle engine
  never times out; a dead peer is an EOF); tensors over ``torch.distributed``.

**Every rank executes every plan, in order.** The block tables do not travel whole: a
:class:`PlanMessage` carries the plan without its four tables plus, per table, the rows of the
slots in ``plan.changed_rows`` (what the KV core wrote since the previous plan). Each worker rank
keeps its own host copy of the tables (:class:`RankTables`), applies those rows and hands its
:class:`~hisparse.worker.step_state.StepState` a plan whose tables are that copy, so per-step
traffic and table work stay proportional to what changed (at 256 requests x 1024 pages the four
tables are 4 MB; a decode step's message is a few KB). This holds only if no plan is skipped or
reordered, so messages are numbered and a rank that receives one out of order stops with
:class:`PlanOrderError`.

**One host pool.** Rank 0 allocates the pool (``host``, ``host_indexer``) once in shared memory
(``share_memory_()``: one mapping of one shm segment) before spawning; every rank's
:class:`~hisparse.worker.cache.KVCaches` gets it as ``host_buffers``. On CUDA each rank registers
the mapping with ``cudaHostRegister`` (pinned, device-addressable: the resolver reads misses
zero-copy from the same bytes on every rank). Since the latent row is identical on every rank,
**only rank 0 writes mirrors** (``ModelRunner.mirror_writer``); rank 0's acks therefore mean
"durable for all ranks": every rank restores / resolves only pages the scheduler saw acked.
Host blocks are reused only after the step that read them on every rank: that step's all-reduces
complete on rank 0 only once every rank reached them, and a later mirror is queued after them.
Host capacity is the node's ``host_pool_gib``, not divided by N.

**Failures.** Every exchange checks the worker processes first; a collective that fails (gloo
reports a closed peer at once; any hang ends after ``HISPARSE_TP_TIMEOUT`` seconds, default 120)
is reported as :class:`TPWorkerDied` naming the rank, its exit code and its traceback. Start-up
checks that every rank parsed the same model / KV config, holds the same shard shapes and reads
the same host pool bytes (a nonce rank 0 wrote before spawning).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hisparse.kv.plan import TABLES, StepPlan

TIMEOUT_S = float(os.environ.get("HISPARSE_TP_TIMEOUT", "120"))
START_TIMEOUT_S = float(os.environ.get("HISPARSE_TP_START_TIMEOUT", "600"))


class TPWorkerDied(RuntimeError):
    """A tensor-parallel rank exited or a collective with it failed."""


class PlanOrderError(RuntimeError):
    """A worker rank received a plan out of order (its block tables would silently diverge)."""


# ---------------------------------------------------------------------- what travels per step
@dataclass(frozen=True)
class PlanMessage:
    """One StepPlan as rank 0 sends it to ranks 1..N-1 (pickled over each rank's pipe).

    ``plan`` is the plan with its four ``*_block_table`` fields set to ``None``; ``rows[i]`` is
    table ``TABLES[i]``'s rows of the slots in ``plan.changed_rows`` (``[k, width]`` int32, in
    the order of those slots), or ``None`` when none changed. ``seq`` numbers the messages 0, 1,
    2, ...: a rank applies message ``n`` only after ``n - 1`` (:class:`RankTables`). ``shapes``
    (the tables' shapes, :data:`TABLES` order) rides on message 0 only: each rank allocates its
    copy of the tables from it, once.
    """

    seq: int
    plan: StepPlan
    rows: tuple[np.ndarray | None, ...]
    input_ids: list[int]
    shapes: tuple[tuple[int, int], ...] | None = None


def plan_message(plan: StepPlan, input_ids: list[int], seq: int) -> PlanMessage:
    """Rank 0's side: the message for ``plan`` (the ``seq``-th plan sent, counting from 0).
    Reads only the changed rows of the tables (copied now: the KV core reuses its tables)."""
    changed = plan.changed_rows
    rows = []
    for name in TABLES:
        slots = getattr(changed, name)
        rows.append(getattr(plan, f"{name}_block_table")[slots] if slots.size else None)
    shapes = (tuple(tuple(getattr(plan, f"{n}_block_table").shape) for n in TABLES)
              if seq == 0 else None)
    bare = dataclasses.replace(plan, **{f"{n}_block_table": None for n in TABLES})
    return PlanMessage(seq=seq, plan=bare, rows=tuple(rows), input_ids=input_ids, shapes=shapes)


class RankTables:
    """A worker rank's host copy of the block tables, kept from the changed rows rank 0 sends.

    :meth:`apply` turns each :class:`PlanMessage` back into a full :class:`StepPlan` whose tables
    are this copy (updated in place; the rank's ``StepState`` then uploads only
    ``changed_rows``, as on rank 0). The copy equals rank 0's tables as of the last plan only if
    every plan is applied, in order: a gap or a repeat raises :class:`PlanOrderError`.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tables: dict[str, np.ndarray] | None = None   # allocated by message 0
        self.applied = 0                                   # plans applied = next expected seq

    def apply(self, msg: PlanMessage) -> StepPlan:
        if msg.seq != self.applied:
            raise PlanOrderError(
                f"tensor-parallel rank {self.rank} received plan #{msg.seq} (step "
                f"{msg.plan.step_id}) but expected plan #{self.applied}: every rank must "
                "execute every plan, in order (its block tables are kept from each plan's "
                "changed rows)")
        if self.tables is None:
            if msg.shapes is None:
                raise PlanOrderError(f"tensor-parallel rank {self.rank}: plan #0 carries no "
                                     "table shapes")
            self.tables = {n: np.full(shape, -1, dtype=np.int32)
                           for n, shape in zip(TABLES, msg.shapes)}
        for name, rows in zip(TABLES, msg.rows):
            slots = getattr(msg.plan.changed_rows, name)
            if rows is None:
                if slots.size:
                    raise ValueError(f"plan #{msg.seq}: {name} rows missing for {slots.size} "
                                     "changed slots")
                continue
            table = self.tables[name]
            if rows.shape != (slots.size, table.shape[1]):
                raise ValueError(f"plan #{msg.seq}: {name} rows of shape {rows.shape} for "
                                 f"{slots.size} changed slots of a table {table.shape}")
            table[slots] = rows
        self.applied += 1
        return dataclasses.replace(msg.plan, **{f"{n}_block_table": self.tables[n]
                                                for n in TABLES})

    def digest(self) -> dict[str, str] | None:
        """SHA-1 of each table (tests compare them with rank 0's tables)."""
        if self.tables is None:
            return None
        return {n: table_sha1(t) for n, t in self.tables.items()}


def table_sha1(table: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(table, dtype=np.int32).tobytes()).hexdigest()


# ---------------------------------------------------------------------- the shared host pool
def pool_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a host pool tensor (uint8, flat)."""
    return t.detach().reshape(-1).view(torch.uint8)


def cuda_host_register(t: torch.Tensor) -> None:
    """Page-lock a shared-memory mapping for this process's CUDA context (zero-copy reads)."""
    nbytes = t.untyped_storage().nbytes()
    if nbytes == 0:
        return
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared host pool failed ({rc})")


def shared_host_buffers(host_shape, idx_shape, dtype: torch.dtype, cuda: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's one host pool, in shared memory (registered with CUDA in this process)."""
    host = torch.empty(host_shape, dtype=dtype).share_memory_()
    idx = torch.empty(idx_shape, dtype=dtype).share_memory_()
    if cuda:
        cuda_host_register(host)
        cuda_host_register(idx)
    return host, idx


def write_nonce(host: torch.Tensor) -> bytes:
    """Write 8 random bytes at the start of the (still unused) pool; return them."""
    nonce = os.urandom(8)
    b = pool_bytes(host)
    if b.numel() >= 8:
        b[:8] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
        return nonce
    return b""


def fingerprint(model, mc, kv_config, geo, host, host_indexer, world: int) -> dict:
    """What every rank must agree on (compared by rank 0 at start-up)."""
    def h(x) -> str:
        return hashlib.sha1(repr(x).encode()).hexdigest()[:16]

    b = pool_bytes(host)
    return {
        "model_config": h(mc), "kv_config": h(kv_config), "geometry": h(geo), "world": world,
        "shard_shapes": h([(n, tuple(p.shape), str(p.dtype))
                           for n, p in model.named_parameters()]),
        "host_pool": (tuple(host.shape), tuple(host_indexer.shape), str(host.dtype),
                      host.untyped_storage().nbytes() + host_indexer.untyped_storage().nbytes()),
        "host_shared": bool(host.is_shared() and host_indexer.is_shared()),
        "pool_nonce": bytes(b[:8].tolist()) if b.numel() >= 8 else b"",
    }


# ---------------------------------------------------------------------- process group
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world: int, port: int, cuda: bool):
    """Default group (nccl on CUDA, gloo on CPU): the all-reduces and token broadcasts."""
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.group.WORLD


def _build_rank(spec: dict, rank: int, host_buffers):
    from hisparse.models.loader import load_model
    from hisparse.models.tp import shard_model_
    from hisparse.ops import switches
    from hisparse.worker.cache import KVCaches
    from hisparse.worker.model_runner import ModelRunner

    switches.install(spec["switches"])   # rank 0's, overrides included: not this env's
    device = spec["device"]
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
        for t in host_buffers:
            cuda_host_register(t)
    torch.manual_seed(spec["seed"])      # load_format="dummy": the same weights on every rank
    model, _ = load_model(spec["model"], dtype=spec["dtype"], device=device,
                          load_format=spec["load_format"], config=spec["model_config"])
    shard_model_(model, rank, spec["world"])
    model.finalize_weights_()            # before the KV cache takes the memory
    caches = KVCaches(spec["kv_config"], spec["geometry"], device, host_buffers)
    caches.set_hot_policy(spec["hot_policy"])
    runner = (spec["runner_cls"] or ModelRunner)(model, caches, spec["model_config"].index_topk,
                                                 spec["model_config"].kv_lora_rank,
                                                 enforce_eager=True)
    runner.mirror_writer = False         # rank 0 alone writes the shared pool
    return model, caches, runner


def _worker_main(rank: int, spec: dict, host_buffers, conn) -> None:
    """Rank ``rank``'s process: build, report, then execute every command rank 0 sends."""
    try:
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        model, caches, runner = _build_rank(spec, rank, host_buffers)
        conn.send(("ready", fingerprint(model, spec["model_config"], spec["kv_config"],
                                        spec["geometry"], caches.host, caches.host_indexer,
                                        spec["world"])))
        from hisparse.models.tp import set_tp_group
        set_tp_group(model, _init_group(rank, spec["world"], spec["port"],
                                        runner.device.type == "cuda"))
        tables = RankTables(rank)
        with torch.inference_mode():
            while True:
                cmd = conn.recv()          # EOFError when rank 0 is gone: exit
                op = cmd[0]
                if op == "execute":        # every plan, in order (RankTables checks)
                    msg = cmd[1]
                    runner.execute(tables.apply(msg), msg.input_ids)
                elif op == "commit":
                    tokens = torch.empty(cmd[1], dtype=torch.int64, device=runner.device)
                    dist.broadcast(tokens, 0)
                    runner.commit_sampled(tokens)
                elif op == "info":
                    conn.send(("info", _info(rank, runner, caches, tables, cmd[1])))
                elif op == "stop":
                    break
                else:
                    raise RuntimeError(f"unknown tensor-parallel command {op!r}")
    except EOFError:
        os._exit(3)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this rank exits
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    conn.close()
    # nothing of this rank outlives it (rank 0 owns the shared host pool): skip the
    # interpreter's teardown of torch and the model, ~1.3 s of every engine shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _info(rank: int, runner, caches, tables: RankTables, digest: bool) -> dict:
    from hisparse.ops import switches

    hits, misses = runner.hot_counters()
    out = {"rank": rank, "pid": os.getpid(), "hot_hits": hits, "hot_misses": misses,
           "host_nbytes": caches.host.untyped_storage().nbytes(),
           "host_shared": caches.host.is_shared(), "d2h_bytes": runner.d2h_bytes,
           "plans_applied": tables.applied,
           "switches": dataclasses.asdict(switches.current())}
    if digest:
        out["host_sha1"] = hashlib.sha1(pool_bytes(caches.host).numpy().tobytes()).hexdigest()
        out["tables_sha1"] = tables.digest()   # this rank's block tables as of its last plan
    return out


# ---------------------------------------------------------------------- rank 0's side
class TPWorkers:
    """Ranks 1..N-1: spawn, start-up check, commands, liveness, shutdown."""

    def __init__(self, spec: dict, host_buffers) -> None:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one "
                               "tensor-parallel LLM per process (call shutdown() on the other)")
        self.world = spec["world"]
        self.cuda = spec["device"].type == "cuda"
        spec = dict(spec, port=_free_port())
        self.spec = spec
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self._errors: dict[int, str] = {}
        self.closed = False
        self.group_ready = False
        for rank in range(1, self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, spec, host_buffers, child),
                            name=f"hisparse-tp{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    # --- start-up
    def wait_ready(self, mine: dict) -> None:
        """Wait for every rank's fingerprint, compare it with rank 0's, join the group."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    self._died(rank)
                if time.monotonic() > deadline:
                    raise TPWorkerDied(f"tensor-parallel rank {rank} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s (HISPARSE_TP_START_TIMEOUT)")
            kind, theirs = self._recv(rank)
            if kind != "ready":
                raise TPWorkerDied(f"tensor-parallel rank {rank} failed to start: {theirs}")
            bad = [k for k in mine if mine[k] != theirs.get(k)]
            if bad:
                raise RuntimeError(f"tensor-parallel rank {rank} disagrees with rank 0 on "
                                   f"{', '.join(bad)} (rank 0: {[mine[k] for k in bad]}, rank "
                                   f"{rank}: {[theirs.get(k) for k in bad]})")
        _init_group(0, self.world, self.spec["port"], self.cuda)
        self.group_ready = True

    # --- liveness
    def _recv(self, rank: int):
        try:
            msg = self.conns[rank - 1].recv()
        except (EOFError, OSError):
            self._died(rank)
        if msg[0] == "error":
            self._errors[rank] = msg[1]
            self._died(rank)
        return msg

    def _died(self, rank: int):
        p = self.procs[rank - 1]
        p.join(2.0)
        conn = self.conns[rank - 1]
        try:
            while rank not in self._errors and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    self._errors[rank] = msg[1]
        except (EOFError, OSError):
            pass
        why = self._errors.get(rank)
        raise TPWorkerDied(f"tensor-parallel rank {rank} (pid {p.pid}) died (exit code "
                           f"{p.exitcode})" + (f": {why}" if why else ""))

    def check(self) -> None:
        """Raise :class:`TPWorkerDied` if any rank has exited."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._died(rank)

    def guard(self, exc: BaseException) -> None:
        """After a failed step: if a rank died (waiting briefly for its exit), name it;
        otherwise re-raise ``exc`` (rank 0's own fault)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self.check()
            time.sleep(0.05)
        raise exc

    # --- commands
    def send(self, *cmd) -> None:
        self.check()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(cmd)
            except (BrokenPipeError, EOFError, OSError):
                self._died(rank)

    def info(self, digest: bool = False) -> list[dict]:
        """Each worker rank's counters, host pool facts and plans applied (tests, diagnostics);
        with ``digest``, SHA-1s of its host pool bytes and of its block tables (``tables_sha1``,
        :meth:`RankTables.digest`)."""
        self.send("info", digest)
        return [self._recv(rank)[1] for rank in range(1, self.world)]

    def close(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except Exception:  # noqa: BLE001 - already gone
                pass
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for conn in self.conns:
            conn.close()
        if self.group_ready and dist.is_initialized():
            dist.destroy_process_group()
            self.group_ready = False


class TPRunner:
    """Rank 0's runner: forwards every step to the other ranks, then runs its own shard.
    Everything else (counters, ``drain``, ``graphs``...) is rank 0's :class:`ModelRunner`.

    Every plan goes to every rank, in order, as a :class:`PlanMessage` (changed table rows
    only); ``plans_sent`` counts them (each rank's ``plans_applied`` must equal it)."""

    def __init__(self, runner, workers: TPWorkers) -> None:
        self.runner = runner
        self.workers = workers
        self.plans_sent = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["runner"], name)

    def execute(self, plan, input_ids):
        self.workers.send("execute", plan_message(plan, input_ids, self.plans_sent))
        self.plans_sent += 1
        try:
            return self.runner.execute(plan, input_ids)
        except Exception as e:
            self.workers.guard(e)

    def commit_sampled(self, tokens: torch.Tensor) -> None:
        self.workers.send("commit", int(tokens.shape[0]))
        try:
            dist.broadcast(tokens.contiguous(), 0)
        except Exception as e:
            self.workers.guard(e)
        self.runner.commit_sampled(tokens)
