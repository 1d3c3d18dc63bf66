"""The recipe's settings (torch-free, so ``flashserve --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPORT = "report.json"
SAMPLE = "heldout_sample.json"
STAGES = ("tokenizer", "backbone", "drafter", "distill", "export")


@dataclass
class Recipe:
    out: Path = Path("flashserve/models/default")  # the exported model folder
    work: Path = Path("runs/default")  # intermediate files (encoded data, float weights, logs)
    family: str = "v41"  # "v41": V4.1 with DSpark stages (the default model); "v4": V4 with its MTP block
    seed: int = 0
    threads: int = 1
    vocab_size: int = 4096
    hidden: int = 128
    window: int = 64
    heldout_fraction: float = 0.03
    file_limit: int | None = None  # keep only the first files (the fast mode)
    seq_len: int = 256
    batch: int = 8
    steps: int = 400
    lr: float = 2e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    qat_from: float = 0.85 # fraction of the steps after which the experts train through their FP4 rounding
    drafter_steps: int = 1800
    drafter_batch: int = 4
    drafter_anchors: int = 32
    drafter_lr: float = 2e-3
    # self-distillation (stage "distill"): prompts from the train split continued greedily by the served backbone
    distill_prompts: int = 768
    distill_line_fraction: float = 0.5  # prompts ending where a line ends (half of those after a def line)
    distill_prompt_len: int = 128
    distill_gen_len: int = 128
    distill_steps: int = 1200
    distill_lr: float = 1e-3
    distill_own_fraction: float = 0.75  # rows of each step's batch taken from the backbone's own text
    eval_tokens: int = 32768  # held-out tokens of the reference-forward evaluation
    sample_chunks: int = 4  # held-out sample stored with the model (the engine-perplexity test)
    sample_len: int = 192
    acceptance_anchors: int = 64
    log_every: int = 10

    @classmethod
    def fast(cls, work: Path, out: Path, **kw) -> "Recipe":
        """A few steps on a few files at a tiny width: the recipe's own test, in seconds."""
        base = dict(work=work, out=out, vocab_size=400, hidden=64, window=16, file_limit=6, seq_len=64, batch=2,
                    steps=4, warmup=2, drafter_steps=2, drafter_batch=2, distill_prompts=4, distill_prompt_len=32,
                    distill_gen_len=32, distill_steps=2, drafter_anchors=4, eval_tokens=256,
                    sample_chunks=1, sample_len=48, acceptance_anchors=4, log_every=1)
        base.update(kw)
        return cls(**base)
