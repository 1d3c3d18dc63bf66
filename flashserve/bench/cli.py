"""``flashserve bench serve`` and ``flashserve bench sweep``: flags and handlers.

``register(subparsers)`` adds ``bench`` to the ``flashserve`` command; each handler returns an exit code and
raises :class:`~flashserve.errors.UserError` for bad input (reported in one line by the top-level CLI).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ..cli_help import HelpFormatter
from ..engine.options import add_engine_args, engine_config
from ..errors import UserError


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def _extra_body(text: str | None) -> dict[str, object]:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--extra-body: not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UserError("--extra-body must be a JSON object")
    return body


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``serve`` and ``sweep`` (vLLM's names where vLLM has the flag)."""
    t = p.add_argument_group("target (one of)")
    t.add_argument("--model", default=None, help="run this preset / checkpoint in-process (no server)")
    t.add_argument("--base-url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    t.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"),
                   help="the server's API the requests go to")
    t.add_argument("--served-model-name", default=None, help="'model' sent to the server (default: its first)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, checkpoint folder, preset, or flashserve-default (the embedded model) "
                        "counting prompt tokens (default: --model; against a flashserve server, the served "
                        "model's, asked of its /v1/models; else --served-model-name)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=("random", "prefix", "sharegpt"),
                   help="random token prompts, prompts sharing a prefix, or conversations from a file")
    d.add_argument("--dataset-path", default=None, help="sharegpt: a JSON or JSONL file of conversations")
    d.add_argument("--num-prompts", type=int, default=16, help="requests measured (a sweep: at least the level)")
    d.add_argument("--input-len", type=int, default=128, help="random/prefix: prompt tokens (prefix: unique part)")
    d.add_argument("--output-len", type=int, default=None,
                   help="output tokens asked (random/prefix default 64; sharegpt default: each reply's length)")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len·(1±ratio)")
    d.add_argument("--prefix-len", type=int, default=0, help="prefix: tokens shared by every prompt")
    ld = p.add_argument_group("load and sampling")
    ld.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    ld.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    ld.add_argument("--seed", type=int, default=0,
                    help="samples the dataset and the arrival times (as vLLM's); not sent to the server")
    ld.add_argument("--request-seed", type=int, default=None,
                    help="sampling seed sent in every request body (default: none sent)")
    ld.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent (0: greedy)")
    ld.add_argument("--ignore-eos", action="store_true", help="generate exactly the asked output length")
    ld.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    r = p.add_argument_group("report")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    r.add_argument("--goodput", nargs="+", default=(), metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    r.add_argument("--num-devices", type=int, default=1, help="devices serving (for per-device throughput, cost)")
    r.add_argument("--device-cost-per-hour", type=float, default=None, help="US$ per device-hour")
    r.add_argument("--save-detailed", action="store_true", help="also store per-request TTFTs, ITLs and texts")
    r.add_argument("--no-progress", action="store_true", help="no live progress bar")
    # the in-process engine (--model) takes serve's engine flags, derived from EngineConfig with its defaults;
    # --tokenizer and --seed keep their benchmark meanings (the token counter, the dataset seed)
    add_engine_args(p, exclude=frozenset({"tokenizer", "seed"}))


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    """The in-process engine's options (every EngineConfig field but the model), checked before loading."""
    if not a.model:
        return {}
    from ..engine import preflight

    config = engine_config(a)
    preflight.check(config)
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}


def serve_config(a: argparse.Namespace, max_concurrency: int | None):
    """The :class:`ServeConfig` the flags describe."""
    from .backends import Sampling
    from .serve import ServeConfig

    return ServeConfig(
        model=a.model, base_url=a.base_url, served_model=a.served_model_name or a.model, endpoint=a.endpoint,
        api_key=a.api_key, tokenizer=a.tokenizer, dataset=a.dataset_name, dataset_path=a.dataset_path,
        num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
        range_ratio=a.random_range_ratio, prefix_len=a.prefix_len, request_rate=a.request_rate,
        burstiness=a.burstiness, max_concurrency=max_concurrency, num_warmups=a.num_warmups, seed=a.seed,
        sampling=Sampling(a.temperature, a.ignore_eos, a.request_seed, _extra_body(a.extra_body)),
        percentiles=_float_list(a.metric_percentiles, "--metric-percentiles"), goodput=tuple(a.goodput),
        num_devices=a.num_devices, device_cost_per_hour=a.device_cost_per_hour,
        engine_options=engine_options(a), progress=not a.no_progress,
        save_detailed=a.save_detailed)


