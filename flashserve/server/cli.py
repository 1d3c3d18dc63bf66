"""``flashserve serve MODEL``: the OpenAI- and Anthropic-compatible server.

Start-up order is what makes a bad start cheap: every flag is checked and the port bound before the model
loads, so a typo or a busy port fails in about a second. ``register(subparsers)`` adds the command to the
``flashserve`` CLI (``flashserve/cli.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket

from ..cli_help import HelpFormatter
from ..engine.options import add_engine_args, engine_config
from ..errors import UserError
from .chat_encoding import DEFAULT_EFFORT_TABLE, EFFORT_TABLES
from .jinja_template import BUILTIN, JinjaTemplate
from .protocol import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("flashserve.server")

API_KEY_ENV = "FLASHSERVE_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="preset name (e.g. tiny-v41), checkpoint folder or DeepSeek-V4 GGUF file (default: the embedded "
                        "model, served as 'flashserve-default')")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    g.add_argument("--api-key", default=None,
                   help=f"require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on /v1/* and "
                        f"/tokenize; default: ${API_KEY_ENV}")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use in 'model', replacing MODEL; the first is reported")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--default-thinking", choices=("on", "off"), default="on",
                   help="V4.1 chat mode when a request says nothing (requests choose with thinking, "
                        "chat_template_kwargs or reasoning_effort)")
    g.add_argument("--reasoning-effort-table", choices=tuple(EFFORT_TABLES), default=DEFAULT_EFFORT_TABLE,
                   help="V4.1 budgets of the reasoning_effort names: released (low 50, high 75, max 100; default "
                        "high), or pre-release (low 25, high 50, xhigh 75, max 100) for checkpoints whose "
                        "encoding/encoding.py predates the release")
    g.add_argument("--chat-template", default="auto", metavar="auto|v41|plain|FILE",
                   help="prompt encoder: auto (V4.1 DSML for V4.1 checkpoints, plain role text otherwise), v41, "
                        "plain, or a Jinja chat template file")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are "
                        "ended with finish_reason 'abort'")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput/queue/cache log lines while busy (0: never)")
    g.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs (off: images must come as base64 data URLs or blocks)")
    g.add_argument("--limit-mm-per-prompt", default='{"image": 8}', metavar="JSON",
                   help="most images one request may carry, as vLLM spells it")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="log verbosity")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(p)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI/Anthropic-compatible HTTP server",
                              description="Serve MODEL over OpenAI- and Anthropic-compatible HTTP APIs.",
                              formatter_class=HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def check_server_args(args: argparse.Namespace) -> None:
    """The server's own flags (the engine's are checked by ``preflight``)."""
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: {args.port} is not a port number (0-65535)")
    if not args.shutdown_timeout >= 0:
        raise UserError(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.log_stats_interval >= 0:
        raise UserError(f"--log-stats-interval: must be >= 0 seconds, got {args.log_stats_interval}")
    if args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes: must be >= 1, got {args.max_request_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key: the key is empty")
    if args.chat_template not in BUILTIN:
        JinjaTemplate.load(args.chat_template)  # readable and compiles
    images_per_prompt(args.limit_mm_per_prompt)


def images_per_prompt(value: str) -> int:
    """``--limit-mm-per-prompt '{"image": N}'`` → N."""
    import json

    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(f"--limit-mm-per-prompt: not JSON ({e.msg}); write e.g. '{{\"image\": 4}}'") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise UserError(f"--limit-mm-per-prompt: expected an object with an 'image' count, got {value}")
    n = limits.get("image", 8)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise UserError(f"--limit-mm-per-prompt: the image count must be an integer >= 0, got {n!r}")
    return n


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` now, so a busy port is reported before the model loads (binding alone
    would not reserve it: SO_REUSEADDR lets a second process bind a port nobody listens on yet). Clients that
    connect during loading wait in the backlog."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host: cannot resolve {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    from ..engine import preflight

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model is None:  # the embedded default, under a short name
        from ..models import DEFAULT_SERVED_NAME, default_model

        args.model = default_model()
        args.served_model_name = args.served_model_name or [DEFAULT_SERVED_NAME]
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_server_args(args)
    if not args.api_key and not _is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who can reach this address can use the "
                    "server (set --api-key or $%s)", args.host, API_KEY_ENV)
    preflight.check(engine_config(args))  # every engine flag, before loading
    worker = _torchrun_worker(args)
    if worker is not None:  # a torchrun process of rank > 0: a worker of rank 0's engine, no HTTP
        return worker
    sock = bind_socket(args.host, args.port)
    try:
        code = serve(build_engine(args), args, sock)
    finally:
        sock.close()
    from .lifecycle import exit_now

    exit_now(code)
    return code


def build_engine(args: argparse.Namespace):
    """The engine the parsed flags describe (torch is imported here, once every flag is known to be good)."""
    from ..interrupts import deferred_interrupt

    with deferred_interrupt():  # the executor module imports torch: the import itself must not be interrupted
        from ..entrypoints.engines import create_engine

    engine = create_engine(engine_config(args))  # LLMEngine, or rank 0 of a sharded engine
    engine.exit_on_failure = True  # a dead worker: /health turns 503, then the server exits with status 1
    return engine


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun, ranks other than 0 run the worker loop (exit status returned); None on rank 0."""
    from ..config.ranks import layout_of

    config = engine_config(args)
    if not layout_of(config).sharded or os.environ.get("RANK", "0") == "0":
        return None
    from ..parallel.executor import run_torchrun_worker

    return run_torchrun_worker(config)


def serve(engine, args: argparse.Namespace, sock: socket.socket) -> int:
    from ..config import PRESET_JSON
    from .app import ServerConfig, create_app
    from .lifecycle import serve_app

    names = tuple(args.served_model_name or (args.model,))
    root = args.model if args.model in PRESET_JSON else os.path.abspath(args.model)  # as load_config reads it
    cfg = ServerConfig(model_name=names[0], served_names=names[1:], model_root=root, api_key=args.api_key,
                       max_request_bytes=args.max_request_bytes, default_thinking=args.default_thinking == "on",
                       chat_template=args.chat_template, reasoning_effort_table=args.reasoning_effort_table,
                       max_model_len=engine.max_model_len,
                       log_stats_interval=args.log_stats_interval, allow_remote_images=args.allow_remote_images)
    engine.image_limits = dataclasses.replace(engine.image_limits,
                                              max_images=images_per_prompt(args.limit_mm_per_prompt))
    app = create_app(engine, cfg)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (max_model_len %d)", ", ".join(cfg.names()), host, port,
             engine.max_model_len)
    serve_app(app, sock, log_level=args.log_level, access_log=args.access_log,
              shutdown_timeout=args.shutdown_timeout)
    if engine.failure is not None and engine.exit_on_failure:
        log.error("exiting: %s", engine.failure)
        return 1
    engine.shutdown()
    return 0
