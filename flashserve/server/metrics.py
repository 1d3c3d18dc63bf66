"""Prometheus metrics of the server (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("flashserve_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("flashserve_request_finish", "Finished completions by finish reason",
                                ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("flashserve_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("flashserve_generation_tokens", "Tokens generated", labels, registry=r)
        self.ttft = Histogram("flashserve_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("flashserve_time_per_output_token_seconds", "Mean time per output token after "
                              "the first", labels, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("flashserve_e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("flashserve_num_requests_running", "Sequences running in the engine", labels,
                             registry=r)
        self.waiting = Gauge("flashserve_num_requests_waiting", "Sequences waiting in the engine", labels,
                             registry=r)
        self.kv_used = Gauge("flashserve_kv_pages_used", "KV-cache pages in use", labels, registry=r)
        self.kv_total = Gauge("flashserve_kv_pages_total", "KV-cache pages in total", labels, registry=r)
        self.kv_usage = Gauge("flashserve_kv_cache_usage_ratio", "Fraction of KV-cache pages in use", labels,
                              registry=r)
        self.prefix_hit = Gauge("flashserve_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens)", labels,
                                registry=r)
        self.engine_prompt_tokens = Gauge("flashserve_engine_prompt_tokens_total",
                                          "Prompt tokens the engine has processed", labels, registry=r)
        self.engine_generation_tokens = Gauge("flashserve_engine_generation_tokens_total",
                                              "Tokens the engine has generated", labels, registry=r)
        self.decode_compiled = Gauge("flashserve_decode_step_compiled", "1 when decode steps run the compiled step "
                                     "(0: eager, or eager while it compiles in the background)", labels,
                                     registry=r)
        # routed experts streamed under --weight-memory (engine totals, mirrored)
        self.expert_cache = {key: Gauge(f"flashserve_expert_cache_{key}_total", help_, labels, registry=r)
                             for key, help_ in (("hits", "Routed experts found in a layer's expert slots"),
                                                ("misses", "Routed experts read from the checkpoint into a slot"),
                                                ("bytes_read", "Bytes of routed experts read from the checkpoint"),
                                                ("read_ahead", "Routed experts read ahead of their layer's router "
                                                 "(the experts the layer's previous step chose)"),
                                                ("read_ahead_used", "Routed experts read ahead that their layer's "
                                                 "next step then chose"))}
        self.row_cache = {key: Gauge(f"flashserve_engram_row_cache_{key}_total", help_, labels, registry=r)
                          for key, help_ in (("hits", "Engram rows found in a table's row cache"),
                                             ("misses", "Engram rows read from the checkpoint into the row cache"),
                                             ("bytes_read", "Bytes of engram rows read from the checkpoint"))}
        # speculative decoding, under vLLM's counter names (engine totals, mirrored)
        self.spec = {key: Gauge(f"flashserve_spec_decode_{name}_total", help_, labels, registry=r)
                     for key, name, help_ in (
                         ("num_drafts", "num_drafts", "Verification steps that checked drafted tokens"),
                         ("num_draft_tokens", "num_draft_tokens", "Drafted tokens verified"),
                         ("num_accepted_tokens", "num_accepted_tokens", "Drafted tokens accepted"))}
        self.spec_per_pos = Gauge("flashserve_spec_decode_num_accepted_tokens_per_pos_total",
                                  "Drafted tokens accepted, by draft position", labels + ["position"], registry=r)

    def update_engine(self, stats: dict) -> None:
        m = self.model_name
        g = stats.get
        self.running.labels(m).set(g("num_running", 0) or 0)
        self.waiting.labels(m).set(g("num_waiting", 0) or 0)
        used, total = g("kv_pages_used", 0) or 0, g("kv_pages_total", 0) or 0
        self.kv_used.labels(m).set(used)
        self.kv_total.labels(m).set(total)
        self.kv_usage.labels(m).set(used / total if total else 0.0)
        self.prefix_hit.labels(m).set(g("prefix_cache_hit_rate", 0.0) or 0.0)
        self.engine_prompt_tokens.labels(m).set(g("prompt_tokens_total", 0) or 0)
        self.engine_generation_tokens.labels(m).set(g("generation_tokens_total", 0) or 0)
        self.decode_compiled.labels(m).set(1 if g("decode_step") == "compiled" else 0)
        for counts, gauges in ((g("expert_cache"), self.expert_cache), (g("engram_row_cache"), self.row_cache)):
            if counts:
                for key, gauge in gauges.items():
                    if key in counts:
                        gauge.labels(m).set(counts[key])
        spec = g("spec_decode")
        if spec:
            for key, gauge in self.spec.items():
                gauge.labels(m).set(spec[key])
            for pos, n in enumerate(spec["accepted_per_position"]):
                self.spec_per_pos.labels(m, str(pos)).set(n)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_completion(self, *, prompt_tokens: int, generation_tokens: int, ttft: float | None,
                           e2e: float, finish_reasons: list[str | None], decode_tokens: int | None = None) -> None:
        """``decode_tokens``: tokens of the longest choice (TPOT is per choice); defaults to ``generation_tokens``."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generation_tokens)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            per_choice = generation_tokens if decode_tokens is None else decode_tokens
            if per_choice > 1:
                self.tpot.labels(m).observe(max(e2e - ttft, 0.0) / (per_choice - 1))
        self.e2e.labels(m).observe(e2e)
        for r in finish_reasons:
            self.finished.labels(m, r or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
