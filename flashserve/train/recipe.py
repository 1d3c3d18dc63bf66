"""The training recipe of the embedded default model (``flashserve train``).

Stages, each resumable from the work folder's files:

1. ``tokenizer``: a byte-level BPE (``tokenizers``) trained on the interpreter's ``Lib/`` sources (the train
   split), the V4.1 special and chat tokens at the ids the config names; both splits encoded once.
2. ``backbone``: a V4.1 model with every layer role (see :mod:`flashserve.train.config`), AdamW with warmup
   and cosine decay on random windows of the train stream, QAT quantisation points on (straight-through),
   the routed experts' FP4 rounding on for the last part (``qat_from``), auxiliary-loss-free router balancing.
3. ``drafter``: the DSpark stages with the backbone frozen (:mod:`flashserve.train.drafter`).
4. ``distill``: the drafter fine-tuned on a mix of the corpus and the served backbone's own greedy
   continuations (:mod:`flashserve.train.selfgen`), where serving drafts.
5. ``export``: the released safetensors layout (FP8 dense, MXFP4 experts) with tokenizer and config; the model
   is loaded back as the engine loads it and its held-out perplexity measured, through the reference forward
   on the held-out split and through the engine (prompt logprobs) on a stored held-out sample; ``report.json``.

Deterministic for a seed and a thread count: batches come from per-step seeded generators and every count is
fixed (steps, not time).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .settings import REPORT, SAMPLE, STAGES, Recipe  # noqa: F401 (re-exported)


# ============================================================================ helpers


def _log(r: Recipe, record: dict) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
    with open(r.work / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _progress(description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                    TimeElapsedColumn(), TimeRemainingColumn())


def _gen(seed: int, *salt: int) -> torch.Generator:
    s = seed
    for x in salt:
        s = (s * 1_000_003 + x) % (2 ** 62)
    return torch.Generator().manual_seed(s)


def _lr(r: Recipe, step: int, base: float, steps: int) -> float:
    warm = min(r.warmup, max(steps // 5, 1))
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(steps - warm, 1)
    return base * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _tokenizer(r: Recipe):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(r.work / "tokenizer" / "tokenizer.json"))


def _split_texts(r: Recipe) -> tuple[list[str], list[str]]:
    """The texts of the train and held-out files."""
    from .data import split_files, stdlib_files

    train, held = split_files(stdlib_files(limit=r.file_limit), r.heldout_fraction)
    return [t for _, t in train], [t for _, t in held]


def _save_served(r: Recipe, model, folder: Path) -> None:
    """``model`` in the released layout with the tokenizer files: a folder the engine loads."""
    from ..model.checkpoint import save_checkpoint
    from .tokenizer import write_tokenizer_files

    save_checkpoint(model.checkpoint_tensors(), folder, model.cfg)
    write_tokenizer_files(_tokenizer(r), folder)


def _model_config(r: Recipe):
    from ..config.model_config import config_from_dict
    from ..model.engram import compressed_token_map
    from .config import default_config_json

    tok = _tokenizer(r)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if r.family == "v4":
        from .config import v4_config_json

        return config_from_dict(v4_config_json(vocab, hidden=r.hidden, window=r.window))
    if r.family != "v41":
        raise ValueError(f"family must be 'v41' or 'v4', got {r.family!r}")
    classes = compressed_token_map(tok)[1]
    return config_from_dict(default_config_json(vocab, classes, hidden=r.hidden, window=r.window))


def _build(r: Recipe):
    """The float training model (backbone + DSpark stages, no vision), seeded, engram map set."""
    from ..model.engram import compressed_token_map
    from ..model.init import random_init
    from ..model.transformer import Transformer

    cfg = _model_config(r)
    model = Transformer(cfg, with_mtp=True, with_vision=False)
    random_init(model, r.seed)
    with torch.no_grad():  # a trainable start: unit norms, balanced routers
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.fill_(1.0)
            if name.endswith(("gate.bias", "gate.bias_vl")):
                p.zero_()
                p.requires_grad_(False)
    if model.engram_hasher is not None:
        model.engram_hasher.set_token_map(*compressed_token_map(_tokenizer(r)))
    model.fake_quant = cfg.is_v41  # as load_model serves it: V4.1 with its QAT points
    return model


def _windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


# ============================================================================ stage 1: tokenizer


def stage_tokenizer(r: Recipe) -> dict:
    from .data import split_files, stdlib_files
    from .tokenizer import train_tokenizer, write_tokenizer_files

    t0 = time.time()
    files = stdlib_files(limit=r.file_limit)
    train, held = split_files(files, r.heldout_fraction)
    tok = train_tokenizer([t for _, t in train], r.vocab_size)
    write_tokenizer_files(tok, r.work / "tokenizer")
    eos = 1

    def encode(part):
        ids: list[int] = []
        for enc in tok.encode_batch([t for _, t in part], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.int32)

    data = {"train": encode(train), "heldout": encode(held),
            "train_files": [p for p, _ in train], "heldout_files": [p for p, _ in held]}
    torch.save(data, r.work / "data.pt")
    info = {"stage": "tokenizer", "files": len(files), "train_files": len(train), "heldout_files": len(held),
            "train_tokens": int(data["train"].numel()), "heldout_tokens": int(data["heldout"].numel()),
            "vocab": tok.get_vocab_size(with_added_tokens=True),
            "train_bytes": sum(len(t.encode()) for _, t in train), "seconds": round(time.time() - t0, 1)}
    _log(r, info)
    return info


# ============================================================================ stage 2: backbone


def _backbone_params(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or name.startswith("mtp."):
            continue
        (decay if p.dim() >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": None}, {"params": no_decay, "weight_decay": 0.0}]


def stage_backbone(r: Recipe, progress: bool = True) -> dict:
    from .qat import RouterBalancer, training_patches

    torch.manual_seed(r.seed)
    data = torch.load(r.work / "data.pt")
    stream = data["train"].long()
    model = _build(r)
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            p.requires_grad_(False)
    groups = _backbone_params(model)
    groups[0]["weight_decay"] = r.weight_decay
    opt = torch.optim.AdamW(groups, lr=r.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = RouterBalancer(model)
    model.train()
    tokens_per_step = r.batch * r.seq_len
    qat_step = int(r.qat_from * r.steps)
    fp4 = model.cfg.quantization.expert_dtype == "fp4"
    losses: list[float] = []
    t_start = time.time()
    bar = _progress("backbone") if progress else None
    task = bar.add_task("backbone", total=r.steps, loss=float("nan"), tps=0.0) if bar else None
    if bar:
        bar.start()
    try:
        for step in range(r.steps):
            for g in opt.param_groups:
                g["lr"] = _lr(r, step, r.lr, r.steps)
            batch = _windows(stream, r.batch, r.seq_len + 1, _gen(r.seed, 1, step))
            with training_patches(fp4_experts=step >= qat_step and fp4):
                out = model(batch[:, :-1])
                loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            balancer.step()
            losses.append(loss.item())
            elapsed = time.time() - t_start
            tps = tokens_per_step * (step + 1) / elapsed
            if bar:
                bar.update(task, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]), tps=tps)
            if step % r.log_every == 0 or step == r.steps - 1:
                _log(r, {"stage": "backbone", "step": step, "loss": round(losses[-1], 4),
                         "lr": opt.param_groups[0]["lr"], "tok_s": round(tps, 1), "elapsed": round(elapsed, 1)})
    finally:
        if bar:
            bar.stop()
        balancer.remove()
    torch.save(model.state_dict(), r.work / "backbone.pt")  # the drafter stage starts from this
    torch.save(model.state_dict(), r.work / "model.pt")  # what export writes, until a drafter is trained
    wall = time.time() - t_start
    info = {"stage": "backbone", "steps": r.steps, "tokens": tokens_per_step * r.steps, "seconds": round(wall, 1),
            "tok_s": round(tokens_per_step * r.steps / wall, 1),
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "first_loss": round(losses[0], 4),
            "losses": [round(x, 4) for x in losses]}
    _log(r, {k: v for k, v in info.items() if k != "losses"})
    return info


# ============================================================================ stage 3: drafter


def _load_float(r: Recipe, name: str = "model.pt"):
    model = _build(r)
    model.load_state_dict(torch.load(r.work / name))
    return model


@torch.no_grad()
def _targets(model, batch: torch.Tensor):
    out = model(batch, capture=model.cfg.dspark_target_layer_ids)
    return out.features, out.logits.float()


def stage_drafter(r: Recipe, progress: bool = True) -> dict:
    """The drafter from scratch on the corpus, starting from the trained backbone."""
    torch.manual_seed(r.seed)
    stream = torch.load(r.work / "data.pt")["train"].long()
    model = _load_float(r, "backbone.pt")  # rerunning this stage starts again from the trained backbone
    W, k = model.cfg.sliding_window, model.cfg.dspark_block_size

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _gen(r.seed, 2, step)
        ids = _windows(stream, r.drafter_batch, r.seq_len, gen)
        return ids, torch.randint(W - 1, r.seq_len - k, (r.drafter_batch, r.drafter_anchors), generator=gen)

    return _train_drafter(r, model, "drafter", r.drafter_steps, r.drafter_lr, batch, progress)


def stage_distill(r: Recipe, progress: bool = True) -> dict:
    """Self-distillation (:mod:`flashserve.train.selfgen`): the drafter fine-tuned on a mix of the corpus and
    the served backbone's own greedy continuations of corpus prompts, anchors inside the continuations."""
    torch.manual_seed(r.seed)
    stream = torch.load(r.work / "data.pt")["train"].long()
    own = _own_text(r, stream)
    model = _load_float(r, "model.pt")  # the drafter stage's result
    W, k = model.cfg.sliding_window, model.cfg.dspark_block_size
    n_own = max(1, round(r.drafter_batch * r.distill_own_fraction))
    n_text = r.drafter_batch - n_own
    L = own.shape[1]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _gen(r.seed, 5, step)
        text = _windows(stream, n_text, L, gen) if n_text else own[:0]
        mine = own[torch.randint(0, own.shape[0], (n_own,), generator=gen)]
        a_text = torch.randint(W - 1, L - k - 1, (n_text, r.drafter_anchors), generator=gen)
        a_own = torch.randint(max(W, r.distill_prompt_len) - 1, L - k - 1, (n_own, r.drafter_anchors), generator=gen)
        return torch.cat([text, mine]), torch.cat([a_text, a_own])

    return _train_drafter(r, model, "distill", r.distill_steps, r.distill_lr, batch, progress)


