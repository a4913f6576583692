"""The online face of the engine: one thread owns an :class:`~hisparse.engine.llm.LLM` and steps
it while work exists; asyncio callers submit requests and read per-request output streams.

    engine = AsyncLLM(LLM(...), max_waiting_requests=256)
    async for out in engine.generate(prompt, SamplingParams(...), stop=["\\n\\n"]):
        ...            # RequestOutput: cumulative tokens / text, ``finished`` on the last one

The ``LLM`` is not thread-safe, so every call on it (add, abort, step, stats) happens on the
engine thread: callers put commands on a thread-safe queue and the engine thread answers through
``loop.call_soon_threadsafe`` into each request's ``asyncio.Queue``. Validation errors of
:meth:`AsyncLLM.generate` come back as ``ValueError`` before any output; a full queue raises
:class:`Overloaded`; an engine-wide fault raises :class:`~hisparse.engine.llm.EngineDeadError`
from every open stream and every later call.

Stop strings are matched here, on the detokenized text: a match aborts the request in the engine
(its KV is freed at once) and the last output carries the text cut before the stop string,
``finish_reason="stop"``. Closing a stream early (a client that went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hisparse.engine.llm import LLM, EngineDeadError, RequestOutput
from hisparse.engine.sampling import SamplingParams

logger = logging.getLogger("hisparse.engine")

__all__ = ["AsyncLLM", "Overloaded", "RequestMetrics", "EngineSnapshot"]


class Overloaded(RuntimeError):
    """The engine's queue is full: retry later (the server answers 503)."""


@dataclass
class RequestMetrics:
    """Timings of one finished request (seconds, ``time.monotonic``)."""

    request_id: str
    arrival: float
    first_token: float | None
    finished: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival


@dataclass
class EngineSnapshot:
    """What the engine thread last published (read by metrics and /health from any thread)."""

    stats: dict = field(default_factory=dict)
    page_states: dict = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    copies_in_flight: int = 0
    time: float = 0.0


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stop: tuple[str, ...]
    prompt_len: int = 0
    arrival: float = 0.0
    first_token: float | None = None


_ABORTED = object()   # sentinel: the stream was closed by the engine (shutdown)


