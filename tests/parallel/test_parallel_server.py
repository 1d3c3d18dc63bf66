"""A served sharded engine (TP=2) that loses a worker while idle: /health turns 503 naming the rank within the
worker timeout plus one heartbeat, the server exits with status 1, and no worker is left behind."""

import os
import signal
import time
from pathlib import Path

import httpx
from serverproc import start_server, stop_server


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_killed_worker_makes_server_unhealthy_and_exit_nonzero():
    srv = start_server("--tensor-parallel-size", "2", "--worker-timeout", "4", "--kv-memory", "16MiB",
                       "--threads", "1", "--max-num-seqs", "4")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-v41", "prompt": "hello", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200
        workers = _children(srv.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        while True:  # the idle engine's heartbeat finds the dead worker; the server answers 503 for 2 s, then exits
            h = httpx.get(srv.url + "/health", timeout=2)
            if h.status_code == 503:
                assert "worker rank 1" in h.json()["detail"], h.text
                # the server reaps the killed worker itself (no zombie), while it still runs: not init after it
                deadline = time.monotonic() + 1.5
                while Path(f"/proc/{workers[0]}").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not Path(f"/proc/{workers[0]}").exists(), Path(f"/proc/{workers[0]}/stat").read_text()
                assert srv.proc.poll() is None
                break
            assert time.monotonic() - t0 < 4 + 2 + 2, "still healthy"
            time.sleep(0.1)
        assert srv.proc.wait(30) == 1, srv.log()
        assert "worker rank 1" in srv.log()
        assert not Path(f"/proc/{workers[0]}").exists()
    finally:
        stop_server(srv)
