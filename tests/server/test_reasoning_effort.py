"""``--reasoning-effort-table pre-release``: a real server renders the pre-release V4.1 encoder's budgets (low
25, high 50, xhigh 75, max 100; default high) for every documented ``reasoning_effort`` and for none, in chat
requests (the official client) and in /tokenize. The released table, the default, is pinned in test_api.py."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from serverproc import MODEL, REPO, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_reasoning_effort")

PRE_RELEASE = [(None, 50), ("minimal", 25), ("low", 25), ("medium", 50), ("high", 50), ("xhigh", 75), ("max", 100)]
MSGS = [{"role": "user", "content": "Say hello to the fox."}]
LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


@pytest.fixture(scope="module")
def server():
    srv = start_server("--reasoning-effort-table", "pre-release")
    yield srv
    stop_server(srv)


@pytest.mark.parametrize("name,budget", PRE_RELEASE)
def test_pre_release_budgets(server, name, budget):
    effort = {"reasoning_effort": name} if name else {}
    prompt = httpx.post(server.url + "/tokenize",
                        json={"model": MODEL, "messages": MSGS, **effort}).json()["prompt"]
    assert prompt == ("<｜begin▁of▁sentence｜><｜System｜>" + LINE.format(budget) + "<｜User｜>Say hello to the fox."
                      "<｜Assistant｜><think>")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, extra_body=effort)
    assert r.usage.prompt_tokens == httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]


def test_none_still_turns_thinking_off(server):
    prompt = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MSGS,
                                                          "reasoning_effort": "none"}).json()["prompt"]
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Say hello to the fox.<｜Assistant｜></think>"


def test_an_unknown_table_is_refused_before_loading():
    p = subprocess.run([sys.executable, "-m", "flashserve", "serve", MODEL, "--reasoning-effort-table", "final"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 2 and "--reasoning-effort-table" in p.stderr and "pre-release" in p.stderr, p.stderr
