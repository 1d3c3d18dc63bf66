"""Cold and warm start of ``flashserve serve`` on the embedded model with no flags: seconds from the command to
``/health`` ready and to the first token of a first request, then per-request decode speed while the step compiles
in the background (a child process compiles, the server loads its graphs) and once it is compiled, against the eager
step (``--enforce-eager``) in the same run; ``--thread`` adds a cold start compiling on a thread of the serving
process (``--no-compile-child``) over caches of its own.

Cold: empty inductor and C++-extension caches (``TORCHINDUCTOR_CACHE_DIR``, ``TORCH_EXTENSIONS_DIR`` pointed at
new folders); warm: the same folders again, as a later start finds them. One request at a time (one agent),
greedy, ``--tokens`` new tokens each, until the step has been compiled for three requests in a row (or
``--limit`` seconds).

    python scripts/bench_cold_start.py [--tokens 128] [--limit 900] [--thread] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiled(url: str) -> bool:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("flashserve_decode_step_compiled{"):
            return float(line.rsplit(" ", 1)[1]) == 1.0
    return False


def one_request(url: str, model: str, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, decode tokens/s after it, tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    end = time.perf_counter()  # ignore_eos: exactly ``tokens`` were made
    return first - t0, (tokens - 1) / max(end - first, 1e-9), tokens


def start(flags: list[str], env: dict, tokens: int, limit: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", "--port", str(port), *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready = time.perf_counter() - t0
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        runs, in_a_row, eager = [], 0, "--enforce-eager" in flags
        while time.perf_counter() - t0 < limit:
            at = time.perf_counter() - t0
            before = compiled(url)
            ttft, rate, _ = one_request(url, model, tokens)
            after = compiled(url)
            runs.append({"at_s": at, "ttft_s": ttft, "decode_tok_s": rate, "compiled": before and after})
            if len(runs) == 1:
                first_token = at + ttft
            in_a_row = in_a_row + 1 if (before and after) else 0
            if in_a_row >= 3 or (eager and len(runs) >= 4):
                break
        done = next((r["at_s"] for r in runs if r["compiled"]), None)
        during = [r["decode_tok_s"] for r in runs if not r["compiled"]]
        settled = [r["decode_tok_s"] for r in runs if r["compiled"]] if not eager else during
        return {"ready_s": ready, "first_token_s": first_token, "compiled_by_s": done,
                "decode_while_compiling": statistics.median(during) if during and not eager else None,
                "decode_settled": statistics.median(settled) if settled else None, "runs": runs}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a start may take to settle")
    ap.add_argument("--thread", action="store_true", help="also a cold start compiling on a thread of the server")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        def env_in(name: str) -> dict:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, name, "inductor"),
                   "TORCH_EXTENSIONS_DIR": os.path.join(tmp, name, "extensions")}
            env.pop("OMP_NUM_THREADS", None)
            return env

        runs = [("no flags, cold", [], "child"), ("no flags, warm", [], "child"),
                ("--enforce-eager, warm", ["--enforce-eager"], "child")]
        if a.thread:
            runs.append(("--no-compile-child, cold", ["--no-compile-child"], "thread"))
        for label, flags, caches in runs:
            r = results[label] = start(flags, env_in(caches), a.tokens, a.limit)
            during = ("" if r["decode_while_compiling"] is None
                      else f", {r['decode_while_compiling']:.1f} tok/s while compiling")
            by = "" if r["compiled_by_s"] is None else f", compiled by {r['compiled_by_s']:.0f} s"
            settled = (f"settled {r['decode_settled']:6.1f} tok/s" if r["decode_settled"] is not None
                       else f"not compiled for three requests in a row within {a.limit:.0f} s")
            print(f"{label:>32}: ready {r['ready_s']:5.1f} s, first token {r['first_token_s']:5.1f} s{during}{by}, "
                  f"{settled}", flush=True)
    eager = results["--enforce-eager, warm"]["decode_settled"]
    for label in [k for k in results if not k.startswith("--enforce-eager")]:
        r = results[label]
        if r["decode_settled"] and eager:
            print(f"{label}: settled decode {r['decode_settled'] / eager:.2f}x the eager step's"
                  + (f", {r['decode_while_compiling'] / eager:.2f}x while compiling" if r["decode_while_compiling"]
                     else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
