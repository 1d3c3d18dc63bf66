"""``flashserve bench serve`` and ``bench sweep`` end to end: against a real server process over HTTP, and
against an in-process engine; then ``plan --calibrate`` on the sweep folder."""

import json

import pytest

from flashserve.cli import main
from serverproc import start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_serve_live")

EAGER = ["--kv-memory", "64MiB", "--enforce-eager"]  # an in-process engine, not compiled
SMALL = ["--num-prompts", "4", "--input-len", "24", "--output-len", "6", "--ignore-eos", "--no-progress"]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-num-seqs", "8", *EAGER)
    yield srv
    stop_server(srv)


def _generated(srv) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith("flashserve_generation_tokens_total"))


def test_serve_against_live_server(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    before = _generated(server)
    rc = main(["bench", "serve", "--base-url", server.url, "--tokenizer", "tiny-v41", *SMALL,
               "--max-concurrency", "2", "--metric-percentiles", "50,90", "--goodput", "e2el:60000",
               "--device-cost-per-hour", "0.1", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["backend"] == "openai" and r["max_concurrency"] == 2
    assert r["output_lens"] == [6] * 4 and r["total_output_tokens"] == 24  # ignore_eos: exactly as asked
    assert _generated(server) - before == 24  # the server's own counter agrees with what was streamed
    for key in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "p90_itl_ms", "p50_e2el_ms",
                "output_throughput", "request_throughput", "total_token_throughput", "request_goodput"):
        assert r[key] > 0, key
    assert r["median_ttft_ms"] < r["median_e2el_ms"]
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s SLO every request meets
    assert r["tokens_per_s_per_agent"] == pytest.approx(1000 / r["median_tpot_ms"])
    assert r["cost_per_million_output_tokens"] == pytest.approx(0.1 * 1e6 / 3600 / r["output_throughput"])
    assert all(22 <= n <= 27 for n in r["input_lens"]) and r["total_input_tokens"] == sum(r["input_lens"])
    assert r["temperature"] == 0.0 and r["ignore_eos"] is True and r["dataset_name"] == "random"
    assert "spec_decode_acceptance_length" not in r  # this server exports no speculative counters
    assert "per-agent decode speed" in capsys.readouterr().out


def test_chat_endpoint_with_prefix_dataset(server, tmp_path):
    out = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", server.url, "--served-model-name", "tiny-v41",
                 "--endpoint", "/v1/chat/completions",
                 "--dataset-name", "prefix", "--prefix-len", "32", *SMALL, "--request-rate", "50",
                 "--burstiness", "0.5", "--extra-body", '{"chat_template_kwargs": {"thinking": false}}',
                 "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "openai-chat" and r["completed"] == 4 and r["output_lens"] == [6] * 4
    assert r["request_rate"] == 50 and r["burstiness"] == 0.5 and r["random_prefix_len"] == 32


def test_sweep_against_live_server_then_calibrate(server, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--base-url", server.url, "--tokenizer", "tiny-v41", *SMALL,
                 "--concurrency", "1,2", "--out", str(out), "--label", "ours", "--plan-hardware", "cpu-local",
                 "--plan-model", "tiny-v41", "--device-cost-per-hour", "0.1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ours-c1.json", "ours-c2.json", "sweep.json", "sweep.png"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "sweep.png").stat().st_size > 5000
    point = json.loads((out / "ours-c2.json").read_text())
    assert point["max_concurrency"] == 2 and point["label"] == "ours" and point["completed"] == 4
    entry = json.loads((out / "sweep.json").read_text())["configurations"]["ours"]
    assert [p["concurrency"] for p in entry["measured"]] == [1, 2]
    assert [p["concurrency"] for p in entry["predicted"]] == [1, 2]  # the planner's curve beside it
    capsys.readouterr()
    assert main(["plan", "--calibrate", str(out), "--model", "tiny-v41", "--hardware", "cpu-local", "--gpus", "1",
                 "--weight-dtype", "fp32", "--fit", "pass_overhead_us"]) == 0
    printed = capsys.readouterr().out
    assert "fitted: pass_overhead_us=" in printed and "held out" in printed


def test_bad_targets_are_refused(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", "tiny-v41", *SMALL]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "tiny-v41", "--base-url", "http://x", *SMALL]) == 2
    assert "exactly one of --model" in capsys.readouterr().err
    assert main(["bench", "sweep", "--model", "tiny-v41", "--out", "/tmp/never", *SMALL]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_in_process_engine_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    assert main(["bench", "sweep", "--model", "tiny-v41", *SMALL, *EAGER, "--concurrency", "1,2",
                 "--out", str(sweep)]) == 0
    r = json.loads((sweep / "tiny-v41-c2.json").read_text())
    assert r["backend"] == "flashserve-engine" and r["completed"] == 4 and r["output_lens"] == [6] * 4
    assert 0 < r["median_ttft_ms"] < r["median_e2el_ms"] and r["median_itl_ms"] > 0 and r["max_concurrency"] == 2
    summary = json.loads((sweep / "sweep.json").read_text())["configurations"]["tiny-v41"]
    assert len(summary["measured"]) == 2 and summary["predicted"] is not None  # cpu-local by default
    assert (sweep / "sweep.png").stat().st_size > 5000


def test_requests_the_server_refuses_are_counted_and_shown(server, tmp_path, capsys):
    out = tmp_path / "bad.json"
    assert main(["bench", "serve", "--base-url", server.url, "--served-model-name", "no-such-model",
                 "--tokenizer", "tiny-v41", *SMALL, "--result-file", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 4 and all(e.startswith("HTTP 4") for e in r["errors"])
    assert "first error                    HTTP 4" in capsys.readouterr().out


def test_sweep_where_no_request_completes_exits_1(server, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--base-url", server.url, "--served-model-name", "no-such-model",
                 "--tokenizer", "tiny-v41", *SMALL, "--concurrency", "1,2", "--out", str(out)]) == 1
    entry = json.loads((out / "sweep.json").read_text())["configurations"]
    (only,) = entry.values()
    assert only["failed_levels"] == [1, 2] and only["measured"] == [] and only["input_len"] is None
    assert "no request completed at concurrency 1, 2" in capsys.readouterr().out


def test_serve_in_process_engine_starts_and_closes_it(tmp_path, capsys):
    import threading

    def engine_threads() -> int:
        return sum(t.name == "flashserve-engine" and t.is_alive() for t in threading.enumerate())

    before = engine_threads()
    out = tmp_path / "inproc.json"
    # prompt lookup from one token: any token seen before in the prompt or the answer gives a draft
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    assert main(["bench", "serve", "--model", "tiny-v41", *SMALL, *EAGER, "--max-concurrency", "2",
                 "--speculative-config", spec, "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "flashserve-engine" and r["completed"] == 4 and r["failed"] == 0
    assert r["output_lens"] == [6] * 4 and r["max_concurrency"] == 2 and r["median_tpot_ms"] > 0
    # acceptance read from the engine's own counters, as from a server's /metrics
    assert r["spec_decode_num_drafts"] > 0 and r["spec_decode_draft_tokens"] >= r["spec_decode_num_drafts"]
    assert r["spec_decode_acceptance_length"] == 1 + r["spec_decode_accepted_tokens"] / r["spec_decode_num_drafts"]
    assert engine_threads() == before  # run() stopped the engine loop it started
    assert "per-agent decode speed" in capsys.readouterr().out


def test_in_process_engine_takes_extra_body_sampling_fields(tmp_path, capsys):
    def texts(*flags: str) -> list[str]:
        out = tmp_path / "r.json"
        assert main(["bench", "serve", "--model", "tiny-v41", *SMALL, *EAGER, "--max-concurrency",
                     "1", "--save-detailed", "--result-file", str(out), *flags]) == 0
        r = json.loads(out.read_text())
        assert r["completed"] == 4
        return r["generated_texts"]

    # top_k 1 at temperature 1 through --extra-body (the engine's own field, as a server merges the body) is greedy
    assert texts("--temperature", "1", "--extra-body", '{"top_k": 1}') == texts("--temperature", "0")
    capsys.readouterr()
    assert main(["bench", "serve", "--model", "tiny-v41", *SMALL, "--extra-body", '{"top_q": 1}']) == 2
    err = capsys.readouterr().err
    assert "--extra-body: top_q is not a sampling parameter of the in-process engine" in err
