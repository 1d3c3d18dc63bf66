"""Graceful shutdown: on SIGTERM/SIGINT stop admitting, let running requests finish within a timeout, then end
the rest with a well-formed response, and exit 0.

uvicorn already stops accepting connections and waits for open ones; what it lacks is the middle step (it would
cancel the handlers, which cuts streams without a final chunk and logs ``CancelledError`` tracebacks) and a
clean exit status (it re-raises the signal after shutting down). :class:`GracefulServer` adds both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn

# Time, after the requests in flight are ended, for their handlers to write the last bytes.
_FINAL_WRITE_S = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Any, shutdown_timeout: float):
        super().__init__(config)
        self.app_server, self.shutdown_timeout = server, shutdown_timeout  # the app's Server

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """As uvicorn's, without recording the signal to re-raise it after shutdown (the exit is a clean 0);
        a second Ctrl-C still forces the exit."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.app_server.begin_drain()
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.app_server.end_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve_app(app: Any, sock: socket.socket, *, log_level: str, access_log: bool, shutdown_timeout: float) -> None:
    """Serve ``app`` on the already-bound ``sock`` until SIGTERM/SIGINT, then shut down gracefully."""
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + _FINAL_WRITE_S)
    server = GracefulServer(config, app.state.server, shutdown_timeout)
    asyncio.run(server.serve(sockets=[sock]))


def exit_now(code: int) -> None:
    """Exit at once after a completed shutdown: every request has been answered and the engine thread has
    stopped, and the interpreter's own teardown of torch would add 1.5-3 s to a shutdown timed by the operator."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
