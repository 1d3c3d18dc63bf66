"""``flashserve bench serve``: one load test against a server or an in-process engine, summarised under
vLLM's result field names plus per-agent speed and cost."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Sequence

import numpy as np

from ..errors import UserError
from .backends import Backend, EngineBackend, OpenAIBackend, Sampling
from .datasets import SampleRequest, random_requests, sharegpt_requests
from .load import arrival_gaps, run_load
from .metrics import RequestResult, agent_and_cost, compute_metrics, parse_goodput
from .spec_metrics import acceptance, read_counters

DATASETS = ("random", "prefix", "sharegpt")
DEFAULT_OUTPUT_LEN = 64


@dataclass(frozen=True)
class ServeConfig:
    """Everything one run needs (the CLI's flags)."""

    model: str | None = None  # in-process engine of this preset / checkpoint
    base_url: str | None = None  # or an OpenAI-compatible server
    served_model: str | None = None  # the ``model`` field sent (default: --model, else the server's first)
    model_root: str | None = None  # a flashserve server's model as this machine reads it (from /v1/models)
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    tokenizer: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 16
    input_len: int = 128
    output_len: int | None = None  # random/prefix: 64 when None; sharegpt: each reply's length when None
    range_ratio: float = 0.0
    prefix_len: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    percentiles: tuple[float, ...] = (99.0,)
    goodput: tuple[str, ...] = ()
    num_devices: int = 1
    device_cost_per_hour: float | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    save_detailed: bool = False


def check(cfg: ServeConfig) -> None:
    """Refuse contradictory or missing flags before loading anything."""
    if (cfg.model is None) == (cfg.base_url is None):
        raise UserError("give exactly one of --model (in-process engine) or --base-url (a running server)")
    if cfg.dataset not in DATASETS:
        raise UserError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {cfg.dataset!r}")
    if cfg.dataset == "sharegpt" and not cfg.dataset_path:
        raise UserError("--dataset-name sharegpt needs --dataset-path FILE.json|.jsonl")
    if cfg.dataset == "prefix" and cfg.prefix_len < 1:
        raise UserError("--dataset-name prefix needs --prefix-len >= 1")
    if cfg.num_devices < 1:
        raise UserError(f"--num-devices must be >= 1, got {cfg.num_devices}")
    if cfg.num_warmups < 0:
        raise UserError(f"--num-warmups must be >= 0, got {cfg.num_warmups}")
    if cfg.device_cost_per_hour is not None and cfg.device_cost_per_hour < 0:
        raise UserError(f"--device-cost-per-hour must be >= 0, got {cfg.device_cost_per_hour}")
    for p in cfg.percentiles:
        if not 0 < p <= 100:
            raise UserError(f"--metric-percentiles must lie in (0, 100], got {p:g}")
    parse_goodput(cfg.goodput)


def tokenizer_name(cfg: ServeConfig) -> str:
    """What counts prompt tokens: --tokenizer, else --model, else --served-model-name (:func:`with_tokenizer`
    first asks a flashserve server what it serves); refused when none is known."""
    name = cfg.tokenizer or cfg.model or cfg.served_model
    if not name:
        raise UserError("bench needs a tokenizer to count prompt tokens: pass --tokenizer (a tokenizer.json, a "
                        "checkpoint folder or a preset), or --served-model-name naming a preset or folder")
    return name


def local_model(name: str) -> str | None:
    """``name`` as a model this machine can read: a runnable preset, a folder holding ``tokenizer.json``, or
    the embedded default model's served name (its folder); None when it is none of these."""
    from pathlib import Path

    from ..config import RUNNABLE_PRESETS
    from ..models import DEFAULT_SERVED_NAME, default_model

    if name == DEFAULT_SERVED_NAME:
        return default_model()
    if name in RUNNABLE_PRESETS or (Path(name) / "tokenizer.json").is_file():
        return name
    return None


def server_model(base_url: str, served_model: str | None, api_key: str | None) -> tuple[str, str] | None:
    """(served name, local model) of what a server serves, from its ``/v1/models`` card: a flashserve server
    names what it loaded in ``root`` (a preset or a checkpoint folder) and its served name in ``id``
    (``flashserve-default``: the embedded model). None for another server when ``served_model`` is given (its
    tokenizer may still be a preset of that name); refused when nothing names a model this machine can read."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pass_it = "pass --tokenizer (a tokenizer.json, a checkpoint folder or a preset)"
    try:
        resp = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise UserError(f"--base-url: cannot reach {base_url} to ask which model it serves (for the tokenizer "
                        f"that counts prompt tokens; or pass --tokenizer): {exc}") from None
    try:
        cards = resp.json().get("data") if resp.status_code == 200 else None
    except (ValueError, AttributeError):
        cards = None
    if not isinstance(cards, list) or not cards or not all(isinstance(c, dict) for c in cards):
        if served_model:
            return None
        key = " (it wants an API key: --api-key)" if resp.status_code == 401 else ""
        raise UserError(f"--tokenizer: {url} answered HTTP {resp.status_code}{key} without a model list; {pass_it}")
    card = next((c for c in cards if c.get("id") == served_model), cards[0])
    if card.get("owned_by") != "flashserve":
        if served_model:
            return None
        raise UserError(f"--tokenizer: {base_url} serves {card.get('id')!r}, not a flashserve model, so its "
                        f"tokenizer is not known here; {pass_it}")
    for name in (card.get("root"), card.get("id")):
        if isinstance(name, str) and (found := local_model(name)):
            return str(card.get("id")), found
    raise UserError(f"--tokenizer: {base_url} serves {card.get('id')!r} from {card.get('root')!r}, which is "
                    f"neither a preset nor a folder on this machine; {pass_it}")


def load_bench_tokenizer(name: str) -> Any:
    """The tokenizer that counts prompt tokens: a ``tokenizer.json`` file, a checkpoint folder holding one,
    a runnable preset's built-in tokenizer, or ``flashserve-default`` (the embedded model, by the name
    ``flashserve serve`` gives it); anything else is refused (a wrong tokenizer miscounts)."""
    from pathlib import Path

    if not name.strip():
        raise UserError("--tokenizer: empty name; pass a tokenizer.json, a checkpoint folder or a preset")

    from ..config import RUNNABLE_PRESETS
    from ..engine.tokenizer import Tokenizer, load_tokenizer
    from ..models import DEFAULT_SERVED_NAME

    path = Path(name)
    if path.is_file() and path.name.endswith(".json"):
        from tokenizers import Tokenizer as HFTokenizer

        return Tokenizer(HFTokenizer.from_file(str(path)))
    if (found := local_model(name)) is not None:
        return load_tokenizer(found)
    raise UserError(f"--tokenizer: {name!r} is not a tokenizer.json, a folder holding one, {DEFAULT_SERVED_NAME} "
                    f"(the embedded model) or one of the presets {', '.join(RUNNABLE_PRESETS)}; pass --tokenizer "
                    f"for the served model")


def build_requests(cfg: ServeConfig, tok: Any, n: int, seed: int) -> list[SampleRequest]:
    """``n`` requests of the configured dataset."""
    if cfg.dataset == "sharegpt":
        return sharegpt_requests(tok, cfg.dataset_path or "", n, cfg.output_len, seed)
    prefix = cfg.prefix_len if cfg.dataset == "prefix" else 0
    out = DEFAULT_OUTPUT_LEN if cfg.output_len is None else cfg.output_len
    return random_requests(tok, n, cfg.input_len, out, cfg.range_ratio, prefix, seed)


def make_backend(cfg: ServeConfig, tok: Any) -> Backend:
    if cfg.model is not None:
        EngineBackend.params(1, cfg.sampling)  # a bad --extra-body fails here, before the engine loads
        return EngineBackend(cfg.model, **cfg.engine_options)
    return OpenAIBackend(cfg.base_url or "", cfg.endpoint, cfg.served_model or "", tok.encode, cfg.api_key)


def _lengths(values: Sequence[int]) -> dict[str, float]:
    a = np.asarray(values if len(values) else [0])
    return {"min": int(a.min()), "mean": float(a.mean()), "max": int(a.max())}


def _record(cfg: ServeConfig, backend: Backend, requests: Sequence[SampleRequest],
            results: Sequence[RequestResult]) -> dict[str, object]:
    """Settings of the run (dataset, load, sampling, lengths) under vLLM's names where it has one."""
    s = cfg.sampling
    out: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), "backend": backend.name,
        "base_url": cfg.base_url, "endpoint": cfg.endpoint if cfg.base_url else None,
        "model_id": cfg.model or cfg.served_model, "tokenizer_id": cfg.tokenizer or cfg.model,
        "num_prompts": len(requests), "num_warmups": cfg.num_warmups,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "dataset_name": cfg.dataset, "dataset_path": cfg.dataset_path, "random_input_len": cfg.input_len,
        "random_output_len": cfg.output_len if cfg.output_len is not None else (
            None if cfg.dataset == "sharegpt" else DEFAULT_OUTPUT_LEN), "random_range_ratio": cfg.range_ratio,
        "random_prefix_len": cfg.prefix_len if cfg.dataset == "prefix" else 0,
        "seed": cfg.seed, "request_seed": s.seed, "temperature": s.temperature, "ignore_eos": s.ignore_eos, "extra_body": s.extra_body,
        "input_len_stats": _lengths([r.prompt_len for r in requests]),
        "output_len_stats": _lengths([r.output_tokens for r in results if r.success]),
        "requested_output_len_stats": _lengths([r.output_len for r in requests]),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "errors": [r.error for r in results],
    }
    if cfg.save_detailed:
        out.update(ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   generated_texts=[r.generated_text for r in results])
    return out