def _own_text(r: Recipe, stream: torch.Tensor) -> torch.Tensor:
    """[distill_prompts, distill_prompt_len + distill_gen_len] prompts from the train stream and the served
    backbone's greedy continuations, generated once and kept in the work folder."""
    from .selfgen import greedy_continuations, line_prompts, prompt_windows

    path = r.work / "own_text.pt"
    backbone = hashlib.sha256((r.work / "backbone.pt").read_bytes()).hexdigest()  # text of this backbone only
    key = {"seed": r.seed, "prompts": r.distill_prompts, "prompt_len": r.distill_prompt_len, "backbone": backbone,
           "gen_len": r.distill_gen_len, "threads": r.threads, "line_fraction": r.distill_line_fraction}
    if path.exists():
        saved = torch.load(path)
        if saved["key"] == key:
            return saved["rows"]
    t0 = time.time()
    served = r.work / "served"
    _save_served(r, _load_float(r, "model.pt"), served)
    n_line = round(r.distill_prompts * r.distill_line_fraction)
    prompts = line_prompts(_split_texts(r)[0], _tokenizer(r), n_line, r.distill_prompt_len, _gen(r.seed, 7))
    prompts += prompt_windows(stream, r.distill_prompts - n_line, r.distill_prompt_len, _gen(r.seed, 4))
    rows = torch.tensor(greedy_continuations(served, prompts, r.distill_gen_len, threads=r.threads),
                        dtype=torch.int32)
    torch.save({"key": key, "rows": rows}, path)
    _log(r, {"stage": "own_text", "rows": rows.shape[0], "length": rows.shape[1],
             "seconds": round(time.time() - t0, 1)})
    return rows


