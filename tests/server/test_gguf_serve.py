"""A DeepSeek-V4 GGUF served as a checkpoint folder is: ``LLMEngine(EngineConfig(model="x.gguf"))``,
``flashserve generate x.gguf`` and ``flashserve serve x.gguf`` with the official OpenAI client."""

from __future__ import annotations

import openai
import pytest

from flashserve.engine.tokenizer import load_tokenizer
from flashserve.model.loader import load_model

from engine_helpers import reference_greedy, run_greedy
from gguf_writer import write_tiny_gguf
from serverproc import start_server, stop_server

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, folder, path = write_tiny_gguf(tmp_path_factory.mktemp("gguf_serve"))
    return folder, path


def test_engine_and_generate_run_a_gguf(tiny, capsys):
    from flashserve.cli import main
    from flashserve.engine import EngineConfig, LLMEngine

    folder, path = tiny
    engine = LLMEngine(EngineConfig(model=str(path), enforce_eager=True, background_compile=False,
                                    kv_memory="64MiB"))
    got = run_greedy(engine, [PROMPT], 6)[0]
    ids = load_tokenizer(folder, 512).encode(PROMPT)
    assert got == reference_greedy(load_model(folder, with_mtp=False), ids, 6)
    assert main(["generate", str(path), PROMPT, "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
                 "--enforce-eager", "--kv-memory", "64MiB"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == engine.tokenizer.decode(got)


def test_serve_a_gguf_through_the_openai_api(tiny):
    folder, path = tiny
    srv = start_server("--max-model-len", "512", "--kv-memory", "64MiB", model=str(path))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [str(path)]
        reply = client.completions.create(model=str(path), prompt=PROMPT, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(load_tokenizer(folder, 512).encode(PROMPT))
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens <= 4 and chat.usage.prompt_tokens > 2
        client.close()
    finally:
        stop_server(srv)
