"""A background compile's work done in a child process: the serving process's interpreter is left to serve.

Compiling the decode step is mostly Python (dynamo's tracing, inductor's passes and code generation) on the
interpreter the serving thread needs after every op it runs; done on a thread of the serving process, the eager
step it served with ran at about a third of its speed for the minutes a cold compile takes
(docs/engine-speed.md#compiled-in-the-background). A :class:`CompileChild` is a second process that builds the
same engine (the same options, the same number of cache pages, so every region's graph has the same shapes) and
runs the compiled regions for each step key the parent sends it, each region kind's graph compiled as an artifact
and saved with its plan (:mod:`.step_artifacts`); the parent loads those and calls them directly, without
dynamo. Where an artifact cannot be made (dynamo's ``eager`` backend in tests, a kind whose plan names a tensor
the step cannot name), the parent compiles that key itself, from inductor's cache where the child filled it.

Keys are sent as they are queued and compiled in order, so the parent loads one key while the child compiles the
next. The child ends when its stdin closes (the parent's compiling thread closes it when its queue is empty, or
the parent ends), or when its parent process goes away. It runs in a process group of its own, so a Ctrl-C typed at
the terminal reaches the parent only; it is not started with `setsid`, which would also put it in a scheduling group
of its own (Linux's autogroup, one per `setsid`), where its lower priority counts for nothing against the parent: a
`generate` decoded at 1.2 tok/s beside such a child, 29 tok/s beside a compile on a thread.

The child's side is :mod:`flashserve.engine.compile_worker`. Protocol, one JSON object a line: the parent writes ``[bucket, rows, width]``; the child answers
``{"ready": seconds}`` once its engine is built, then ``{"key": [...], "s": seconds}`` or
``{"key": [...], "error": "..."}`` for each key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

class ChildFailed(RuntimeError):
    """The child process could not build its engine, compile a key, or ended; the parent compiles on its own."""


class CompileChild:
    """A child process compiling decode-step keys for an engine built from ``options`` (an
    :class:`~flashserve.engine.EngineConfig`'s fields as JSON values), saving each key's graphs under
    ``artifacts`` (:mod:`.step_artifacts`; the decode step that uses the child says where)."""

    def __init__(self, options: dict, artifacts: str | None = None):
        self.options, self.artifacts = options, artifacts
        self._proc: subprocess.Popen | None = None
        self._err = None  # the child's stderr, kept in a temporary file for a failure's message
        self._done: dict[tuple, dict] = {}
        self._lock = threading.Lock()
        self.started_s = 0.0  # seconds its last start took to build the engine
        self.compiled_s = 0.0  # seconds it spent compiling, in all

    def submit(self, key: tuple) -> None:
        """Queue ``key`` for the child (started if none is attached: one that ended unasked stays attached, and
        :meth:`wait` says why it ended)."""
        with self._lock:
            if self._proc is None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps(list(key)) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # it ended: wait() reads the end and says why

    def _start(self) -> None:
        self._err = tempfile.TemporaryFile()
        self._done = {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen([sys.executable, "-m", "flashserve.engine.compile_worker",
                                       json.dumps({"options": self.options, "artifacts": self.artifacts})], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._err, text=True, env=env, process_group=0)

    def wait(self, key: tuple) -> dict:
        """Block until the child has compiled ``key`` (submitted before); its answer (``s``: seconds, ``saved``:
        region kinds saved as artifacts). Raises :class:`ChildFailed` when the child fails it or ends."""
        key = tuple(key)
        proc = self._proc
        if proc is None:
            raise ChildFailed("no child process was started")
        while key not in self._done:
            try:
                line = proc.stdout.readline()  # blocks without holding the interpreter's lock
            except (OSError, ValueError):  # closed by close() on another thread
                line = ""
            if not line:
                proc.wait()
                raise ChildFailed(f"the compiling child process ended (exit status {proc.returncode})"
                                  f"{self._stderr_tail()}")
            msg = json.loads(line)
            if "ready" in msg:
                self.started_s = msg["ready"]
            elif "key" in msg:
                self._done[tuple(msg["key"])] = msg
        msg = self._done.pop(key)
        if "error" in msg:
            raise ChildFailed(f"the compiling child process failed: {msg['error']}")
        self.compiled_s += msg["s"]
        return msg

    def _stderr_tail(self, lines: int = 5) -> str:
        if self._err is None:
            return ""
        self._err.seek(0)
        tail = self._err.read().decode(errors="replace").strip().splitlines()[-lines:]
        return (": " + " | ".join(tail)) if tail else ""

    def detach(self) -> tuple:
        """Forget the running child (a later :meth:`submit` starts another); what :meth:`end` ends."""
        with self._lock:
            out = (self._proc, self._err)
            self._proc, self._err = None, None
        return out

    @staticmethod
    def end(detached: tuple) -> None:
        """End a detached child: its stdin closed, it ends after the key it is compiling (killed after 5 s)."""
        proc, err = detached
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if err is not None:
            err.close()

    def close(self) -> None:
        """End the child now."""
        self.end(self.detach())