def _train_drafter(r: Recipe, model, stage: str, steps: int, lr: float, batch, progress: bool) -> dict:
    """Train the drafter (DSpark stages, or V4's MTP block) with the backbone frozen; ``batch(step)`` gives the
    step's token windows [B, L] and draft anchors [B, M] (last context position of each block)."""
    from .drafter import drafter_loss, mtp_loss
    from .qat import RouterBalancer, training_patches

    model.eval()  # no dropout anywhere; eval only documents that the backbone is frozen
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp.") and not name.endswith(("gate.bias", "gate.bias_vl")))
    params = [p for p in model.mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    balancer = RouterBalancer(model.mtp)
    cfg = model.cfg
    losses, top1 = [], []
    t_start = time.time()
    bar = _progress(stage) if progress else None
    task = bar.add_task(stage, total=steps, loss=float("nan"), tps=0.0) if bar else None
    if bar:
        bar.start()
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _lr(r, step, lr, steps)
            ids, anchors = batch(step)
            ids = ids.long()
            with training_patches():
                if cfg.is_v41:
                    feats, tlogits = _targets(model, ids)
                    loss, stats = drafter_loss(model, feats, ids, tlogits, anchors)
                else:
                    loss, stats = mtp_loss(model, ids)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            balancer.step()
            losses.append(loss.item())
            top1.append(stats["top1"])
            elapsed = time.time() - t_start
            tps = ids.numel() * (step + 1) / elapsed
            if bar:
                bar.update(task, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]), tps=tps)
            if step % r.log_every == 0 or step == steps - 1:
                _log(r, {"stage": stage, "step": step, "loss": round(losses[-1], 4), **stats,
                         "elapsed": round(elapsed, 1)})
    finally:
        if bar:
            bar.stop()
        balancer.remove()
    torch.save(model.state_dict(), r.work / "model.pt")
    n = min(20, len(losses))
    info = {"stage": stage, "steps": steps, "seconds": round(time.time() - t_start, 1),
            "final_loss": round(sum(losses[-n:]) / n, 4), "final_top1": round(sum(top1[-n:]) / n, 4),
            "losses": [round(x, 4) for x in losses]}
    _log(r, {k: v for k, v in info.items() if k != "losses"})
    return info