class AsyncLLM:
    """Owns ``llm`` from a background thread. ``max_waiting_requests`` bounds the requests
    queued beyond ``max_num_seqs`` running ones (more raise :class:`Overloaded`).
    ``on_request_finished`` is called on the engine thread with a :class:`RequestMetrics`.
    ``log_interval`` seconds between throughput / tier log lines while busy (0: off)."""

    def __init__(self, llm: LLM, max_waiting_requests: int = 256, log_interval: float = 10.0,
                 on_request_finished: Callable[[RequestMetrics], None] | None = None,
                 start: bool = True) -> None:
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be an integer >= 0, got "
                             f"{max_waiting_requests!r}")
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        self.max_unfinished = llm.kv_config.max_num_seqs + max_waiting_requests
        self.log_interval = log_interval
        self.on_request_finished = on_request_finished
        self.snapshot = EngineSnapshot()
        self.dead: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._num_unfinished = 0
        self._ids = 0
        self._streams: dict[str, _Stream] = {}      # engine thread only
        self._needs_release = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hisparse-engine", daemon=True)
        self._last_log = time.monotonic()
        self._last_logged_stats: dict = {}
        self._last_warn: dict[str, float] = {}
        self._warned_stats: dict = {}
        self._tokens_since_log = 0
        self._publish(force=True)
        if start:
            self.start()

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return self._num_unfinished

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; open streams end with ``EngineDeadError``. Returns whether
        the thread has stopped (False: a step still runs after ``timeout`` s; the ``LLM`` must
        not be shut down under it)."""
        self._stopping.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def new_request_id(self) -> str:
        with self._lock:
            self._ids += 1
            return f"cmpl-{self._ids}"

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       stop: list[str] | tuple[str, ...] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs as it runs (cumulative, the last one has
        ``finished``). Raises ``ValueError`` (bad request, nothing queued), :class:`Overloaded`
        or ``EngineDeadError`` before the first output. Closing the iterator early aborts it."""
        sub = await self.submit(prompt, params, request_id, stop)
        async for out in self.stream(*sub):
            yield out

    async def submit(self, prompt, params: SamplingParams, request_id: str | None = None,
                     stop: list[str] | tuple[str, ...] | None = None
                     ) -> tuple[str, _Stream]:
        """The first half of :meth:`generate`: queue the request, return (id, stream)."""
        if self.dead is not None or self._stopping.is_set():
            raise EngineDeadError(f"the engine stopped: {self.dead or 'shut down'}")
        stop = tuple(s for s in (stop or ()) if s)
        with self._lock:
            if self._num_unfinished >= self.max_unfinished:
                raise Overloaded(
                    f"the server is at capacity ({self._num_unfinished} requests in flight: "
                    f"max_num_seqs={self.llm.kv_config.max_num_seqs} running + "
                    f"max_waiting_requests={self.max_waiting_requests} waiting); retry later")
            self._num_unfinished += 1
        if request_id is None:
            request_id = self.new_request_id()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), stop, arrival=time.monotonic())
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", prompt, params, request_id, stream, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            with self._lock:
                self._num_unfinished -= 1
            raise
        return request_id, stream

    async def stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item is _ABORTED:
                    finished = True
                    return
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        llm = self.llm
        try:
            while not self._stopping.is_set():
                busy = llm.has_unfinished_requests() or self._needs_release
                self._drain_commands(block=not busy)
                llm.service_kv_transfer()   # held prompts of a prefill instance, while idle
                if self._stopping.is_set():
                    break
                if not (llm.has_unfinished_requests() or self._needs_release):
                    continue
                self._needs_release = False
                outputs = llm.step()
                for out in outputs:
                    self._dispatch(out)
                self._publish()
                self._maybe_log()
        except BaseException as e:  # noqa: BLE001 - engine-wide: every stream learns of it
            self.dead = e
            logger.exception("engine loop stopped: %s", e)
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"engine-wide fault: {type(e).__name__}: {e}")
            self._fail_all(err)
            return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self._publish()
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, prompt, params, request_id, stream, done = cmd
            if not done.set_running_or_notify_cancel():   # the caller went away meanwhile
                return
            try:
                self.llm.add_request(prompt, params, request_id=request_id)
            except BaseException as e:  # noqa: BLE001 - the caller's error
                done.set_exception(e)
                return
            req = self.llm._requests.get(request_id)
            stream.prompt_len = len(req.prompt_token_ids) if req is not None else 0
            self._streams[request_id] = stream
            done.set_result(request_id)
        elif kind == "abort":
            stream = self._streams.pop(cmd[1], None)
            if stream is not None:
                self.llm.abort(cmd[1])
                self._needs_release = True
                self._finished(cmd[1], stream, 0, "abort")

    def _finished(self, request_id: str, stream: _Stream, num_out: int, reason) -> None:
        with self._lock:
            self._num_unfinished -= 1
        if self.on_request_finished is not None:
            try:
                self.on_request_finished(RequestMetrics(
                    request_id, stream.arrival, stream.first_token, time.monotonic(),
                    stream.prompt_len, num_out, reason))
            except Exception:  # noqa: BLE001 - metrics must not stop the engine
                logger.exception("on_request_finished failed")

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        comp = out.outputs[0]
        if stream.first_token is None and comp.token_ids:
            stream.first_token = time.monotonic()
        self._tokens_since_log += 1
        if stream.stop and comp.text:
            cut = min((i for i in (comp.text.find(s) for s in stream.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                if not out.finished:
                    self.llm.abort(out.request_id)
                    self._needs_release = True
                out = dataclasses.replace(out, finished=True, outputs=[dataclasses.replace(
                    comp, text=comp.text[:cut], finish_reason="stop")])
                comp = out.outputs[0]
        if out.finished:
            del self._streams[out.request_id]
            self._finished(out.request_id, stream, len(comp.token_ids), comp.finish_reason)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:   # the caller's event loop is closed: nobody reads this stream
            if not out.finished:
                self._streams.pop(out.request_id, None)
                self.llm.abort(out.request_id)
                self._needs_release = True
                self._finished(out.request_id, stream, len(comp.token_ids), "abort")

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            with self._lock:
                self._num_unfinished -= 1
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            except RuntimeError:   # its loop is closed
                pass
        while True:   # commands that never ran
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                with self._lock:
                    self._num_unfinished -= 1
                cmd[-1].set_exception(err)

    # ------------------------------------------------------------------ observability
    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.snapshot.time < 0.05 and self.llm.has_unfinished_requests():
            return
        llm = self.llm
        sched = llm.scheduler
        kv = sched.kv
        page_states = kv.page_state_counts()
        snap = EngineSnapshot(
            stats=llm.stats(), page_states=page_states,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            copies_in_flight=len(llm.runner.in_flight), time=now)
        self.snapshot = snap

    def _maybe_log(self) -> None:
        now = time.monotonic()
        stats = self.snapshot.stats
        # Warnings (rate-limited): requests switching to host-read mode, preemptions.
        for key, what in (("host_read_switches", "switched to host-read mode (GPU pool "
                           "under the watermark, or mode=always-host)"),
                          ("num_preempted", "preempted (pools exhausted; they restart from "
                           "their cached prefix)")):
            delta = stats.get(key, 0) - self._warned_stats.get(key, 0)
            if delta > 0 and now - self._last_warn.get(key, -1e9) >= 10.0:
                logger.warning("%d request(s) %s", delta, what)
                self._warned_stats[key] = stats.get(key, 0)
                self._last_warn[key] = now
        if self.log_interval <= 0 or now - self._last_log < self.log_interval:
            return
        prev = self._last_logged_stats
        dt = now - self._last_log
        d = {k: stats.get(k, 0) - prev.get(k, 0) for k in
             ("hot_hits", "hot_misses", "h2d_bytes", "d2h_bytes", "spilled_pages")}
        lookups = d["hot_hits"] + d["hot_misses"]
        pages = self.snapshot.page_states
        logger.info(
            "%.1f tok/s out | running %d waiting %d | GPU pages dirty %d clean %d host-only %d "
            "free %d | hot hit rate %s | H2D %.1f MB/s D2H %.1f MB/s | spilled %d",
            self._tokens_since_log / dt, self.snapshot.num_running, self.snapshot.num_waiting,
            pages.get("dirty", 0), pages.get("clean", 0), pages.get("host_only", 0),
            stats.get("free_gpu_blocks", 0),
            f"{d['hot_hits'] / lookups:.1%}" if lookups else "-",
            d["h2d_bytes"] / dt / 1e6, d["d2h_bytes"] / dt / 1e6, d["spilled_pages"])
        self._last_log, self._last_logged_stats, self._tokens_since_log = now, dict(stats), 0