def _serve(a: argparse.Namespace) -> int:
    from .serve import run, summary_lines

    cfg = serve_config(a, a.max_concurrency)
    result = run(cfg)
    print("\n".join(summary_lines(result, cfg.percentiles)))
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.result_file}")
    return 0 if result["completed"] else 1


PLAN_FLAGS = ("plan_model", "plan_gpus", "plan_tp", "plan_ep", "plan_stack", "plan_accept_length",
              "plan_draft_tokens")


def _plan_setup(a: argparse.Namespace):
    """The planner setup drawn beside the measured curve: --plan-* flags, cpu-local for --model by default."""
    from .sweep import PlanSetup

    if not a.plan_hardware and not a.model:
        given = [f"--{k.replace('_', '-')}" for k in PLAN_FLAGS if getattr(a, k) is not None]
        if given:
            raise UserError(f"{', '.join(given)} need --plan-hardware when the target is a --base-url")
        return None
    return PlanSetup(a.plan_hardware or "cpu-local", a.plan_model, a.plan_weight_dtype, a.plan_gpus, a.plan_tp or 1,
                     a.plan_ep, a.plan_stack, a.plan_accept_length, a.plan_draft_tokens)


def _sweep(a: argparse.Namespace) -> int:
    from .sweep import levels_from, run_sweep

    levels = levels_from(a.concurrency, a.max_concurrency)
    plan = _plan_setup(a)
    paths = run_sweep(serve_config(a, None), levels, Path(a.out), a.label, plan)
    for line in paths.lines:
        print(line)
    return 1 if paths.failed_levels else 0


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``bench serve`` and ``bench sweep`` to a parent parser's subcommands."""
    bench = subparsers.add_parser("bench", help="serving benchmark (vLLM bench serve metrics) and sweeps",
                                  formatter_class=HelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="one load test: TTFT, TPOT, ITL, throughput, goodput, cost",
                           formatter_class=HelpFormatter)
    add_serve_arguments(serve)
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    serve.add_argument("--result-file", default=None, help="write the result JSON here")
    serve.set_defaults(func=_serve)
    sweep = sub.add_parser("sweep", help="serve at concurrency 1, 2, 4, ...: JSON per point and a PNG chart",
                           formatter_class=HelpFormatter)
    add_serve_arguments(sweep)
    sweep.add_argument("--concurrency", default=None, help="comma-separated levels, e.g. 1,4,16")
    sweep.add_argument("--max-concurrency", type=int, default=None, help="levels 1, 2, 4, ... up to this")
    sweep.add_argument("--out", required=True, help="folder for the point JSONs, sweep.json and sweep.png")
    sweep.add_argument("--label", default=None, help="this configuration's curve name (default: model or URL)")
    sweep.add_argument("--plan-hardware", default=None,
                       help="draw the planner's curve for this hardware preset (default: cpu-local for --model)")
    sweep.add_argument("--plan-model", default=None, help="planner model (default: --model / served model)")
    sweep.add_argument("--plan-weight-dtype", default="fp32", help="planner expert dtype (fp4, fp8, bf16, fp32)")
    sweep.add_argument("--plan-gpus", type=int, default=None, help="planner device count (default --num-devices)")
    sweep.add_argument("--plan-tp", type=int, default=None, help="planner attention TP (default 1)")
    sweep.add_argument("--plan-ep", type=int, default=None, help="planner expert parallelism (default --plan-gpus)")
    sweep.add_argument("--plan-stack", default=None,
                       help="planner serving-stack profile (default: the planner's for the model; 'none': off)")
    sweep.add_argument("--plan-accept-length", type=float, default=None,
                       help="planner acceptance length (default: the server's measured one, else 1)")
    sweep.add_argument("--plan-draft-tokens", type=int, default=None,
                       help="planner drafted tokens per step (default: the model's drafter block)")
    sweep.set_defaults(func=_sweep)
    return bench
