"""The command line: JSON keys, explain table, sweep files, calibration, and clean errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve.plan.cli import main, register

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--model", "deepseek-v41-flash", "--hardware", "gb300-nvl72", "--gpus", "8", "--concurrency", "16",
        "--context", "8192"]


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_required_keys(capsys) -> None:
    d = _json(capsys, BASE + ["--accept-length", "2.5", "--cost-per-gpu-hour", "3.0", "--json"])
    for key in ("tokens_per_s_per_agent", "output_tokens_per_s_per_gpu", "step_time_ms", "sessions_fit",
                "cost_per_million_output_tokens"):
        assert d[key] > 0, key
    assert d["cost_per_gpu_hour"] == 3.0 and d["draft_tokens"] == 5  # DSpark block
    assert d["cost_per_million_output_tokens"] == pytest.approx(
        3.0 * 8 * 1e6 / (3600 * d["output_tokens_per_s_per_gpu"] * 8))


def test_speculation_raises_per_agent_speed_by_less_than_acceptance_length(capsys) -> None:
    plain = _json(capsys, ["--model", "deepseek-r1", "--hardware", "b200", "--gpus", "8", "--tp", "8", "--json"])
    mtp = _json(capsys, ["--model", "deepseek-r1", "--hardware", "b200", "--gpus", "8", "--tp", "8",
                         "--accept-length", "2.82", "--draft-tokens", "3", "--json"])
    ratio = mtp["tokens_per_s_per_agent"] / plain["tokens_per_s_per_agent"]
    assert 1.5 < ratio < 2.82


def test_explain_prints_every_term(capsys) -> None:
    assert main(BASE + ["--explain"]) == 0
    out = capsys.readouterr().out
    for term in ("layer_overhead_us", "eta_mem", "distinct experts", "KV read", "t_mem", "sessions that fit",
                 "reference-figures"):
        assert term in out, term


def test_json_and_explain_carry_both_layouts(capsys) -> None:
    argv = BASE + ["--prefill-gpus", "16", "--prefill-tp", "2"]
    d = _json(capsys, argv + ["--json"])
    assert (d["gpus"], d["tp"], d["ep"], d["attention_dp"]) == (8, 1, 8, 8)
    assert (d["prefill_gpus"], d["prefill_tp"], d["prefill_ep"], d["prefill_attention_dp"]) == (16, 2, 16, 8)
    assert main(argv + ["--explain"]) == 0
    out = capsys.readouterr().out
    assert "decode GPUs / TP / EP / attention DP" in out and "8 / 1 / 8 / 8" in out
    assert "prefill GPUs / TP / EP / attention DP" in out and "16 / 2 / 16 / 8" in out
    shared = _json(capsys, BASE + ["--json"])  # co-located: prefill runs on the decode layout
    assert (shared["prefill_gpus"], shared["prefill_tp"], shared["prefill_ep"]) == (0, 1, 8)


def test_sweep_writes_json_and_png(tmp_path, capsys) -> None:
    prefix = tmp_path / "curve"
    assert main(["sweep"] + BASE + ["--levels", "1,4,16,64,256", "--out", str(prefix)]) == 0
    data = json.loads((tmp_path / "curve.json").read_text())
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pts = data["points"]
    assert [p["concurrency"] for p in pts] == [1, 4, 16, 64, 256]
    agent = [p["tokens_per_s_per_agent"] for p in pts]
    gpu = [p["output_tokens_per_s_per_gpu"] for p in pts]
    assert agent == sorted(agent, reverse=True) and gpu == sorted(gpu)


def test_calibrate_recovers_terms_and_reports_held_out_error(tmp_path, capsys) -> None:
    truth = ["--model", "deepseek-r1", "--hardware", "h200", "--gpus", "8", "--context", "2048"]
    points = []
    for c in (1, 4, 16, 64, 256, 1024, 4096, 8192):  # the last two exceed HBM: synthetic points, allowed
        d = _json(capsys, truth + ["--concurrency", str(c), "--layer-overhead-us", "450", "--eta-mem", "0.4",
                                   "--eta-flop", "0.3", "--allow-misfit", "--json"])
        points.append({k: d[k] for k in ("concurrency", "tokens_per_s_per_agent", "output_tokens_per_s_per_gpu")})
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(points))
    d = _json(capsys, truth + ["--calibrate", str(bench), "--json"])
    assert d["fitted"]["layer_overhead_us"] == pytest.approx(450, rel=0.05)
    assert d["fitted"]["eta_flop"] == pytest.approx(0.3, rel=0.05)
    assert d["held_out_mean_abs_error"] < 0.02
    assert sum(p["held_out"] for p in d["points"]) == 4
    assert d["warnings"] == []  # four points pin three terms, none at a bound


def test_calibrate_compares_decode_only_points_with_the_decode_step(tmp_path, capsys) -> None:
    """Speeds measured while decoding alone (a 4,096-token prompt and 16 new tokens: a large prefill share)
    pin eta_mem when marked decode_only; read as whole cycles they would not."""
    truth = ["--model", "deepseek-r1", "--hardware", "h200", "--gpus", "8", "--prompt-len", "4096",
             "--output-len", "16", "--layer-overhead-us", "100", "--eta-flop", "0.5"]
    points = []
    for c in (1, 2):
        d = _json(capsys, truth + ["--concurrency", str(c), "--eta-mem", "0.4", "--json"])
        decode = 1e3 / d["step_time_ms"]  # no drafter: one token a step
        assert decode > 1.2 * d["tokens_per_s_per_agent"]  # the prefill share matters here
        points.append({"concurrency": c, "tokens_per_s_per_agent": decode, "decode_only": True})
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(points))
    d = _json(capsys, truth + ["--calibrate", str(bench), "--fit", "eta_mem", "--json"])
    assert d["fitted"]["eta_mem"] == pytest.approx(0.4, rel=0.02)
    assert d["held_out_mean_abs_error"] < 0.01
    bench.write_text(json.dumps([{k: v for k, v in p.items() if k != "decode_only"} for p in points]))
    d = _json(capsys, truth + ["--calibrate", str(bench), "--fit", "eta_mem", "--json"])
    assert d["fitted"]["eta_mem"] > 0.5
    bench.write_text(json.dumps([{**points[0], "decode_only": "yes"}]))
    assert main(truth + ["--calibrate", str(bench)]) == 2
    assert "points[0].decode_only" in capsys.readouterr().err


def test_calibrate_warns_when_the_points_do_not_pin_the_terms(tmp_path, capsys) -> None:
    base = ["--model", "deepseek-r1", "--hardware", "h200", "--gpus", "8", "--context", "2048"]
    # one fitted point (the second is held out), and a speed no efficiency reaches: every term runs to a bound
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"concurrency": 1, "tokens_per_s_per_agent": 1e6},
                                 {"concurrency": 4, "tokens_per_s_per_agent": 1e6}]))
    assert main(base + ["--calibrate", str(bench)]) == 0
    out = capsys.readouterr().out
    warned = out[out.index("warning: "):].splitlines()
    assert warned[0].startswith("warning: 3 terms fitted on 1 point") and max(map(len, warned)) <= 80
    assert sum("ended at the end of its search range" in line for line in warned) >= 2


@pytest.mark.parametrize("argv,field", [
    (["--hardware", "tpu-v9"], "--hardware"),
    (["--gpus", "-4"], "--gpus"),
    (["--gpus", "8", "--tp", "3"], "--tp"),
    (["--gpus", "8", "--ep", "5"], "--ep"),
    (["--gpus", "8", "--tp", "2", "--attention-dp", "2"], "--attention-dp"),
    (["--prefill-tp", "2"], "--prefill-tp"),
    (["--prefill-ep", "8"], "--prefill-ep"),
    (["--prefill-gpus", "32", "--prefill-tp", "3"], "--prefill-tp"),
    (["--prefill-gpus", "32", "--prefill-ep", "12"], "--prefill-ep"),
    (["--prefill-gpus", "32", "--prefill-ep", "0"], "--prefill-ep"),
    (["--prefill-gpus", "32", "--prefill-tp", "2", "--prefill-attention-dp", "8"], "--prefill-attention-dp"),
    (["--hardware", "h100", "--prefill-gpus", "32", "--prefill-tp", "16"], "--prefill-tp"),
    (["--concurrency", "0"], "--concurrency"),
    (["--kv-dtype", "int3"], "--kv-dtype"),
    (["--weight-dtype", "fp2"], "--weight-dtype"),
    (["--prefix-hit-rate", "1.5"], "--prefix-hit-rate"),
    (["--accept-length", "4", "--draft-tokens", "2"], "--accept-length"),
    (["--cost-per-gpu-hour", "-1"], "--cost-per-gpu-hour"),
    (["--model", "no-such-model"], "--model"),
    (["--calibrate", "/nonexistent/bench.json"], "--calibrate"),
])
def test_bad_input_exits_2_naming_the_field(argv, field, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_subprocess_error_has_no_traceback_and_planner_does_not_import_torch() -> None:
    bad = subprocess.run([sys.executable, "-m", "flashserve.plan", "--gpus", "8", "--tp", "3"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--tp" in bad.stderr and "Traceback" not in bad.stderr
    code = ("import sys; from flashserve.plan.cli import main; main(['--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    ok = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_register_adds_plan_to_a_parent_parser(capsys) -> None:
    parser = argparse.ArgumentParser(prog="flashserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--gpus", "8", "--json"])
    assert args.command == "plan" and args.func(args) == 0
    assert "tokens_per_s_per_agent" in json.loads(capsys.readouterr().out)