# ============================================================================ stage 4: export and evaluation


@torch.no_grad()
def heldout_nll(model, stream: torch.Tensor, seq_len: int, max_tokens: int, batch: int = 8) -> tuple[float, int]:
    """Mean next-token NLL of the reference forward over non-overlapping ``seq_len + 1`` windows of ``stream``
    (at most ``max_tokens`` predicted tokens)."""
    n = min(max_tokens // seq_len, (stream.numel() - 1) // seq_len)
    n = max(n, 1)
    wins = torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).long()
    total, count = 0.0, 0
    for i in range(0, n, batch):
        w = wins[i:i + batch]
        logits = model(w[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    return total / count, count


def heldout_sample(r: Recipe, stream: torch.Tensor) -> list[list[int]]:
    """``sample_chunks`` token chunks of ``sample_len`` from the held-out stream, evenly spaced, none holding EOS."""
    L, out = r.sample_len, []
    n = stream.numel()
    for c in range(r.sample_chunks):
        s = (c * n) // max(r.sample_chunks, 1)
        while s + L < n and bool((stream[s:s + L] == 1).any()):
            s += L // 4
        out.append(stream[s:s + L].tolist())
    return out


def engine_nll(model_dir: str | Path, chunks: list[list[int]], **engine_options) -> tuple[float, int]:
    """Mean NLL of the chunks' tokens after their first, from the engine's prompt logprobs."""
    from ..entrypoints.llm import LLM
    from ..engine.sampling_params import SamplingParams

    engine_options.setdefault("enforce_eager", True)  # prompts only: the decode step is never run
    llm = LLM(str(model_dir), **engine_options)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0))
    total, count = 0.0, 0
    for c, o in zip(chunks, outs):
        for tok, lp in zip(c[1:], o.prompt_logprobs[1:]):
            total -= lp[tok]
            count += 1
    return total / count, count


