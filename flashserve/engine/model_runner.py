"""Runs the scheduled chunks of one step through the model: one decode forward for every decoding sequence
(B rows × 1 token, or × R rows when drafts are verified), one forward per prefill chunk (V4.1 default:
encoder-only with decoder bounded replay)."""

from __future__ import annotations

import torch

from .batch_state import BatchState
from .cache import KVCache
from .graphs.decode_step import DecodeStep
from .images import chunk_embeds
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, cache: KVCache, decode_step: DecodeStep):
        self.model = model
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
        R = max(len(r) for r in rows)
        ids = [r + [r[-1]] * (R - len(r)) for r in rows]
        inp = step.inputs(ids, [s.num_computed for s in seqs], [s.slot for s in seqs], [len(s.pages) for s in seqs])
        logits, feats = step(inp)
        return logits[:len(seqs)], (None if feats is None else feats[:len(seqs)])

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
