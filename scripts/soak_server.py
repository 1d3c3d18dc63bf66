"""Soak run of ``flashserve serve``: many concurrent streaming clients for minutes, with mixed lengths, clients
that disconnect mid-stream and bad requests among them. Reports requests served, errors by kind (a 5xx is a
failure), KV pages in use once the load stops (must be back to 0) and the server's resident memory at the
start and the end.

    python scripts/soak_server.py                      # 256 clients, 5 minutes, tiny-v41 (the issue's run)
    python scripts/soak_server.py --clients 64 --duration 60

It starts its own server process (or uses ``--url``) and prints one JSON summary; exit status 1 on any 5xx,
transport error, or pages left in use.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
BAD = [b"{not json", json.dumps({"messages": []}).encode(), json.dumps({"messages": MSG, "max_tokens": -3}).encode(),
       json.dumps({"messages": MSG, "temperature": "hot"}).encode(),
       json.dumps({"messages": MSG, "max_tokens": 10 ** 7}).encode(),
       json.dumps({"messages": MSG, "response_format": {"type": "json_schema",
                                                        "json_schema": {"schema": {"$ref": "#/x"}}}}).encode()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def stream_chat(client: httpx.AsyncClient, body: dict, stats: collections.Counter, leave_after: int | None):
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            stats[f"http_{r.status_code}"] += 1
            return
        chunks, finished = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                finished = True
                break
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                stats["disconnected"] += 1
                return
        stats["served_stream" if finished else "stream_without_done"] += 1


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: collections.Counter) -> None:
    kind = rng.random()
    thinking = {"chat_template_kwargs": {"thinking": rng.random() < 0.3}}
    body = {"messages": MSG, "max_tokens": rng.choice([1, 4, 16, 32, 64, 128]), **thinking}
    if kind < 0.65:
        await stream_chat(client, body, stats, None)
    elif kind < 0.75:
        await stream_chat(client, {**body, "max_tokens": 256, "ignore_eos": True}, stats, rng.randint(1, 8))
    elif kind < 0.85:
        r = await client.post("/v1/chat/completions", content=rng.choice(BAD),
                              headers={"Content-Type": "application/json"})
        stats[f"bad_{r.status_code}"] += 1
    elif kind < 0.92:
        rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
        await stream_chat(client, {**body, "max_tokens": 64, "response_format": rf}, stats, None)
    else:
        r = await client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens":
                                                        rng.choice([1, 8, 32])})
        stats["served_plain" if r.status_code == 200 else f"http_{r.status_code}"] += 1


async def client_loop(url: str, seed: int, deadline: float, stats: collections.Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=60)) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, rng, stats)
            except httpx.HTTPError as e:
                stats[f"transport_{type(e).__name__}"] += 1


def start_server(args: argparse.Namespace) -> tuple[str, subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False).name
    cmd = [sys.executable, "-m", "flashserve", "serve", args.model, "--port", str(port), "--max-num-seqs",
           str(args.max_num_seqs), "--max-waiting", str(args.max_waiting), "--kv-memory", args.kv_memory,
           "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc, log
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"server did not start; see {log}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--model", default="tiny-v41")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=512)
    p.add_argument("--kv-memory", default="256MiB")
    args = p.parse_args()
    url, proc, log = start_server(args)
    try:
        rss_start = rss_mib(proc.pid)
        stats: collections.Counter = collections.Counter()
        t0 = time.monotonic()

        async def run() -> None:
            deadline = time.monotonic() + args.duration
            await asyncio.gather(*(client_loop(url, i, deadline, stats) for i in range(args.clients)))

        asyncio.run(run())
        elapsed = time.monotonic() - t0
        time.sleep(2)  # the last aborts are processed within a step
        pages = metric(url, "flashserve_kv_pages_used")
        summary = {"clients": args.clients, "duration_s": round(elapsed, 1), "outcomes": dict(sorted(stats.items())),
                   "requests": sum(stats.values()),
                   "server_5xx": sum(v for k, v in stats.items() if k.split("_")[-1].startswith("5")),
                   "transport_errors": sum(v for k, v in stats.items() if k.startswith("transport_")),
                   "kv_pages_used_after": pages, "rss_mib_start": round(rss_start, 1),
                   "rss_mib_end": round(rss_mib(proc.pid), 1),
                   "traceback_in_log": "Traceback" in Path(log).read_text()}
        print(json.dumps(summary, indent=2))
        ok = not summary["server_5xx"] and not summary["transport_errors"] and pages == 0
        return 0 if ok and not summary["traceback_in_log"] else 1
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
