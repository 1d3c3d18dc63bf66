"""The engine benchmark script runs end to end on the tiny shape and reports consistent rows."""

import json

import pytest

from flashserve.bench import engine as bench


def test_bench_script_reports_medians_and_ratios(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--shape", "tiny", "--quick", "--repeats", "1", "--prefill-len", "96",
                       "--concurrency", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["logits_rel_diff"] < 1e-4  # the two engines run the same checkpoint to float precision
    names = [r["name"] for r in report["rows"]]
    assert names[0] == "decode per agent, batch 1"
    assert "aggregate output, 4 concurrent" in names and "  decode only, 4 concurrent" in names
    assert any(n.startswith("prefill 96 tokens (V4.1)") for n in names)
    for r in report["rows"]:
        assert r["flashserve"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["flashserve"] / r["baseline"])
        assert r["met"] is None if r["bar"] is None else r["met"] == (r["ratio"] >= r["bar"])
    printed = capsys.readouterr().out
    assert "logits max rel diff" in printed and "large-matmul ceiling" in printed


def test_bench_rejects_zero_repeats():
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
