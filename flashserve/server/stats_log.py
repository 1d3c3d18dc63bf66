"""The periodic "engine is busy" log line (as vLLM's): throughput since the last line, queues, cache, prefix hits."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("flashserve.server")

# weights streamed under --weight-memory: the stats key of each cache, its name in the line and the unit of the bytes
# read a token (a token reads megabytes of routed experts and kilobytes of engram rows)
_CACHES = {"expert_cache": ("expert cache", 1e6, "MB"), "engram_row_cache": ("engram row cache", 1e3, "KB")}


class StatsLogger:
    """Fed every engine stats snapshot; logs at most once per ``interval`` seconds, and only while busy (or on
    the first idle snapshot after busy, so the last throughput is not lost)."""

    def __init__(self, interval: float, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self.last_t = clock()
        self.last_prompt = self.last_gen = 0
        self.last = {part: {"hits": 0, "misses": 0, "bytes_read": 0} for part in _CACHES}
        self.was_busy = False

    def update(self, stats: dict) -> str | None:
        """The line logged for this snapshot, or None."""
        if self.interval <= 0:
            return None
        now = self.clock()
        busy = bool(stats.get("num_running") or stats.get("num_waiting"))
        if now - self.last_t < self.interval or not (busy or self.was_busy):
            return None
        dt = max(now - self.last_t, 1e-9)
        prompt, gen = int(stats.get("prompt_tokens_total", 0)), int(stats.get("generation_tokens_total", 0))
        total = stats.get("kv_pages_total") or 0
        line = (f"engine: prompt {(prompt - self.last_prompt) / dt:.1f} tok/s, generation "
                f"{(gen - self.last_gen) / dt:.1f} tok/s, running {stats.get('num_running', 0)}, waiting "
                f"{stats.get('num_waiting', 0)}, kv cache {100 * (stats.get('kv_pages_used', 0) / total if total else 0):.1f}%"
                f" used, prefix hit rate {100 * stats.get('prefix_cache_hit_rate', 0.0):.1f}%"
                + (f", decode step {stats['decode_step']}" if stats.get("decode_step") else ""))
        tokens = max(prompt - self.last_prompt + gen - self.last_gen, 1)
        for part, (what, unit, unit_name) in _CACHES.items():
            counts = stats.get(part)
            if counts:
                d = {k: counts[k] - self.last[part][k] for k in self.last[part]}
                looked = d["hits"] + d["misses"]
                line += (f", {what} hit rate {100 * d['hits'] / looked if looked else 0.0:.1f}%, "
                         f"{d['bytes_read'] / tokens / unit:.2f} {unit_name} read a token")
                self.last[part] = {k: counts[k] for k in self.last[part]}
        self.last_t, self.last_prompt, self.last_gen, self.was_busy = now, prompt, gen, busy
        log.info(line)
        return line
