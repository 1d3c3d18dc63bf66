"""Run lm-eval's ``local-completions`` model with its remote tokenizer (``tokenizer_backend=remote``) on one task,
in a process of its own: ``python lm_eval_run.py BASE_URL MODEL TASK_DIR TASK OUT.json``.

OUT.json holds the task's results and, per document, its target, the (context, continuation) pairs lm-eval
scored, their loglikelihoods and the document's accuracy."""

from __future__ import annotations

import json
import sys


def main(base_url: str, model: str, include_path: str, task: str, out: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    r = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={base_url},tokenizer_backend=remote,model={model},max_length=1024",
        tasks=[task], task_manager=TaskManager(include_path=include_path), log_samples=True)
    samples = [{"doc_id": s["doc_id"], "target": s["target"], "arguments": [list(a) for a in s["arguments"]],
                "loglikelihoods": [resp[0] for resp in s["filtered_resps"]], "acc": s["acc"]}
               for s in r["samples"][task]]
    with open(out, "w") as f:
        json.dump({"results": r["results"][task], "samples": samples}, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
