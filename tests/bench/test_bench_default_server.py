"""``bench`` as a user meets it: against ``flashserve serve`` started with no model (the embedded default, served
as ``flashserve-default``), with no ``--tokenizer``: the served model's tokenizer counts the prompts."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flashserve.bench.chart import figure
from flashserve.cli import main
from flashserve.models import DEFAULT_SERVED_NAME, default_model
from serverproc import start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_bench_default_server")

SMALL = ["--num-prompts", "3", "--input-len", "20", "--output-len", "4", "--ignore-eos", "--no-progress"]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-num-seqs", "4", "--kv-memory", "64MiB", model=None)
    yield srv
    stop_server(srv)


def _prompt_tokens(srv) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith("flashserve_prompt_tokens_total"))


def test_serve_without_tokenizer_counts_prompts_as_the_server_does(server, tmp_path):
    out = tmp_path / "r.json"
    before = _prompt_tokens(server)
    assert main(["bench", "serve", "--base-url", server.url, *SMALL, "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["model_id"] == DEFAULT_SERVED_NAME
    assert r["tokenizer_id"] == default_model()  # the card's root, the folder this machine reads
    # the prompts were measured with the server's own tokenizer: its counter agrees token for token
    assert _prompt_tokens(server) - before == r["total_input_tokens"] > 0


def test_sweep_without_tokenizer_says_why_no_planner_curve(server, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--base-url", server.url, *SMALL, "--concurrency", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "sweep.json").read_text())
    entry = summary["configurations"][DEFAULT_SERVED_NAME]  # labelled by the served name, not the URL
    assert [p["concurrency"] for p in entry["measured"]] == [1, 2] and entry["predicted"] is None
    assert "--plan-hardware" in entry["predicted_note"] and entry["predicted_note"] in printed
    fig = figure(summary)
    shown = " ".join(t.get_text() for t in fig.texts)
    assert entry["predicted_note"] in shown.replace("\n", " ")  # the chart says it too


def test_served_name_of_the_embedded_model_is_a_tokenizer(server, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--base-url", server.url, "--tokenizer", DEFAULT_SERVED_NAME, *SMALL,
                 "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["completed"] == 3


def test_sweep_plans_the_served_model_when_asked(server, tmp_path):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--base-url", server.url, *SMALL, "--concurrency", "1", "--out", str(out),
                 "--plan-hardware", "cpu-local"]) == 0
    entry = json.loads((out / "sweep.json").read_text())["configurations"][DEFAULT_SERVED_NAME]
    assert [p["concurrency"] for p in entry["predicted"]] == [1]
    assert "cpu-local" in entry["predicted_note"]


def test_a_plain_install_brings_the_http_client():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "httpx" for dep in project["dependencies"])


class _OtherServer(BaseHTTPRequestHandler):
    """A server that is not flashserve: its model card names no tokenizer this machine has."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"object": "list", "data": [{"id": "org/some-model", "object": "model",
                                                       "owned_by": "vllm", "root": "org/some-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_another_servers_model_needs_tokenizer(tmp_path, capsys):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OtherServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert main(["bench", "serve", "--base-url", url, *SMALL]) == 2
        err = capsys.readouterr().err
        assert "'org/some-model', not a flashserve model" in err and "pass --tokenizer" in err
    finally:
        httpd.shutdown()
        httpd.server_close()