@torch.no_grad()
def greedy_acceptance(model, stream: torch.Tensor, r: Recipe) -> dict:
    """Mean accepted length of greedy DSpark drafting against the backbone's greedy tokens, on held-out text.

    At each anchor p (context = the true text up to p), t0 is the backbone's argmax; the block [t0, N, N, N, N]
    is drafted; the backbone then reads text + t0 + drafts and the drafts are accepted while they equal its
    argmax (docs/architecture.md#dspark). Returns the mean accepted drafts per block and per-position acceptance
    rates."""
    W = model.cfg.sliding_window
    L = min(r.seq_len, stream.numel() - 1)
    g = _gen(r.seed, 3)
    n = r.acceptance_anchors
    starts = torch.randint(0, stream.numel() - L, (n,), generator=g)
    ends = torch.randint(W, L + 1, (n,), generator=g)  # context lengths
    return _acceptance(model, [stream[s:s + e] for s, e in zip(starts.tolist(), ends.tolist())])


@torch.no_grad()
def own_text_acceptance(model, rows: torch.Tensor, prompt_len: int, r: Recipe) -> dict:
    """:func:`greedy_acceptance` where the context is a prompt plus the served backbone's own greedy
    continuation ``rows`` [N, L] and each anchor lies inside the continuation: what drafting meets in serving."""
    k = model.cfg.dspark_block_size
    g = _gen(r.seed, 4)
    n = r.acceptance_anchors
    which = torch.randint(0, rows.shape[0], (n,), generator=g)
    ends = torch.randint(prompt_len + 1, rows.shape[1] - k, (n,), generator=g)
    return _acceptance(model, [rows[i, :e] for i, e in zip(which.tolist(), ends.tolist())])


def _acceptance(model, contexts: list[torch.Tensor]) -> dict:
    cfg = model.cfg
    k = cfg.dspark_block_size
    accepted, per_pos = [], torch.zeros(k)
    for c in contexts:
        e = c.numel()
        ctx = c.long()[None]
        out = model(ctx, capture=cfg.dspark_target_layer_ids)
        t0 = out.logits[:, -1].argmax(-1)
        positions = torch.arange(e)[None]
        d = model.mtp.draft(model, out.features, positions, t0)
        full = torch.cat([ctx, t0[:, None], d.tokens], dim=1)
        ref = model(full).logits[0, e:e + k].argmax(-1)  # backbone's argmax after t0, d1, ..., d_{k-1}
        ok = (d.tokens[0] == ref).long()
        a = int(ok.cumprod(0).sum())
        accepted.append(a)
        per_pos[:a] += 1
    n = len(contexts)
    return {"anchors": n, "mean_accepted": round(sum(accepted) / n, 3),
            "per_position": [round(float(x) / n, 3) for x in per_pos]}


