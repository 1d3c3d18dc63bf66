"""lm-eval against a real server: ``local-completions`` with ``tokenizer_backend=remote`` reads ``GET
/tokenizer_info``, tokenizes through ``/tokenize`` and scores a multiple-choice task by loglikelihood through
``/v1/completions`` (echo + logprobs), with no tokenizer files of its own. Its loglikelihoods must be the
model's: the offline engine scores the same token ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve import LLM, SamplingParams

from serverproc import MODEL, REPO, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_lm_eval")

DOCS = [
    {"question": "The quick brown", "choices": ["fox", "table", "seven"], "label": 0},
    {"question": "Hello,", "choices": ["world!", "purple", "the"], "label": 0},
    {"question": "def main(): return", "choices": ["0", "dog", "upon"], "label": 0},
]

TASK = """task: flashserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def lm_eval_run(tmp_path_factory):
    """lm-eval's run over the task, and the server's access log of it."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    data = tmp / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp / "task.yaml").write_text(TASK.format(data=data))
    out = tmp / "out.json"
    srv = start_server("--log-level", "info", "--access-log")
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
               "OPENAI_API_KEY": ""}
        p = subprocess.run([sys.executable, str(REPO / "tests/server/lm_eval_run.py"), srv.url + "/v1/completions",
                            MODEL, str(tmp), "flashserve_tiny_mc", str(out)],
                           capture_output=True, text=True, cwd=tmp, env=env, timeout=300)
        log = Path(srv.log_path).read_text()
        alive = srv.proc.poll() is None
    finally:
        stop_server(srv)
    assert p.returncode == 0, p.stderr[-4000:]
    assert alive and "Traceback" not in log, log[-4000:]
    return json.loads(out.read_text()), log


def test_lm_eval_uses_the_remote_tokenizer(lm_eval_run):
    _, log = lm_eval_run
    requests = [r for r in re.findall(r'"(GET|POST) (\S+) HTTP/1\.1" (\d+)', log)  # uvicorn's access log
                if r[1] != "/health"]  # start_server's probes
    assert requests[0] == ("GET", "/tokenizer_info", "200")  # asked first, before any tokenizing
    assert {path for _, path, _ in requests} == {"/tokenizer_info", "/tokenize", "/v1/completions"}
    assert all(status == "200" for _, _, status in requests), requests


def test_lm_eval_scores_every_doc(lm_eval_run):
    result, _ = lm_eval_run
    samples = result["samples"]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    for s in samples:
        doc = DOCS[s["doc_id"]]
        assert s["arguments"] == [[doc["question"], " " + c] for c in doc["choices"]]  # the task as written
        lls = s["loglikelihoods"]
        assert len(lls) == len(doc["choices"]) and all(ll < 0 for ll in lls)
        assert s["acc"] in (0.0, 1.0)
        assert s["acc"] == float(max(range(len(lls)), key=lls.__getitem__) == s["target"])
    assert 0.0 <= result["results"]["acc,none"] <= 1.0
    assert result["results"]["acc,none"] == pytest.approx(sum(s["acc"] for s in samples) / len(samples))


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=1024, enforce_eager=True)


def test_lm_eval_loglikelihoods_are_the_models(lm_eval_run, llm, tokenizer):
    """Each (context, continuation) lm-eval scored, tokenized as lm-eval sends it (the context's ids, then the
    rest of the whole text's ids), scored by the offline engine: the same loglikelihood."""
    result, _ = lm_eval_run
    for s in result["samples"]:
        for (context, continuation), ll in zip(s["arguments"], s["loglikelihoods"]):
            ctx = tokenizer.encode(context)
            ids = ctx + tokenizer.encode(context + continuation)[len(ctx):]
            out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
            expect = sum(out.prompt_logprobs[i][ids[i]] for i in range(len(ctx), len(ids)))
            assert ll == pytest.approx(expect, abs=1e-3), (context, continuation)
