"""Flags: derived from EngineConfig's fields for every command, every bad value refused before the model loads
(with its message, fast, without a traceback), and the KV page arithmetic of that check equal to the cache's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

from flashserve.cli import build_parser, main
from flashserve.engine.engine_config import EngineConfig
from flashserve.engine.options import HIDDEN
from flashserve.engine.preflight import parse_size

from serverproc import MODEL, REPO

BAD_FLAGS = [
    (["serve", MODEL, "--kv-memory", "lots"], "invalid size 'lots'"),
    (["serve", MODEL, "--kv-memory", "10"], "less than one max_model_len sequence of 4096 tokens"),
    (["serve", MODEL, "--max-model-len", "999999999"], "max_model_len: 999999999 is outside [2, 4096]"),
    (["serve", MODEL, "--max-num-seqs", "0"], "max_num_seqs: must be an integer >= 1, got 0"),
    (["serve", MODEL, "--shutdown-timeout", "-1"], "--shutdown-timeout: must be >= 0 seconds"),
    (["serve", MODEL, "--port", "70000"], "--port: 70000 is not a port number"),
    (["serve", MODEL, "--tokenizer", "/nonexistent"], "tokenizer: '/nonexistent' is not a folder"),
    (["serve", MODEL, "--compile-cache", str(REPO / "README.md")], "compile_cache: "),
    (["serve", "no-such-model"], "no-such-model"),
    (["serve", MODEL, "--chat-template", "/nonexistent.jinja"], "--chat-template: '/nonexistent.jinja' is neither"),
    (["serve", MODEL, "--chat-template", str(REPO / "tests/server/data/broken.jinja")],
     "is not a valid Jinja template"),
    (["generate", MODEL, "hi", "--max-model-len", "5000"], "max_model_len: 5000 is outside [2, 4096]"),
    (["generate", MODEL, "hi", "--top-p", "0"], "top_p: must be in (0, 1]"),
    (["bench", "serve", "--model", MODEL, "--max-model-len", "999999999"], "max_model_len: 999999999 is outside"),
    (["bench", "sweep", "--model", MODEL, "--kv-memory", "10", "--concurrency", "1", "--out", "/tmp/x"],
     "less than one max_model_len"),
]


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[" ".join(a[2:]) or a[1] for a, _ in BAD_FLAGS])
def test_bad_flag_fails_before_loading_with_its_message(argv, message):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flashserve", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert took < 2.0, f"{took:.2f}s"


@pytest.mark.parametrize("command", [["serve", MODEL], ["generate", MODEL, "hi"], ["bench", "serve", "--model", MODEL],
                                     ["bench", "sweep", "--model", MODEL, "--out", "x"]])
def test_engine_flags_have_the_engine_config_defaults(command):
    args = build_parser().parse_args(command)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in HIDDEN:
            default = parse_size(f.default) if f.name == "kv_memory" else f.default  # parsed as the flag is
            assert getattr(args, f.name) == default, f.name


def test_vllm_flag_names():
    p = build_parser()
    args = p.parse_args(["serve", MODEL, "--no-enable-prefix-caching", "--kv-memory", "2GiB", "--served-model-name",
                         "a", "b", "--tokenizer", "tok"])
    assert args.enable_prefix_caching is False and args.kv_memory == 2 * 2 ** 30
    assert args.served_model_name == ["a", "b"] and args.tokenizer == "tok"
    assert p.parse_args(["generate", MODEL, "x", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-memory" in out and "(default: 1GiB)" in out and "(default: 64)" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"flashserve {version('flashserve')}"


@pytest.mark.parametrize("model,cache_dtype,dtype,block", [("tiny-v41", "packed", "float32", 64),
                                                           ("tiny-v41", "float", "bfloat16", 16),
                                                           ("tiny-v4", "float", "float32", 64),
                                                           ("tiny-v4", "packed", "float32", 32)])
def test_preflight_page_size_is_the_caches(model, cache_dtype, dtype, block):
    """The torch-free check computes the page the cache allocates (tokens and bytes)."""
    import torch

    from flashserve.config import load_config
    from flashserve.engine.cache import KVCache
    from flashserve.engine.preflight import check

    cfg = load_config(model)
    c = EngineConfig(model=model, cache_dtype=cache_dtype, dtype=dtype, block_size=block, kv_memory="1MiB",
                     max_model_len=256)
    pre = check(c)
    cache = KVCache(cfg, dtype=getattr(torch, dtype), device="cpu", packed=cache_dtype == "packed",
                    kv_memory=pre.kv_bytes, max_num_seqs=1, block_size=block)
    assert (pre.page_tokens, pre.page_bytes, pre.num_pages) == (cache.page_tokens, cache.page_bytes,
                                                                 cache.num_pages)
