"""``flashserve serve MODEL``: the OpenAI-compatible server.

``register(subparsers)`` adds the ``serve`` command to the ``flashserve`` CLI (``flashserve/cli.py``).
"""

from __future__ import annotations

import argparse
import logging

from ..engine.cli import add_compile_arg, add_quantization_arg, add_threads_arg
from .protocol import DEFAULT_MAX_REQUEST_BYTES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset name (e.g. tiny-v41) or checkpoint folder")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize")
    g.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (default: MODEL); repeatable")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--default-thinking", choices=("on", "off"), default="on",
                   help="V4.1 chat mode when a request says nothing (chat_template_kwargs.thinking / "
                        "reasoning_effort choose per request)")
    g.add_argument("--chat-template", choices=("auto", "v41", "plain"), default="auto",
                   help="prompt encoder: V4.1 DSML for V4.1 checkpoints, plain role text otherwise")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + output tokens)")
    e.add_argument("--max-waiting", type=int, default=256, help="waiting-queue bound; beyond it requests get 429")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--kv-memory", default="1GiB", help="KV-cache budget, e.g. 512MiB, 4GiB")
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--cache-dtype", default=None, choices=("packed", "float"),
                   help="KV cache layout (default: packed for V4.1, float for V4)")
    e.add_argument("--exact-prefill", action="store_true")
    e.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    e.add_argument("--seed", type=int, default=0)
    add_threads_arg(e)
    add_compile_arg(e)
    add_quantization_arg(e)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description="Serve MODEL over an OpenAI-compatible HTTP API.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def build_engine(args: argparse.Namespace):
    from flashserve.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_memory=args.kv_memory,
                       cache_dtype=args.cache_dtype, exact_prefill=args.exact_prefill,
                       enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len,
                       max_waiting=args.max_waiting, seed=args.seed, threads=args.threads,
                       enforce_eager=args.enforce_eager, quantization=args.quantization)
    return LLMEngine(cfg)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import ServerConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(args)
    names = tuple(args.served_model_name or ())
    cfg = ServerConfig(model_name=names[0] if names else args.model, served_names=names[1:] + (args.model,),
                       api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                       default_thinking=args.default_thinking == "on", chat_template=args.chat_template,
                       max_model_len=engine.max_model_len)
    app = create_app(engine, cfg)
    logging.getLogger("flashserve.server").info(
        "serving %s on http://%s:%d (max_model_len %d)", cfg.model_name, args.host, args.port, engine.max_model_len)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                timeout_graceful_shutdown=2)
    return 0

