"""Checkpoints without the V4.1 encoder (here the tiny V4 preset) get the plain role-text template; the app
also runs in-process (FastAPI TestClient, lifespan included)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from flashserve.engine import EngineConfig, LLMEngine
from flashserve.server import ServerConfig, create_app
from flashserve.server.chat_encoding import BOS, encode_plain, encode_v41


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-v4", max_num_seqs=4, max_model_len=1024, enforce_eager=True))


def test_v4_uses_plain_template(engine):
    assert not engine.model_config.is_v41
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]
    app = create_app(engine, ServerConfig(model_name="tiny-v4"))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny-v4", "messages": msgs, "max_tokens": 3,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        expect = len(engine.tokenizer.encode(encode_plain(msgs, bos=BOS)))
        assert body["usage"]["prompt_tokens"] == expect
        assert body["usage"]["completion_tokens"] == 3
        msg = body["choices"][0]["message"]
        assert isinstance(msg["content"], str) and msg["reasoning_content"] is None
        tok = c.post("/tokenize", json={"messages": msgs}).json()
        assert tok["count"] == expect


def test_forced_v41_template(engine):
    msgs = [{"role": "user", "content": "hello"}]
    app = create_app(engine, ServerConfig(model_name="tiny-v4", chat_template="v41", default_thinking=False))
    with TestClient(app) as c:
        tok = c.post("/tokenize", json={"messages": msgs}).json()
        assert tok["prompt"] == encode_v41(msgs, thinking=False)


TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if tools %}tools: {{ tools | length }}\n{% endif %}"
            "{% if messages[-1].role == 'tool' %}{{ raise_exception('no tool turns here') }}{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_jinja_chat_template_file(engine, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    app = create_app(engine, ServerConfig(model_name="tiny-v4", chat_template=str(path)))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]
    with TestClient(app) as c:
        tok = c.post("/tokenize", json={"messages": msgs}).json()
        assert tok["prompt"] == f"{BOS}[system] S\n[user] hello\n[assistant]"
        tools = [{"type": "function", "function": {"name": "f"}}]
        assert c.post("/tokenize", json={"messages": msgs, "tools": tools}).json()["prompt"].endswith(
            "tools: 1\n[assistant]")
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tok["count"]
        bad = c.post("/v1/chat/completions", json={"messages": msgs + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "x"}], "max_tokens": 2})
        assert bad.status_code == 400 and "no tool turns here" in bad.json()["error"]["message"]
        assert c.get("/tokenizer_info").json()["chat_template"] == TEMPLATE  # what lm-eval renders chats with
