"""The speculative decoding benchmark (python -m flashserve.bench.spec) on a preset: every method and batch size
reported against no speculation from the same run, batch 1 measured over several prompts."""

import json

import pytest

from flashserve.bench import spec


def test_reports_each_method_and_batch_size_over_several_prompts(tmp_path, monkeypatch):
    seen: list[tuple[int, int]] = []
    run_once = spec.run_once

    def counting(engine, prompts, batch, max_tokens, temperature):
        seen.append((len(prompts), batch))
        return run_once(engine, prompts, batch, max_tokens, temperature)

    monkeypatch.setattr(spec, "run_once", counting)
    out = tmp_path / "spec.json"
    assert spec.main(["--model", "tiny-v41", "--methods", "none,ngram", "--batch-sizes", "1,2", "--num-prompts", "3",
                      "--max-tokens", "4", "--repeats", "1", "--threads", "1", "--enforce-eager",
                      "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    rows = {(r["batch"], r["method"]): r for r in summary["results"]}
    assert set(rows) == {(1, "none"), (1, "ngram"), (2, "none"), (2, "ngram")}
    assert rows[1, "none"]["vs_none"] == 1.0 and rows[2, "none"]["vs_none"] == 1.0
    for b in (1, 2):
        r = rows[b, "ngram"]
        assert r["vs_none"] == pytest.approx(r["tok_s_per_agent"] / rows[b, "none"]["tok_s_per_agent"], rel=1e-2)
        assert 1.0 <= r["mean_acceptance_length"] <= 5.0
    ngram_loses = [b for b in (1, 2) if rows[b, "ngram"]["vs_none"] < 1.0]
    assert summary["first_batch_size_where_speculation_loses"] == {"ngram": min(ngram_loses, default=None)}
    timed = [n for n, b in seen if b == 1][2:]  # after the two warm-ups: three prompts, one at a time
    assert timed == [3, 3]
    assert [n for n, b in seen if b == 2][2:] == [2, 2]  # whole groups of the batch size


def test_sampled_runs_report_one_dspark_row_per_draft_sample_method(tmp_path):
    out = tmp_path / "spec.json"
    assert spec.main(["--model", "tiny-v41", "--methods", "none,dspark", "--batch-sizes", "1", "--num-prompts", "2",
                      "--max-tokens", "4", "--repeats", "1", "--threads", "1", "--enforce-eager", "--temperature",
                      "1.0", "--draft-sample-methods", "probabilistic,greedy", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["temperature"] == 1.0 and summary["draft_sample_methods"] == ["probabilistic", "greedy"]
    assert [r["method"] for r in summary["results"]] == ["none", "dspark[probabilistic]", "dspark[greedy]"]
    assert all(1.0 <= r["mean_acceptance_length"] <= 6.0 for r in summary["results"][1:])


def test_refuses_bad_counts():
    with pytest.raises(SystemExit) as e:
        spec.main(["--num-prompts", "0"])
    assert e.value.code == 2
