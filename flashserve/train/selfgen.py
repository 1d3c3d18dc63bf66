"""The backbone's own greedy text: what a served drafter actually drafts after.

Once a request has a few tokens of output, the drafter's context is the backbone's own greedy continuation, not
human text, and a weak backbone's continuations (repetitive, loop-prone) are where a drafter trained only on the
corpus accepts least: the 1,800-step drafter shipped before accepted 2.42 drafts per block on held-out text but
1.35 on the speculative benchmark's prompts. :func:`greedy_continuations` generates that text through the
engine (as served: packed weights, QAT points) after prompts made by :func:`line_prompts` and
:func:`prompt_windows`, and the recipe's ``distill`` stage fine-tunes the drafter on a mix of it and the corpus
(self-distillation, as EAGLE and Medusa train their heads on the target's own outputs).
"""

from __future__ import annotations

from pathlib import Path

import torch


def prompt_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from random places of ``stream`` (cut anywhere, even inside a word)."""
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return [stream[s:s + length].tolist() for s in starts.tolist()]


def line_prompts(texts: list[str], tokenizer, n: int, length: int, gen: torch.Generator,
                 def_fraction: float = 0.5) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens that end where a line of code ends, as a user's prompt does:
    ``def_fraction`` of them just after a ``def`` line (a function body follows, what the speculative
    benchmark's prompts ask for), the others after any non-blank line. Lines within a file's first
    ``4 * length`` characters are skipped; a prompt that still has fewer tokens is led by PAD."""
    ends: tuple[list, list] = ([], [])  # (file, end offset) after any line, after def lines
    for f, text in enumerate(texts):
        pos = 0
        for line in text.splitlines(keepends=True):
            pos += len(line)
            if pos > 4 * length and line.strip():
                ends[0].append((f, pos))
                if line.lstrip().startswith("def "):
                    ends[1].append((f, pos))
    if not ends[0]:
        raise ValueError(f"no line of code ends past character {4 * length} of any file: no prompts to make")
    n_def = round(n * def_fraction) if ends[1] else 0
    out = []
    for kind, count in ((1, n_def), (0, n - n_def)):
        picks = torch.randint(0, len(ends[kind]), (count,), generator=gen).tolist()
        for i in picks:
            f, end = ends[kind][i]
            ids = tokenizer.encode(texts[f][max(0, end - 12 * length):end], add_special_tokens=False).ids
            out.append(ids[-length:] if len(ids) >= length else [2] * (length - len(ids)) + ids)  # PAD-led if short
    return out


def greedy_continuations(model_dir: str | Path, prompts: list[list[int]], max_tokens: int,
                         **engine_options) -> list[list[int]]:
    """Each prompt followed by the served model's greedy continuation of exactly ``max_tokens`` tokens (EOS
    ignored, so every row has the same length)."""
    from ..entrypoints.llm import LLM
    from ..engine.sampling_params import SamplingParams

    # eager unless asked: the training text must not depend on when a background compile finished (compiled and
    # eager greedy tokens agree on the tests' models, but a near tie may break either way)
    engine_options.setdefault("enforce_eager", True)
    llm = LLM(str(model_dir), **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chunk = llm.engine.config.max_num_seqs  # one full batch at a time, never past the waiting queue's bound
    rows = []
    for i in range(0, len(prompts), chunk):
        part = prompts[i:i + chunk]
        outs = llm.generate([{"prompt_token_ids": p} for p in part], params)
        rows += [p + list(o.outputs[0].token_ids) for p, o in zip(part, outs)]
    del llm
    return rows