async def _timed_run(backend: Backend, cfg: ServeConfig, requests: list[SampleRequest]) -> tuple[list[RequestResult], float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not (cfg.progress and sys.stdout.isatty()), transient=True) as bar:  # piped: no bar
        task = bar.add_task("bench", total=len(requests))
        start = time.perf_counter()
        results = await run_load(requests, lambda r: backend.send(r, cfg.sampling), gaps, cfg.max_concurrency,
                                 on_done=lambda _: bar.advance(task))
        return results, time.perf_counter() - start


async def _measure(cfg: ServeConfig, backend: Backend, tok: Any) -> dict[str, object]:
    """Warm-up requests (not measured), the timed requests, and the summary dict, on a started backend."""
    requests = build_requests(cfg, tok, cfg.num_prompts, cfg.seed)
    if cfg.num_warmups:
        warm = build_requests(cfg, tok, cfg.num_warmups, cfg.seed + 1)
        await run_load(warm, lambda r: backend.send(r, cfg.sampling), [0.0] * len(warm), cfg.max_concurrency)
    before = read_counters(await backend.server_metrics())
    results, duration = await _timed_run(backend, cfg, requests)
    spec = acceptance(before, read_counters(await backend.server_metrics()))
    metrics = compute_metrics(results, duration, cfg.percentiles, parse_goodput(cfg.goodput))
    return {**_record(cfg, backend, requests, results), **metrics, **spec,
            **agent_and_cost(metrics, cfg.num_devices, cfg.device_cost_per_hour)}


