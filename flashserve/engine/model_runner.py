"""Runs the scheduled chunks of one step through the model and samples what they emit: one decode forward for
every decoding sequence (B rows × 1 token, or × R rows when drafts are verified), one forward per group of
equal prefill chunks (V4.1 default: encoder-only with decoder bounded replay). Tokens in, tokens out: the
engine then applies them to its sequences (:class:`~.llm_engine.LLMEngine` owns every change to a sequence)."""

from __future__ import annotations

import torch

from .batch_state import BatchState
from .cache import KVCache
from .graphs.decode_step import DecodeStep
from .guided import Guides
from .images import chunk_embeds
from .sampler import SampleRow, TokenCounts, prompt_logprobs, sample
from .sequence import Sequence
from .speculative import accept

Emitted = list[tuple[int, "dict[int, float] | None"]]  # the (token, logprobs) one sequence emits in a step




class ModelRunner:
    def __init__(self, model, cache: KVCache, decode_step: DecodeStep, *, guides: Guides,
                 generator: torch.Generator, drafter=None):
        """``guides``: structured-output matchers; ``generator``: the sampler's for requests without a seed;
        ``drafter``: the speculative drafter whose input features prefill chunks return (None: none)."""
        self.model = model
        self.guides, self.generator, self.drafter = guides, generator, drafter
        self.capture = decode_step.capture  # layers whose features every forward returns (a drafter's input)
        self.streams = decode_step.streams  # or the final streams (V4 MTP)
        self.cache = cache
        self.cfg = model.cfg
        self.device = model.embed.weight.device
        self.decode_step = decode_step

    def _state(self, seqs: list[Sequence]) -> BatchState:
        return BatchState(self.cache, [s.slot for s in seqs], max(len(s.pages) for s in seqs))

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of the next token of each sequence (each has exactly one token to compute), through
        the fixed-shape step."""
        return self.verify(seqs, [[s.tokens[s.num_computed]] for s in seqs])[0][:, -1]

    def verify(self, seqs: list[Sequence], rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, R, V] of ``rows`` (each sequence's pending token, then its drafts; shorter lists padded to
        the longest) from each sequence's ``num_computed``, and the captured features [B, R, layers, D]."""
        step = self.decode_step
        R = step.rows(max(len(r) for r in rows))
        ids = [r + [r[-1]] * (R - len(r)) for r in rows]
        inp = step.inputs(ids, [s.num_computed for s in seqs], [s.slot for s in seqs], [len(s.pages) for s in seqs])
        logits, feats = step(inp)
        return logits[:len(seqs)], (None if feats is None else feats[:len(seqs)])

    @torch.inference_mode()
    def run_decode(self, seqs: list[Sequence]) -> tuple[list[Emitted], torch.Tensor | None]:
        """One forward over each decoding sequence's pending token and its drafts, then what each emits:
        its drafts' verification, or one sampled token (batched through the sampler) when it has none; and the
        captured features [B, R, layers, D] for the drafter (or None)."""
        rows = [[s.tokens[s.num_computed]] + s.draft for s in seqs]
        if max(len(r) for r in rows) == 1 and self.drafter is None:
            logits, feats = self.decode(seqs)[:, None], None
        else:
            logits, feats = self.verify(seqs, rows)
        out: list[Emitted] = [[] for _ in seqs]
        plain = [i for i, s in enumerate(seqs) if not s.draft]
        if plain:
            lg = logits[plain, 0] if len(plain) < len(seqs) else logits[:, 0]
            result = sample(lg, [self.sample_row(seqs[i], lg) for i in plain], self.generator)
            for i, tid, lp in zip(plain, result.token_ids, result.logprobs):
                out[i] = [(tid, lp)]
        for i, s in enumerate(seqs):
            if s.draft:
                out[i] = [(t, None) for t in accept(logits[i], s.draft, s.params, s.generator or self.generator,
                                                   s.draft_probs)]
        return out, feats

    def sample_row(self, seq: Sequence, logits: torch.Tensor) -> SampleRow:
        """The sampler's view of ``seq``, O(1): no copy of its ids; penalty counts and the structured-output
        matcher made once, then kept."""
        if seq.counts is None and seq.params.has_penalties:
            seq.counts = TokenCounts(seq.prompt_ids, seq.output_view, logits.shape[-1], logits.device)
        if seq.guide is None and seq.params.constraint is not None:
            seq.guide = self.guides.guide(seq.params.constraint, seq.params.stop_token_ids)
        return SampleRow(seq.params, seq.prompt_ids, seq.output_view, seq.generator, seq.counts, seq.guide)

    @torch.inference_mode()
    def run_prefill(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int, dict | None]],
                                                                         list[tuple]]:
        """Compute each ``(sequence, n)`` chunk from the sequence's ``num_computed``, equal chunks in one forward
        (:meth:`prefill_key`; a chunk that wants prompt logprobs alone, which are recorded in its request
        group), and sample the next token of every sequence whose chunk completes it, in one sampler call.
        Returns (sequence, token, logprobs) for those, and (sequence, first position, rows, features) for the
        drafter: the chunk's last rows its input needs, to observe once the next token is known."""
        groups: dict[tuple, list[Sequence]] = {}
        for seq, n in chunks:
            want_plp = seq.group.prompt_logprobs is not None and seq.index == 0
            key = self.prefill_key(seq, n, want_plp)
            groups.setdefault(key if not want_plp else key + (seq.seq_id,), []).append(seq)
        to_sample: list[Sequence] = []
        logits_rows: list[torch.Tensor] = []
        observed: list[tuple] = []
        for key, seqs in groups.items():
            chunk, want_plp = key[0], key[4]
            want = [self.drafter.prefill_rows(s, s.num_computed, chunk) for s in seqs] if self.drafter else [0]
            lg, feats = self.prefill(seqs, chunk, all_logits=want_plp, stream_rows=max(want))
            if feats:
                F, f = feats
                for b, s in enumerate(seqs):  # the last rows of the chunk each drafter asks for
                    c = min(want[b], F)
                    observed.append((s, s.num_computed + chunk - c, c, f[b:b + 1, F - c:]))
            if want_plp:
                lg = self._prompt_logprobs(seqs[0], chunk, lg)
            if lg is not None:
                logits_rows.append(lg)
                to_sample.extend(seqs)
        if not to_sample:
            return [], observed
        logits = torch.cat(logits_rows, dim=0)
        result = sample(logits, [self.sample_row(s, logits) for s in to_sample], self.generator)
        return list(zip(to_sample, result.token_ids, result.logprobs)), observed

    @staticmethod
    def _prompt_logprobs(seq: Sequence, chunk: int, lg: torch.Tensor) -> torch.Tensor | None:
        """Record the prompt logprobs of a chunk's logits [1, chunk, V]; the last row's when it ends the prompt."""
        group, a = seq.group, seq.num_computed
        nxt = seq.tokens[a + 1:a + chunk + 1]
        upto = min(len(nxt), seq.num_prompt - 1 - a)
        if upto > 0 and len(group.prompt_logprobs) == a + 1:  # not again after a preemption
            group.prompt_logprobs.extend(prompt_logprobs(lg[0, :upto], nxt[:upto], group.params.prompt_logprobs))
        return lg[:, -1] if a + chunk == seq.num_tokens else None

    def _image_embeds(self, seqs: list[Sequence], n: int) -> torch.Tensor | None:
        """[B, n, D] embeddings of the image-span positions among the next ``n`` of each sequence, or None."""
        if not any(s.group.images for s in seqs):
            return None
        out = torch.zeros(len(seqs), n, self.cfg.hidden_size, dtype=self.model.dtype, device=self.device)
        hit = [chunk_embeds(s.group.images, s.num_computed, s.num_computed + n, out[b]) for b, s in enumerate(seqs)]
        return out if any(hit) else None

    def encoder_only(self, seq: Sequence, n: int) -> bool:
        """V4.1 encoder-only prefill covers prompt tokens only: tokens generated before a preemption are
        recomputed exactly, as they were first computed by full decode steps."""
        return self.cfg.is_v41 and not seq.exact and seq.num_computed + n <= seq.num_prompt

    def prefill_key(self, seq: Sequence, n: int, all_logits: bool) -> tuple:
        """Chunks with equal keys run as one forward: same S and mode; an encoder-only chunk that ends the
        prompt replays the decoder, which needs every row to end at the same position."""
        a = seq.num_computed
        encoder_only = self.encoder_only(seq, n)
        replay_end = a + n if (encoder_only and a + n == seq.num_prompt) else -1
        return (n, encoder_only, a + n == seq.num_tokens, replay_end, all_logits)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], n: int, *, all_logits: bool = False,
                stream_rows: int = 0) -> tuple[torch.Tensor | None, tuple]:
        """Compute ``n`` tokens of each of ``seqs`` (equal :meth:`prefill_key`) from their ``num_computed``;
        logits [B, V] of the last row when the chunk completes the sequences ([B, n, V] with ``all_logits``),
        else None; and ``(F, features [B, F, layers, D])`` of the chunk's last F rows, whose captured features
        the forward returned, or with ``stream_rows`` the final streams ``(F, [B, F, n, D])`` of the last
        ``stream_rows`` (``()`` when none)."""
        seq = seqs[0]
        a = seq.num_computed
        last = a + n == seq.num_tokens
        ids = torch.tensor([s.tokens[s.num_computed:s.num_computed + n] for s in seqs], dtype=torch.long,
                           device=self.device)
        start = torch.tensor([s.num_computed for s in seqs], dtype=torch.long, device=self.device)
        encoder_only = self.encoder_only(seq, n)
        out = self.model(ids, self._state(seqs), start=start, encoder_only=encoder_only,
                         run_decoder=not encoder_only or a + n == seq.num_prompt,
                         logits_rows=None if all_logits else 1, image_embeds=self._image_embeds(seqs, n),
                         capture=self.capture, return_streams=stream_rows if self.streams else False)
        feats = ()
        if self.streams and stream_rows and out.streams is not None:
            feats = (out.streams.shape[1], out.streams)
        if self.capture and all(L in out.features for L in self.capture):
            F = min(out.features[L].shape[1] for L in self.capture)  # encoder-only: the decoder's replayed rows
            feats = (F, torch.stack([out.features[L][:, -F:] for L in self.capture], dim=2))
        if out.logits is None:
            return None, feats
        if all_logits:
            return out.logits, feats
        return (out.logits[:, -1] if last else None), feats
