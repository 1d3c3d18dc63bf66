"""Helpers to run one real server process (``python -m flashserve serve tiny-v41``) per test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-v41"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None = None

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()[-4000:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Parsed /metrics samples: 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out


def start_server(*extra: str, api_key: str | None = None, timeout: float = 120.0,
                 env: dict[str, str] | None = None, model: str | None = MODEL) -> ServerProc:
    """``flashserve serve MODEL`` (``model`` None: no MODEL, the embedded default as a user starts it). A port found
    free can be taken by another process before the server binds it (the suite runs in parallel): a server that
    says so is started again on another port."""
    for _ in range(3):
        try:
            return _start_server(extra, api_key, timeout, env, model)
        except _PortTaken:
            continue
    raise RuntimeError("three ports found free were taken before the server could bind them")


class _PortTaken(RuntimeError):
    pass


def _start_server(extra, api_key, timeout, env, model) -> ServerProc:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="flashserve-server-", suffix=".log")
    # the eager step unless a test asks for the compiled one (a compile is minutes of CPU on a cold cache)
    eager = [] if any(f.endswith(("enforce-eager", "background-compile")) for f in extra) else ["--enforce-eager"]
    cmd = [sys.executable, "-m", "flashserve", "serve", *([model] if model else []), "--port", str(port),
           "--log-level", "warning", *eager, *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=str(REPO), env=env)
    os.close(fd)
    url = f"http://127.0.0.1:{port}"
    srv = ServerProc(url, proc, log_path, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "Address already in use" in srv.log():
                raise _PortTaken(port)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(srv)
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{srv.log()}")


def signal_and_wait(srv: ServerProc, sig: int, timeout: float) -> tuple[int, float]:
    """Send ``sig`` and wait for the exit: (exit status, seconds it took)."""
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    rc = srv.proc.wait(timeout)
    return rc, time.monotonic() - t0


def stop_server(srv: ServerProc) -> None:
    if srv.proc.poll() is None:
        srv.proc.terminate()
        try:
            srv.proc.wait(10)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait(5)
    try:
        os.unlink(srv.log_path)
    except OSError:
        pass
