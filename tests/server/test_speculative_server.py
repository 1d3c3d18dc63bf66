"""``flashserve serve --speculative-config``: a real server process speculates, exports vLLM's spec-decode
counters on /metrics (read back by ``bench serve``'s parser), and refuses a bad configuration by name."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from flashserve.bench.spec_metrics import read_counters

from serverproc import MODEL, REPO, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_speculative_server")


@pytest.fixture(scope="module")
def server():
    srv = start_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    yield srv
    stop_server(srv)


def test_server_speculates_and_exports_acceptance_counters(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = [40, 41, 42, 43, 44, 45] * 5  # repeats: the n-gram drafter finds matches
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 24
    text = httpx.get(server.url + "/metrics", timeout=10).text
    c = read_counters(text)
    assert c["drafts"] > 0 and c["draft_tokens"] >= c["drafts"]
    assert 0 <= c["accepted"] <= c["draft_tokens"]
    assert sum(c.get("per_position", [])) == c["accepted"]
    assert "flashserve_spec_decode_num_draft_tokens_total" in text


def test_bad_speculative_config_is_refused_before_loading():
    r = subprocess.run([sys.executable, "-m", "flashserve", "serve", MODEL, "--speculative-config",
                        '{"method": "medusa", "num_speculative_tokens": 2}'],
                       capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert r.returncode != 0
    assert "speculative_config.method: 'medusa' is not one of ngram, mtp, dspark" in r.stderr
