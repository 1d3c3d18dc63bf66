"""Run the engine beside the asyncio event loop.

The engine is not thread-safe, so one background thread owns it: it drains a command queue (add / abort),
runs ``engine.step()`` while work is pending, and hands each :class:`RequestOutput` to the asyncio queue of
its request with ``call_soon_threadsafe``. Handlers never touch the engine directly:

* ``await loop.add(...)`` enqueues an add and waits for its outcome, so ``RequestError`` / ``QueueFullError``
  surface in the handler (as 400 / 429);
* ``loop.abort(rid)`` enqueues an abort that runs before the next step, so a disconnected client's state is
  freed within one engine step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..engine.interface import Engine

log = logging.getLogger("flashserve.server")

_FINISHED = object()


class RequestStream:
    """Outputs of one engine request, consumed by one handler."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.error: BaseException | None = None

    def _put(self, item: Any) -> None:
        self.queue.put_nowait(item)

    async def get(self):
        """Next RequestOutput, or None when the stream ended (finished, aborted or failed)."""
        if self.finished and self.queue.empty():
            return None
        item = await self.queue.get()
        if item is _FINISHED:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            self.error = item
            raise item
        if item.finished:
            self.finished = True
        return item


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine: Engine, on_stats: Callable[[dict], None] | None = None,
                 idle_wait_s: float = 0.5):
        self.engine = engine
        self.on_stats = on_stats
        self.idle_wait_s = idle_wait_s
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats: dict[str, Any] = {}
        self.steps = 0
        self.fatal: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    # -- handler side (event loop thread) ---------------------------------------------------------------------
    async def add(self, request_id: str, prompt: str | list[int], params: Any,
                  images: list | None = None) -> RequestStream:
        """Queue a request on the engine thread (``images``: preprocessed, one per placeholder)."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        stream = RequestStream(request_id)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.append(("add", request_id, prompt, params, images or [], stream, fut))
        self._wake.set()
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the client left while the engine thread may have added it
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.append(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """End every request in flight (a shutdown's timeout passed); their streams end as aborted."""
        self._cmds.append(("abort_all",))
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------------------
    def _deliver(self, stream: RequestStream, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:  # event loop closed during shutdown
            pass

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.stats())
        except Exception:  # stats are advisory; never let them stop the loop
            log.exception("engine.stats() failed")
            return
        if self.on_stats is not None:
            try:
                self.on_stats(self.stats)
            except Exception:
                log.exception("stats callback failed")

    def _drain_commands(self) -> bool:
        did = False
        while self._cmds:
            cmd = self._cmds.popleft()
            did = True
            if cmd[0] == "add":
                _, rid, prompt, params, imgs, stream, fut = cmd
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, images=imgs)
                except BaseException as e:  # RequestError / QueueFullError / anything: back to the handler
                    fut.set_exception(e)
                    if getattr(e, "fatal", False):  # a sharded engine lost a worker: the loop ends
                        raise
                else:
                    self._streams[rid] = stream
                    fut.set_result(None)
            elif cmd[0] == "abort_all":
                for rid in list(self._streams):
                    self._abort(rid)
            else:
                self._abort(cmd[1])
        return did

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort_request(%s) failed", rid)
            self._deliver(stream, _FINISHED)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            self._deliver(stream, exc)
        self._streams.clear()

    def _run(self) -> None:
        try:
            import torch

            mode = torch.inference_mode()
        except ImportError:  # pragma: no cover - a fake engine in tests
            mode = contextlib.nullcontext()
        with mode:
            self._run_loop()

    def _run_loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                changed = self._drain_commands()
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as e:  # an engine bug: fail the requests in flight, keep serving
                        if getattr(e, "fatal", False):  # a sharded engine lost a worker: the loop ends
                            raise
                        log.exception("engine.step() failed")
                        self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                        outputs = []
                    self.steps += 1
                    for out in outputs:
                        stream = self._streams.get(out.request_id)
                        if stream is None:
                            continue
                        self._deliver(stream, out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                    self._refresh_stats()
                else:
                    if changed:
                        self._refresh_stats()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # pragma: no cover - the loop itself broke
            log.exception("engine loop died")
            self.fatal = e
            self._fail_all(EngineDeadError(str(e)))
