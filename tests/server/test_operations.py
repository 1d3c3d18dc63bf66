"""Operations logging: the busy-engine stats line (throughput over the interval, queues, cache, prefix hits),
and the warning for a server open to the network without a key."""

from __future__ import annotations

import subprocess
import sys

from flashserve.server.stats_log import StatsLogger

from serverproc import MODEL, REPO


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stats(prompt: int, gen: int, running: int, waiting: int = 0, used: int = 0) -> dict:
    return {"prompt_tokens_total": prompt, "generation_tokens_total": gen, "num_running": running,
            "num_waiting": waiting, "kv_pages_used": used, "kv_pages_total": 200, "prefix_cache_hit_rate": 0.25}


def test_stats_line_reports_rates_over_the_interval_only_while_busy():
    clock = Clock()
    log = StatsLogger(10.0, clock)
    clock.t = 5.0
    assert log.update(stats(100, 10, running=2)) is None  # within the interval
    clock.t = 10.0
    line = log.update(stats(400, 210, running=3, waiting=1, used=50))
    assert line == ("engine: prompt 40.0 tok/s, generation 21.0 tok/s, running 3, waiting 1, kv cache 25.0% used, "
                    "prefix hit rate 25.0%")
    clock.t = 20.0
    assert "generation 0.0 tok/s, running 0" in log.update(stats(400, 210, running=0))  # the idle line after busy
    clock.t = 40.0
    assert log.update(stats(400, 210, running=0)) is None  # idle: quiet
    assert StatsLogger(0.0, clock).update(stats(1, 1, running=1)) is None  # interval 0: never


def test_stats_line_and_metrics_report_the_expert_cache_over_the_interval():
    """Under --weight-memory the line adds the expert cache's hit rate and the bytes read a token since the last
    line; /metrics mirrors the engine's totals."""
    from flashserve.server.metrics import ServerMetrics

    clock = Clock()
    log = StatsLogger(10.0, clock)
    first = {**stats(100, 0, running=1), "expert_cache": {"hits": 30, "misses": 10, "bytes_read": 4_000_000}}
    clock.t = 10.0
    assert log.update(first).endswith(", expert cache hit rate 75.0%, 0.04 MB read a token")
    clock.t = 20.0
    later = {**stats(100, 50, running=1), "expert_cache": {"hits": 120, "misses": 10, "bytes_read": 4_000_000,
                                                           "read_ahead": 7, "read_ahead_used": 5}}
    assert log.update(later).endswith(", expert cache hit rate 100.0%, 0.00 MB read a token")
    metrics = ServerMetrics("m")
    metrics.update_engine(later)
    for name, value in (("hits", 120), ("misses", 10), ("bytes_read", 4_000_000), ("read_ahead", 7),
                        ("read_ahead_used", 5)):
        assert metrics.registry.get_sample_value(f"flashserve_expert_cache_{name}_total", {"model_name": "m"}) == value
    assert "flashserve_expert_cache_bytes_read_total" in metrics.render().decode()


def test_stats_line_and_metrics_report_the_engram_row_cache_in_kilobytes_a_token():
    from flashserve.server.metrics import ServerMetrics

    clock = Clock()
    log = StatsLogger(10.0, clock)
    rows = {"hits": 90, "misses": 30, "bytes_read": 30 * 264}  # 30 rows of V4.1-Flash's 264 bytes
    experts = {"hits": 5, "misses": 15, "bytes_read": 15 * 18_900_000}
    clock.t = 10.0
    line = log.update({**stats(0, 2, running=1), "expert_cache": experts, "engram_row_cache": rows})
    assert line.endswith(", expert cache hit rate 25.0%, 141.75 MB read a token, "
                         "engram row cache hit rate 75.0%, 3.96 KB read a token")
    metrics = ServerMetrics("m")
    metrics.update_engine({**stats(0, 2, running=1), "engram_row_cache": rows})
    for name, value in rows.items():
        assert metrics.registry.get_sample_value(f"flashserve_engram_row_cache_{name}_total",
                                                 {"model_name": "m"}) == value
    assert metrics.registry.get_sample_value("flashserve_expert_cache_hits_total", {"model_name": "m"}) is None


def test_non_loopback_host_without_key_is_warned_about():
    p = subprocess.run([sys.executable, "-m", "flashserve", "serve", MODEL, "--host", "0.0.0.0", "--max-num-seqs",
                        "0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "listening on 0.0.0.0 without an API key" in p.stderr and p.returncode == 2
    p = subprocess.run([sys.executable, "-m", "flashserve", "serve", MODEL, "--host", "127.0.0.1", "--max-num-seqs",
                        "0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "without an API key" not in p.stderr and p.returncode == 2