@torch.no_grad()
def mtp_agreement(model, stream: torch.Tensor, r: Recipe) -> dict:
    """V4: how often the MTP block's argmax for token t+2 (from the streams at t and the true token t+1)
    equals the backbone's argmax at t+1, on held-out windows (the greedy acceptance rate of a one-token draft
    given the true next token)."""
    from .drafter import mtp_logits

    n = max(1, min(r.acceptance_anchors // 8, (stream.numel() - 1) // r.seq_len))
    wins = torch.stack([stream[i * r.seq_len:(i + 1) * r.seq_len] for i in range(n)]).long()
    lg, tgt = mtp_logits(model, wins)
    rate = float((lg.argmax(-1) == tgt.argmax(-1)).float().mean())
    return {"windows": n, "mtp_top1_vs_backbone": round(rate, 4)}


def stage_export(r: Recipe, engine: bool = True) -> dict:
    from ..model.loader import load_model

    t0 = time.time()
    model = _load_float(r)
    cfg = model.cfg
    out = Path(r.out)
    if out.exists():
        for p in out.iterdir():
            if p.is_file():
                p.unlink()
    _save_served(r, model, out)
    data = torch.load(r.work / "data.pt")
    held = data["heldout"].long()
    float_nll, n_eval = heldout_nll(model, held, r.seq_len, r.eval_tokens)
    served = load_model(out)
    served_nll, _ = heldout_nll(served, held, r.seq_len, r.eval_tokens)
    acc = greedy_acceptance(served, held, r) if cfg.is_v41 else mtp_agreement(served, held, r)
    chunks = heldout_sample(r, held)
    (out / SAMPLE).write_text(json.dumps({"chunks": chunks}) + "\n")
    report = {
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(r).items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "heldout": {"files": len(data["heldout_files"]), "tokens_evaluated": n_eval, "window": r.seq_len,
                    "float_ppl": round(math.exp(float_nll), 4), "served_ppl": round(math.exp(served_nll), 4)},
        "drafter_acceptance": acc,
        "params": _param_counts(model),  # the float model (the served one keeps FP4/FP8 weights packed)
        "size_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
    }
    if engine:
        nll, count = engine_nll(out, chunks)
        report["heldout_sample"] = {"file": SAMPLE, "tokens_scored": count, "engine_ppl": round(math.exp(nll), 4)}
        if cfg.is_v41:
            report["drafter_acceptance_own_text"] = _own_text_acceptance(r, served, out)
    for name in ("tokenizer", "backbone", "drafter", "distill"):
        rec = _last_record(r, name)
        if rec:
            report[name] = rec
    report["export_seconds"] = round(time.time() - t0, 1)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    _log(r, {"stage": "export", "served_ppl": report["heldout"]["served_ppl"],
             "float_ppl": report["heldout"]["float_ppl"], **report.get("heldout_sample", {})})
    return report


def _own_text_acceptance(r: Recipe, served, out: Path) -> dict:
    """Greedy acceptance where the context is the served model's own continuation of held-out prompts that end
    where a line ends (half of them after a ``def`` line)."""
    from .selfgen import greedy_continuations, line_prompts

    prompts = line_prompts(_split_texts(r)[1], _tokenizer(r), max(r.acceptance_anchors // 4, 1),
                           r.distill_prompt_len, _gen(r.seed, 6))
    rows = torch.tensor(greedy_continuations(out, prompts, r.distill_gen_len, threads=r.threads))
    return {"prompts": len(prompts), **own_text_acceptance(served, rows, r.distill_prompt_len, r)}


def _param_counts(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    experts = sum(p.numel() for n, p in model.named_parameters() if "ffn.experts." in n and not n.startswith("mtp."))
    return {"total": total, "backbone": total - mtp, "drafter": mtp, "backbone_routed_experts": experts}


def _last_record(r: Recipe, stage: str) -> dict | None:
    path = r.work / "log.jsonl"
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("stage") == stage and "step" not in rec:
            found = rec
    return found



@torch.enable_grad()  # training needs autograd whatever the caller's grad mode (a test module may turn it off)
def run(r: Recipe, stages=STAGES, progress: bool = True) -> dict:
    torch.set_num_threads(r.threads)
    r.work.mkdir(parents=True, exist_ok=True)
    results = {}
    for s in stages:
        if s == "tokenizer":
            results[s] = stage_tokenizer(r)
        elif s == "backbone":
            results[s] = stage_backbone(r, progress)
        elif s == "drafter":
            results[s] = stage_drafter(r, progress)
        elif s == "distill":
            results[s] = stage_distill(r, progress)
        elif s == "export":
            results[s] = stage_export(r)
        else:
            raise ValueError(f"unknown stage {s!r}; stages: {', '.join(STAGES)}")
    return results