async def run_async(cfg: ServeConfig, backend: Backend | None = None, tok: Any = None) -> dict[str, object]:
    """One run. A ``backend`` passed in is the caller's (already started, left open); otherwise one is made
    from ``cfg``, started and closed here."""
    check(cfg)
    tok = tok or load_bench_tokenizer(tokenizer_name(cfg))
    if backend is not None:
        return await _measure(cfg, backend, tok)
    backend = make_backend(cfg, tok)
    await backend.start()
    try:
        return await _measure(cfg, backend, tok)
    finally:
        await backend.close()


def with_tokenizer(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` checked, its tokenizer named: without --tokenizer against a server, a flashserve server's model
    (also kept as ``model_root``, and its served name as ``served_model`` when none was given)."""
    check(cfg)
    if not cfg.tokenizer and cfg.base_url and (found := server_model(cfg.base_url, cfg.served_model, cfg.api_key)):
        served, local = found
        return replace(cfg, tokenizer=local, served_model=cfg.served_model or served, model_root=local)
    return replace(cfg, tokenizer=tokenizer_name(cfg))


def run(cfg: ServeConfig) -> dict[str, object]:
    """:func:`run_async` from synchronous code."""
    return asyncio.run(run_async(with_tokenizer(cfg)))


def summary_lines(r: dict[str, Any], percentiles: Sequence[float]) -> list[str]:
    """The printed report: counts, throughputs, latency summaries, per-agent speed and cost."""
    from .metrics import percentile_key

    lines = [f"successful requests            {r['completed']} (failed {r['failed']})"]
    first_error = next((e for e in r.get("errors", []) if e), "")
    if first_error:
        lines.append(f"first error                    {first_error[:200]}")
    lines += [f"benchmark duration             {r['duration']:.2f} s",
              f"input / output tokens          {r['total_input_tokens']} / {r['total_output_tokens']}",
              f"request throughput             {r['request_throughput']:.2f} req/s",
              f"output token throughput        {r['output_throughput']:.2f} tok/s",
              f"total token throughput         {r['total_token_throughput']:.2f} tok/s"]
    if r.get("request_goodput") is not None:
        lines.append(f"request goodput                {r['request_goodput']:.2f} req/s")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        pct = "  ".join(f"{percentile_key(p)} {r[f'{percentile_key(p)}_{name}_ms']:.2f}" for p in percentiles)
        lines.append(f"{label:<14} ms: mean {r[f'mean_{name}_ms']:.2f}  median {r[f'median_{name}_ms']:.2f}  "
                     f"std {r[f'std_{name}_ms']:.2f}  {pct}")
    if "spec_decode_acceptance_length" in r:
        lines.append(f"speculative acceptance         {r['spec_decode_acceptance_rate']:.1f}% "
                     f"(length {r['spec_decode_acceptance_length']:.2f})")
    agent = r.get("tokens_per_s_per_agent")
    lines.append(f"per-agent decode speed         {agent:.2f} tok/s (1000 / median TPOT)" if agent else
                 "per-agent decode speed         n/a (no request produced 2 tokens)")
    lines.append(f"output tokens/s per device     {r['output_tokens_per_s_per_device']:.2f} "
                 f"({r['num_devices']} device(s))")
    if r.get("cost_per_million_output_tokens") is not None:
        lines.append(f"cost per million output tokens ${r['cost_per_million_output_tokens']:.4g} "
                     f"at ${r['device_cost_per_hour']}/device-hour")
    return lines
