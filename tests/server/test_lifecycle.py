"""Start-up and shutdown of real server processes: a graceful SIGTERM with requests in flight, SIGINT, the
served names, the API key from the environment, and a busy port found before the model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flashserve.server.chat_encoding import encode_v41

from serverproc import MODEL, REPO, signal_and_wait, start_server, stop_server

SHUTDOWN_TIMEOUT = 3.0
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "count"}], "chat_template_kwargs": {"thinking": False}}


def _stream(url: str, out: dict, started: threading.Event) -> None:
    """A streaming chat request; records every SSE data line and the finish reasons seen."""
    lines, finishes = [], []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, **LONG, "stream": True},
                          timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line[6:])
                started.set()
                if line[6:] != "[DONE]":
                    finishes += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        out["error"] = repr(e)
    out["lines"], out["finishes"] = lines, finishes


def _complete(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, **body}, timeout=60)
        out["status"], out["body"] = r.status_code, r.json()
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        out["error"] = repr(e)


def test_sigterm_with_requests_in_flight_ends_every_one_well_formed():
    srv = start_server("--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--max-num-seqs", "16", "--log-level", "info")
    try:
        streams = [{} for _ in range(4)]
        events = [threading.Event() for _ in range(4)]
        longs = [{} for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(srv.url, o, e)) for o, e in zip(streams, events)]
        threads += [threading.Thread(target=_complete, args=(srv.url, LONG, o)) for o in longs]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in events), "streams did not start"
        time.sleep(0.3)  # the non-streaming requests are queued by now
        rc, took = signal_and_wait(srv, signal.SIGTERM, timeout=SHUTDOWN_TIMEOUT + 10)
        for t in threads:
            t.join(30)
        log = Path(srv.log_path).read_text()
    finally:
        stop_server(srv)
    assert rc == 0, log[-3000:]
    assert SHUTDOWN_TIMEOUT - 0.5 <= took <= SHUTDOWN_TIMEOUT + 4, took  # waited for them, then ended them
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    for o in streams:
        assert "error" not in o and o["status"] == 200, o
        assert o["lines"][-1] == "[DONE]" and o["finishes"] == ["abort"], o["lines"][-3:]
    for o in longs:
        assert "error" not in o, o
        assert o["status"] == 503 and o["body"]["error"]["code"] == "shutting_down", o


def test_sigterm_lets_a_short_request_finish_and_admits_no_new_one():
    srv = start_server("--shutdown-timeout", "30")
    try:
        out: dict = {}
        t = threading.Thread(target=_complete, args=(srv.url, {**LONG, "max_tokens": 40}, out))
        t.start()
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
        t.join(60)
        rc = srv.proc.wait(30)
    finally:
        stop_server(srv)
    assert rc == 0
    assert out["status"] == 200 and out["body"]["choices"][0]["finish_reason"] == "length", out
    assert out["body"]["usage"]["completion_tokens"] == 40


def test_served_names_key_from_the_environment_and_default_thinking_off(tokenizer):
    srv = start_server("--served-model-name", "alias-a", "alias-b", "--default-thinking", "off",
                       env={"FLASHSERVE_API_KEY": "s3cret"})
    try:
        plain = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": "Bearer s3cret"},
                           json={"model": "alias-b", "messages": CHAT["messages"], "max_tokens": 1}, timeout=60)
        unauth = httpx.get(srv.url + "/v1/models", timeout=60)
        bearer = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=60)
        x_key = httpx.post(srv.url + "/v1/chat/completions", headers={"x-api-key": "s3cret"},
                           json={**CHAT, "model": MODEL, "max_tokens": 1}, timeout=60)
        rc, took = signal_and_wait(srv, signal.SIGINT, timeout=15)
        log = Path(srv.log_path).read_text()
    finally:
        stop_server(srv)
    assert plain.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(encode_v41(CHAT["messages"],
                                                                                      thinking=False)))
    assert unauth.status_code == 401
    assert [m["id"] for m in bearer.json()["data"]] == ["alias-a", "alias-b"]
    assert x_key.status_code == 404 and x_key.json()["error"]["code"] == "model_not_found"
    assert rc == 0 and "Traceback" not in log and "KeyboardInterrupt" not in log, log[-2000:]


def _run_cli(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flashserve", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    return p.returncode, p.stderr, time.monotonic() - t0


def test_busy_port_is_refused_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err, took = _run_cli("serve", MODEL, "--port", str(port))
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err, err
    assert took < 2.0, took


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT handled by default and not blocked, as a shell's foreground job gets it
    (a disposition or mask the test worker inherited from its launcher would otherwise pass on to the CLI)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("flags", [["--enforce-eager"], [], ["--no-compile-child"]],
                         ids=["eager", "compiling in a child process", "compiling on a thread"])
def test_generate_ctrl_c_exits_130_without_traceback(flags, tmp_path):
    """Ctrl-C during a generation ends it with the shell's 130, its output flushed, no traceback, also while the
    decode step compiles in the background, in a child process (the default) or on a thread of the process
    (ending the interpreter under the compiling thread crashed it)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a compile under way
    p = subprocess.Popen([sys.executable, "-m", "flashserve", "generate", MODEL, "hello", "--max-tokens", "4000",
                          "--ignore-eos", "--temperature", "0", *flags], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO, preexec_fn=_as_from_a_terminal, env=env)
    try:
        assert p.stdout.read(1)  # generation is under way
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert out.endswith(b"\n") and b"Traceback" not in err and b"interrupted" in err, err


def test_ctrl_c_while_starting_exits_130_without_traceback():
    p = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", MODEL, "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=_as_from_a_terminal)
    try:
        time.sleep(1.5)  # importing torch or loading
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and b"interrupted" in out and b"Traceback" not in out, out[-2000:]
