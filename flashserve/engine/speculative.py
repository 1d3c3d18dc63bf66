"""Speculative decoding: drafters propose up to k tokens per sequence, one target step verifies them all.

A verification step runs ``1 + k`` rows per sequence through the decode step (the pending token and the drafts),
then :func:`accept` keeps the longest prefix the target agrees with plus one token of its own, so the output is
the target's: token for token under greedy decoding, and in distribution under sampling (standard speculative
rejection sampling: a draft ``d`` drawn from ``q`` is kept with probability ``min(1, p(d) / q(d))``, else a token
is drawn from ``max(p - q, 0)`` normalised). The rule is exact for any ``q``: a drafter that drafts greedily
has a one-hot ``q``; DSpark and MTP draw a sampled request's drafts from their logits under the request's sampling
options, so ``q`` is near ``p`` and a draft is kept with probability ``sum(min(p, q))`` rather than ``p(argmax q)``.
What the rejected rows wrote to the cache is rolled back by the engine
(:meth:`~flashserve.engine.cache.KVCache.rollback`).

Drafters:

* :class:`NgramDrafter`: prompt lookup, no model: the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), found in an index kept
  per sequence and extended by each new token (O(1) per token, whatever the length).
* :class:`DSparkDrafter` (V4.1): one block from the DSpark stages over each stage's window of keys made from the
  target's features at verified positions (docs/architecture.md#dspark), kept in the cache's ``draft_keys``; the
  confidence head stops the block early.
* :class:`MTPDrafter` (V4): the MTP block chained k times over its own window ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampler import sampling_probs
from .sampling_params import SamplingParams
from .spec_config import SpeculativeConfig


@dataclass
class SpecStats:
    """Acceptance counts, per sequence and summed over the engine (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # verification steps that checked at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def add(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = len(other.accepted_per_position)
        if len(self.accepted_per_position) < n:
            self.accepted_per_position += [0] * (n - len(self.accepted_per_position))
        for j, a in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += a

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 (the target's own) + accepted drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance_rate": [a / self.num_drafts for a in self.accepted_per_position]
                if self.num_drafts else []}


def speculation_allowed(params: SamplingParams) -> bool:
    """Requests whose sampling the verifier reproduces exactly: no penalties, bias, constraint or logprobs (those
    decode one token per step, beside speculating ones)."""
    return (not params.has_penalties and not params.logit_bias and params.constraint is None
            and params.logprobs is None)


def accept(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None, q: torch.Tensor | None = None) -> list[int]:
    """The tokens one verification emits: accepted drafts, then the target's own token.

    ``logits`` [R, V]: the target's logits at the pending token's row and each draft's row (R >= len(draft) + 1;
    rows past the draft are padding). Greedy: drafts equal to the target's argmax are kept. Sampling: draft ``j``
    is kept with probability ``min(1, p(d) / q(d))``, else the token comes from ``max(p - q, 0)`` normalised, which
    emits exactly the target's distribution. ``q`` [>= len(draft), V]: the distribution each draft was drawn
    from; None: one-hot on the draft (a greedy drafter), where a kept draft has probability p(d) and a rejection
    draws from p with d removed.
    """
    k = len(draft)
    raw = logits[:k + 1] if logits.dtype == torch.float64 else logits[:k + 1].float()
    if params.greedy:
        target = raw.argmax(-1).tolist()
        out = []
        for j, d in enumerate(draft):
            if target[j] != d:
                return out + [target[j]]
            out.append(d)
        return out + [target[k]]
    probs = sampling_probs(raw, [params] * (k + 1))
    if not k:
        return [int(torch.multinomial(probs[0], 1, generator=generator))]
    u = torch.rand(k, generator=generator, dtype=probs.dtype, device=probs.device).tolist()
    at = (torch.arange(k, device=probs.device), torch.tensor(draft, device=probs.device))
    p_draft = probs[at].tolist()
    q = None if q is None else q[:k].to(probs.dtype)
    q_draft = [1.0] * k if q is None else q[at].tolist()
    out = []
    for j, d in enumerate(draft):
        if u[j] * q_draft[j] < p_draft[j]:
            out.append(d)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[d] = 0.0
        else:
            residual = (probs[j] - q[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: every draft is kept; guard anyway
            residual = probs[j]
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(torch.multinomial(probs[k], 1, generator=generator))]


@dataclass
class Proposal:
    """A sequence's drafts and, for drafts drawn at random, the distribution each was drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] q of each draft; None: each draft is the drafter's argmax


class DraftPicker:
    """How a drafter picks each draft for ``seqs``: the argmax for greedy requests (and for every request unless
    ``draw``: ``draft_sample_method`` "greedy"); for sampled ones a draw from the request's own sampling
    distribution (its temperature, top-k, top-p, min-p) over the drafter's logits, with the request's generator
    (else ``generator``). ``probs`` keeps what was drawn from: one [S, V] tensor per draft position, S = the
    sampled requests (``rows``, their indices in ``seqs``)."""

    def __init__(self, seqs: list, generator: torch.Generator | None, draw: bool = True):
        self.rows = [i for i, s in enumerate(seqs) if draw and not s.params.greedy]
        self.params = [seqs[i].params for i in self.rows]
        self.generators = [seqs[i].generator or generator for i in self.rows]
        self.probs: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens [B] for the drafter's logits [B, V]."""
        tokens = logits.argmax(-1)
        if not self.rows:
            return tokens
        q = sampling_probs(logits[self.rows].float(), self.params)  # [S, V]
        gens = self.generators
        if all(g is gens[0] for g in gens):
            drawn = torch.multinomial(q, 1, generator=gens[0])[:, 0]
        else:
            drawn = torch.cat([torch.multinomial(q[r], 1, generator=g) for r, g in enumerate(gens)])
        tokens[self.rows] = drawn.to(tokens.device)
        self.probs.append(q)
        return tokens

    def drawn_from(self, k: int) -> dict[int, torch.Tensor]:
        """Index in ``seqs`` -> the distributions [k, V] its first ``k`` drafts were drawn from (sampled only)."""
        if not self.rows:
            return {}
        return dict(zip(self.rows, torch.stack(self.probs, 1)[:, :k].unbind(0)))


class Drafter(Protocol):
    """What the engine asks of a drafter."""

    capture: tuple[int, ...]  # target layers whose input features the target forwards must return

    def observe(self, seqs: list, starts: list[int], counts: list[int], feats: torch.Tensor | None) -> None:
        """``counts[i]`` verified rows of ``seqs[i]`` from position ``starts[i]``; ``feats`` [B, R, layers, D]."""

    def propose(self, seqs: list, k: int, generator: torch.Generator | None = None) -> list[Proposal]:
        """Up to ``k`` drafted tokens after each sequence's pending token (random draws, if any, from each
        sequence's generator, else ``generator``)."""

    def prefill_rows(self, seq, start: int, n: int) -> int:
        """How many of a prefill chunk's last rows (positions [start, start + n)) to observe."""


class NgramIndex:
    """For each n-gram of a token list (n in [lo, hi]), where the tokens after its latest occurrence start."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.next: dict[tuple[int, ...], int] = {}
        self.done = 0  # n-grams ending before this position are indexed

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for e in range(self.done, L - 1):  # index the n-grams whose next token is known
            for n in range(self.lo, min(self.hi, e + 1) + 1):
                self.next[tuple(tokens[e - n + 1:e + 1])] = e + 1
        self.done = max(self.done, L - 1)
        for n in range(min(self.hi, L), self.lo - 1, -1):
            c = self.next.get(tuple(tokens[L - n:]))
            if c is not None:
                return tokens[c:min(c + k, L)]
        return []


class NgramDrafter:
    """Prompt lookup (vLLM's "ngram" method): no model, drafts copied from the sequence's own history."""

    capture: tuple[int, ...] = ()

    def __init__(self, spec: SpeculativeConfig):
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max

    def observe(self, seqs: list, starts: list[int], counts: list[int], feats: torch.Tensor | None) -> None:
        pass

    def prefill_rows(self, seq, start: int, n: int) -> int:
        return 0

    def propose(self, seqs: list, k: int, generator: torch.Generator | None = None) -> list[Proposal]:
        out = []
        for s in seqs:
            if s.ngram is None:
                s.ngram = NgramIndex(self.lo, self.hi)
            out.append(Proposal(s.ngram.lookup(s.tokens, k)))
        return out


class DSparkDrafter:
    """V4.1's DSpark (docs/architecture.md#dspark): stage windows kept in the cache, one block drafted per step."""

    def __init__(self, model, cache, spec: SpeculativeConfig):
        cfg = model.cfg
        if model.mtp is None:
            raise ValueError("this checkpoint has no DSpark weights (mtp.*): speculative method 'dspark' needs them")
        self.model, self.cache, self.cfg = model, cache, cfg
        self.capture = tuple(cfg.dspark_target_layer_ids)
        self.threshold = spec.confidence_threshold
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.W = cfg.sliding_window

    def prefill_rows(self, seq, start: int, n: int) -> int:
        return n  # every row with features (encoder-only prefill returns the decoder's replayed ones)

    @torch.inference_mode()
    def observe(self, seqs: list, starts: list[int], counts: list[int], feats: torch.Tensor | None) -> None:
        """Write each stage's keys for the verified rows (the first ``counts[i]`` rows of ``feats``)."""
        if feats is None or not seqs:
            return
        dev = feats.device
        b_idx = [i for i, n in enumerate(counts) for _ in range(min(n, self.W))]
        r_idx = [r for n in counts for r in range(max(n - self.W, 0), n)]
        if not b_idx:
            return
        pos = torch.tensor([starts[b] + r for b, r in zip(b_idx, r_idx)], dtype=torch.long, device=dev)
        rows = feats[torch.tensor(b_idx, device=dev), torch.tensor(r_idx, device=dev)]  # [N, layers, D]
        keys = self.model.mtp.context_keys(self.model, rows[None], pos[None])[0]  # [N, stages, hd]
        slots = torch.tensor([seqs[b].slot for b in b_idx], dtype=torch.long, device=dev)
        self.cache.storage.draft_keys[slots, pos % self.W] = keys.to(self.cache.storage.draft_keys.dtype)

    @torch.inference_mode()
    def propose(self, seqs: list, k: int, generator: torch.Generator | None = None) -> list[Proposal]:
        if not seqs:
            return []
        store = self.cache.storage.draft_keys
        dev = store.device
        end = torch.tensor([s.num_computed for s in seqs], dtype=torch.long, device=dev)  # pending token's position
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        ctx_pos = end[:, None] - self.W + torch.arange(self.W, device=dev)  # [B, W] oldest first
        keys = store[slots[:, None], ctx_pos % self.W].to(self.model.dtype)
        ctx_pos = torch.where(ctx_pos >= 0, ctx_pos, -1)
        first = torch.tensor([s.tokens[s.num_computed] for s in seqs], dtype=torch.long, device=dev)
        pick = DraftPicker(seqs, generator, self.probabilistic)
        d = self.model.mtp.draft_block(self.model, keys, ctx_pos, end, first, pick=pick)
        tokens, conf = d.tokens[:, :k].tolist(), d.confidence[:, :k].tolist()
        q = pick.drawn_from(k)  # [k, V] per sampled sequence
        out = []
        for i, (t, c) in enumerate(zip(tokens, conf)):
            n = next((j for j, x in enumerate(c) if x < self.threshold), len(t))
            out.append(Proposal(t[:n], q[i][:n] if i in q else None))
        return out


class MTPDrafter:
    """V4's MTP block (docs/architecture.md#v4-mtp), chained k times. Its window ring (layer ``num_hidden_layers``, kept
    with spare rows like the backbone's) holds one row per verified position: ``h_proj(streams at t) + e_proj(token
    t+1)`` through the block. After each verification the block catches up on the verified rows, whose last row drafts
    the first token; each further draft is one row fed with the block's own output streams. Those chained rows are
    speculative: the next catch-up rewrites their positions. Each draft is picked as :class:`DraftPicker` says."""

    capture: tuple[int, ...] = ()
    streams = True

    def __init__(self, model, cache, spec: SpeculativeConfig):
        if model.mtp is None:
            raise ValueError("this checkpoint has no MTP weights (mtp.*): speculative method 'mtp' needs them")
        self.model, self.cache, self.W = model, cache, model.cfg.sliding_window
        self.probabilistic = spec.draft_sample_method == "probabilistic"

    def prefill_rows(self, seq, start: int, n: int) -> int:
        """Rows of a prefill chunk [start, start + n) to catch up on: those within a window of the prompt's end
        (earlier ones would be overwritten before any draft reads them)."""
        return max(0, min(n, start + n - (seq.num_tokens - self.W)))

    def _block(self, seqs: list, streams: torch.Tensor, ids: list[list[int]], start: list[int]):
        from .batch_state import BatchState

        dev = streams.device
        state = BatchState(self.cache, [s.slot for s in seqs], 0)
        nxt = torch.tensor(ids, dtype=torch.long, device=dev)
        st = torch.tensor(start, dtype=torch.long, device=dev)
        return self.model.mtp.step(self.model, streams.to(self.model.dtype), nxt, state, 0, st)

    @torch.inference_mode()
    def observe(self, seqs: list, starts: list[int], counts: list[int], feats: torch.Tensor | None) -> None:
        if feats is None:
            return
        by_count: dict[int, list[int]] = {}
        for i, c in enumerate(counts):
            if c:
                by_count.setdefault(c, []).append(i)
        for c, idx in by_count.items():
            sub = [seqs[i] for i in idx]
            ids = [s.tokens[starts[i] + 1:starts[i] + 1 + c] for i, s in zip(idx, sub)]
            logits, x = self._block(sub, feats[idx, :c], ids, [starts[i] for i in idx])
            for j, s in enumerate(sub):
                s.mtp_next = (x[j, -1], logits[j, -1])  # the first draft is picked from these when proposing

    @torch.inference_mode()
    def propose(self, seqs: list, k: int, generator: torch.Generator | None = None) -> list[Proposal]:
        ready = [s for s in seqs if getattr(s, "mtp_next", None) is not None]
        out = {id(s): Proposal([]) for s in seqs}
        if not ready:
            return [out[id(s)] for s in seqs]
        pick = DraftPicker(ready, generator, self.probabilistic)
        x = torch.stack([s.mtp_next[0] for s in ready])[:, None]  # [B, 1, n, D]
        tok = pick(torch.stack([s.mtp_next[1] for s in ready])).tolist()
        for s in ready:
            s.mtp_next = None  # consumed: the next catch-up makes a new one
        drafts = [[t] for t in tok]
        pos = [s.num_computed for s in ready]  # the pending token's position: the first chained row's
        for j in range(1, k):
            logits, x = self._block(ready, x, [[t] for t in tok], [p + j - 1 for p in pos])
            tok = pick(logits[:, -1]).tolist()
            x = x[:, -1:]
            for d, t in zip(drafts, tok):
                d.append(t)
        q = pick.drawn_from(k)
        for i, s in enumerate(ready):
            out[id(s)] = Proposal(drafts[i], q.get(i))
        return [out[id(s)] for s in seqs]


def make_drafter(spec: SpeculativeConfig, model, cache) -> Drafter:
    cfg = model.cfg
    if spec.method == "ngram":
        return NgramDrafter(spec)
    if spec.method == "dspark":
        if not cfg.is_v41:
            raise ValueError(f"speculative method 'dspark' needs a V4.1 model ({cfg.model_type} has MTP: use 'mtp')")
        if spec.num_speculative_tokens > cfg.dspark_block_size:
            raise ValueError(f"speculative_config.num_speculative_tokens: {spec.num_speculative_tokens} exceeds "
                             f"the DSpark block size ({cfg.dspark_block_size})")
        return DSparkDrafter(model, cache, spec)
    if spec.method == "mtp":
        if cfg.is_v41:
            raise ValueError("speculative method 'mtp' needs a V4 model (V4.1 drafts with DSpark: use 'dspark')")
        return MTPDrafter(model, cache, spec)
    raise ValueError(f"speculative method {spec.method!r} is not available for {cfg.model_type}")
