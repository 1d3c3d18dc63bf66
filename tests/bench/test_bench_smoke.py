"""The engine benchmark script runs end to end on the tiny shape and reports consistent rows."""

import json
import sys

import pytest

from flashserve.bench import engine as bench
from flashserve.bench import llamacpp


def test_bench_script_reports_medians_and_ratios(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--shape", "tiny", "--quick", "--repeats", "1", "--prefill-len", "96",
                       "--concurrency", "4", "--contexts", "64", "256", "--llama-batches", "1",
                       "--llama-rows", "f32", "w8a8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["logits_rel_diff"] < 1e-4  # the two engines run the same checkpoint to float precision
    names = [r["name"] for r in report["rows"]]
    assert names[0] == "decode per agent, batch 1"
    assert "aggregate output, 4 concurrent" in names and "  decode only, 4 concurrent" in names
    assert any(n.startswith("prefill 96 tokens (V4.1)") for n in names)
    for r in report["rows"]:
        assert r["flashserve"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["flashserve"] / r["baseline"])
        assert r["met"] is None if r["goal"] is None else r["met"] == (r["ratio"] >= r["goal"])
    printed = capsys.readouterr().out
    assert "logits max rel diff" in printed and "large-matmul ceiling" in printed
    assert "goal 5x transformers: " in printed and "bar " not in printed  # goals in words, no internal names
    assert "decode step at 256 vs 64 context" in printed and "decode step at 256 context" in printed
    assert "llama.cpp peer skipped: " in printed or ("w8a8 vs Q8_0" in printed and "MXFP4" not in printed)


def test_bench_rejects_zero_repeats():
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])


def test_llama_cpp_peer_says_why_it_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when it is not installed
    assert llamacpp.unavailable().startswith("llama-cpp-python is not installed")


def test_peer_vocabulary_is_gpt2_byte_level():
    """The GGUF's first 256 tokens are byte-level BPE's byte characters (llama.cpp looks bytes up by them)."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = [llamacpp._byte_char(b) for b in range(256)]
    assert sorted(chars) == sorted(ByteLevel.alphabet())
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "\u0120" and chars[10] == "\u010a"


def test_missing_transformers_is_said_plainly(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as when the extra is not installed
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "transformers, which is not installed" in err and "pip install 'flashserve[bench]'" in err
