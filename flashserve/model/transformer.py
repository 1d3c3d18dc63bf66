"""The DeepSeek-V4 / V4.1 language model: embedding → hyper-connection streams → blocks → collapse → head.

Parameter names mirror the released checkpoint (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight`` via :meth:`Transformer.checkpoint_tensors`, ...). ``forward`` is the
reference: every layer on every row, no cache unless a state is passed. ``encoder_only`` runs V4.1's
prefill with decoder bounded replay (docs/architecture.md#encoder-decoder-and-bounded-replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config.model_config import ModelConfig
from . import blas
from .block import Block
from .context import ForwardContext
from .engram import EngramHasher
from .mhc import HyperHead, collapse
from .norms import fp32, RMSNorm
from .rope import RotaryTables
from .state import DenseState, Replay, SequenceState
from .vision import Aligner, VisionTower, span_embeddings


@dataclass
class ForwardOutput:
    """Logits of the requested rows, and (on request) the per-layer stream means DSpark drafts from."""

    logits: torch.Tensor | None  # [B, R, V]
    features: dict[int, torch.Tensor]  # layer -> mean over streams of the input to that layer [B, S, D]
    streams: torch.Tensor | None = None  # final streams [B, R, n, D] (V4 MTP input)


class Transformer(nn.Module):
    """DeepSeek-V4 (``deepseek_v4``) or V4.1 (``deepseek_v41``) text model, built from a :class:`ModelConfig`."""

    def __init__(self, cfg: ModelConfig, *, with_mtp: bool = True, with_vision: bool = True):
        super().__init__()
        self.cfg = cfg
        D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
        self.embed = nn.Embedding(V, D)
        rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
        self.layers = nn.ModuleList(
            Block(cfg, i, ratio=cfg.compress_ratios[i], role=cfg.layer_role(i),
                  hash_routed=i in cfg.hash_layer_ids, engram_rows=rows.get(i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = blas.Linear(D, V, bias=False)
        self.hc_head = None if cfg.shifted_collapse else HyperHead(n, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.rope = RotaryTables(cfg)
        self.engram_hasher = EngramHasher(cfg) if cfg.engram_layer_ids else None
        self._engram_slot = {lid: i for i, lid in enumerate(cfg.engram_layer_ids)}
        # layer -> its engram table's row cache, where the table is streamed (flashserve/model/row_cache.py)
        self.streamed_rows: dict[int, nn.Module] = {}
        # QAT quantisation points (docs/architecture.md#numerics-and-quantisation-points); load_model turns them on
        # for V4.1
        self.fake_quant = False
        self.vision: VisionTower | None = None  # V4.1 image input (docs/architecture.md#vision), if configured
        self.aligner: Aligner | None = None
        if with_vision and cfg.vision is not None:
            self.vision, self.aligner = VisionTower(cfg.vision), Aligner(cfg.vision, D)
            self.image_start = nn.Parameter(torch.zeros(D))
            self.image_newline = nn.Parameter(torch.zeros(D))
            self.image_end = nn.Parameter(torch.zeros(D))
        self.mtp = None
        if with_mtp and cfg.num_nextn_predict_layers:
            from .draft import DSparkStages, MTPBlocks

            self.mtp = DSparkStages(cfg) if cfg.is_v41 else MTPBlocks(cfg)

    # ------------------------------------------------------------------ helpers
    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's: the embeddings and head may be held as a checkpoint stores them)."""
        return self.norm.weight.dtype

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., D] in the compute dtype (the table may be held in bfloat16 as stored:
        ``loader.KEEP_STORED``; the rows convert exactly)."""
        x = self.embed(ids)
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def new_state(self, batch: int) -> DenseState:
        """A float state for ``batch`` sequences starting at position 0."""
        return DenseState(batch, self.cfg.sliding_window, self.embed.weight.device)

    def drop_vision(self) -> None:
        """Serve text only (a checkpoint without the vision tower)."""
        self.vision = self.aligner = None
        for name in ("image_start", "image_newline", "image_end"):
            delattr(self, name)

    def embed_image(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Embeddings [span, D] of one image's span from its patches [rows·cols, 3·p·p] on a ``grid`` of
        (rows, cols) patches (see :mod:`flashserve.engine.images`)."""
        if self.vision is None:
            raise ValueError("this model has no vision tower: it reads text only")
        return span_embeddings(self.vision, self.aligner, (self.image_start, self.image_newline, self.image_end),
                               patches, grid)

    def image_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        return (ids == self.cfg.image_token_id) if self.cfg.image_input else None

    def _engram_ids(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor | None:
        if self.engram_hasher is None:
            return None
        hist = state.history(ids, self.cfg.engram_max_ngram_size - 1)
        dead = self.image_mask(hist)
        return self.engram_hasher(hist, torch.zeros_like(hist, dtype=torch.bool) if dead is None else dead)

    def _run(self, x: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext, layers: range,
             engram: torch.Tensor | None, capture: tuple[int, ...], features: dict[int, torch.Tensor]):
        for i in layers:
            if i in capture:
                features[i] = fp32(x).mean(-2)
            x, pre = self.layers[i](x, pre, ctx, self.engram_rows(engram, i))
        return x, pre

    def engram_rows(self, engram: torch.Tensor | None, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s engram row ids [B,S,lookups] from all engram layers' ``engram`` (None: not an engram
        layer)."""
        slot = self._engram_slot.get(layer)
        return None if slot is None else engram[:, :, slot]

    def logits_from_streams(self, x: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """Final collapse (V4: ``hc_head``; V4.1: last block's FFN pre), norm and head."""
        h = self.hc_head(x) if self.hc_head is not None else collapse(x, pre)
        return self.head(self.norm(h))

    # ------------------------------------------------------------------ forward
    def context(self, input_ids: torch.Tensor, state: SequenceState, start: torch.Tensor | None = None,
                fake_quant: bool | None = None) -> ForwardContext:
        """``state`` begun for the rows ``input_ids`` [B,S] at ``start`` [B], and the context the blocks read."""
        S = input_ids.shape[1]
        state.begin(S, start)
        positions = state.start[:, None] + torch.arange(S, device=input_ids.device)
        return ForwardContext(state=state, positions=positions, input_ids=input_ids, rope=self.rope,
                              fake_quant=self.fake_quant if fake_quant is None else fake_quant,
                              image_mask=self.image_mask(input_ids))

    def begin(self, input_ids: torch.Tensor, state: SequenceState | None = None, *,
              start: torch.Tensor | None = None, fake_quant: bool | None = None,
              image_embeds: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, ForwardContext, torch.Tensor | None]:
        """What every forward does before its first block: the state begun at ``start``, the embeddings expanded
        to streams [B,S,n,D], the first block's incoming ``pre`` (V4.1) and the engram rows [B,S,layers,...]."""
        cfg = self.cfg
        B, S = input_ids.shape
        ctx = self.context(input_ids, self.new_state(B) if state is None else state, start, fake_quant)
        state = ctx.state
        x = self.embed_tokens(input_ids)
        if image_embeds is not None:
            if ctx.image_mask is None:
                raise ValueError(f"{cfg.model_type} has no image positions (no image_token_id)")
            x = torch.where(ctx.image_mask[..., None], image_embeds.to(x.dtype), x)
        x = x[..., None, :].expand(B, S, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = None
        if cfg.shifted_collapse:  # the first block's attention collapses onto stream 0
            pre = torch.zeros(B, S, cfg.hc_mult, device=x.device)
            pre[..., 0] = 1.0
        engram = self._engram_ids(input_ids, state)
        if not torch.compiler.is_compiling():  # a compiled step's prologue: its caller prefetches (host work)
            self.prefetch_rows(engram)
        return x, pre, ctx, engram

    def prefetch_rows(self, engram: torch.Tensor | None) -> None:
        """Start reading the engram rows a step gathers that the streamed tables miss (under a weight budget), on
        their own threads while the layers before them run; ``engram``: the step's row ids (:meth:`begin`)."""
        for layer, rows in self.streamed_rows.items():
            rows.prefetch(self.engram_rows(engram, layer))

    def forward(self, input_ids: torch.Tensor, state: SequenceState | None = None, *,
                start: torch.Tensor | None = None, fake_quant: bool | None = None, encoder_only: bool = False,
                run_decoder: bool = True, logits_rows: int | None = None,
                capture: tuple[int, ...] = (), return_streams: bool | int = False,
                image_embeds: torch.Tensor | None = None) -> ForwardOutput:
        """Run ``input_ids`` [B,S] continuing ``state`` (a fresh one when None).

        ``image_embeds`` [B,S,D]: the embeddings of image-span positions (those whose id is ``image_token_id``),
        merged before the stream expansion; other rows of it are ignored.

        ``encoder_only`` (V4.1): layers before the decoder run on all rows, the decoder's cache producer on
        all rows, and the decoder (if ``run_decoder``) only on the last ``sliding_window`` positions of the
        sequence (bounded replay). ``logits_rows``: compute the head only on the last that many rows.
        """
        cfg = self.cfg
        x, pre, ctx, engram = self.begin(input_ids, state, start=start, fake_quant=fake_quant,
                                         image_embeds=image_embeds)
        features: dict[int, torch.Tensor] = {}
        L = cfg.num_hidden_layers
        split = cfg.decoder_start if (encoder_only and cfg.encoder_decoder) else L
        x, pre = self._run(x, pre, ctx, range(split), engram, capture, features)
        if split < L:
            x, pre, ctx, features = self._replay(x, pre, ctx, engram, capture, features, run_decoder)
            if x is None:
                return ForwardOutput(None, features)
        rows = x.shape[1] if logits_rows is None else min(logits_rows, x.shape[1])
        streams = None
        if return_streams:  # True: the logits rows; a number: that many last rows
            streams = x[:, -(rows if return_streams is True else min(int(return_streams), x.shape[1])):]
        x, pre = x[:, -rows:], (None if pre is None else pre[:, -rows:])
        return ForwardOutput(self.logits_from_streams(x, pre), features, streams)

    def _replay(self, x, pre, ctx, engram, capture, features, run_decoder):
        """Encoder-only tail: produce the decoder's global cache on all rows, then run the decoder on the
        last ``window`` positions (kept across chunks in the state) if ``run_decoder``.

        Contract: the encoder-only forwards of a sequence come first and the replay runs once, on the last
        chunk; every row of the forward ends at the same position. Violations raise ``ValueError``.
        """
        cfg, state = self.cfg, ctx.state
        split, W = cfg.decoder_start, cfg.sliding_window
        self.layers[split].produce(x, pre, ctx)
        end = ctx.positions[:, -1] + 1
        keep_from = (end - W).clamp(min=0)
        # the decoder's inputs for the last window of positions, kept across chunks (fp32 for pre, ids, pos)
        xs = state.replay(Replay.X, x.flatten(-2), keep_from)
        ps = state.replay(Replay.PRE, pre.float(), keep_from)
        meta = torch.stack([ctx.input_ids.float(), ctx.positions.float()], dim=-1)
        ms = state.replay(Replay.META, meta, keep_from)
        if not run_decoder:
            return None, None, ctx, features
        if bool((end != end[0]).any()):
            raise ValueError("decoder replay needs every row of the forward to end at the same position")
        R = min(int(end[0]), W)
        expected = torch.arange(int(end[0]) - R, int(end[0]), device=x.device, dtype=torch.float32)
        if ms.shape[1] < R or not torch.equal(ms[:, -R:, 1], expected.expand(ms.shape[0], -1)):
            raise ValueError("encoder-only prefill must precede any other forward of the sequence and "
                             "replay the decoder once; use exact forwards to continue a sequence")
        state.replay(Replay.META, ms[:, :0], end + W)  # consume: a second replay fails
        n, D = cfg.hc_mult, cfg.hidden_size
        xr = xs[:, -R:].unflatten(-1, (n, D))
        pr = ps[:, -R:]
        ids = ms[:, -R:, 0].round().long()
        state.begin(R, end - R)
        positions = state.start[:, None] + torch.arange(R, device=x.device)
        rctx = ForwardContext(state=state, positions=positions, input_ids=ids, rope=self.rope,
                              fake_quant=ctx.fake_quant, image_mask=self.image_mask(ids), produced=ctx.produced)
        xr, pr = self._run(xr, pr, rctx, range(split, cfg.num_hidden_layers), engram, capture, features)
        return xr, pr, rctx, features

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Released checkpoint name → tensor (views into stacked experts for per-expert names), or a
        :class:`~flashserve.model.packed.PackedSlot` for packed modules."""
        from .mapped_experts import TABLES
        from .packed import PACKED_BUFFERS, packed_destinations, streamed_prefixes

        out: dict[str, torch.Tensor] = dict(packed_destinations(self))  # packed modules take stored bytes
        # names' ends: no checkpoint tensor
        not_stored = (*PACKED_BUFFERS, *TABLES, blas.PANELS, *blas.INT8_JOINT_BUFFERS)
        slots = streamed_prefixes(self)  # row caches: their tensors are slots, filled as rows are read
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith(("rope.", "engram_hasher.", *slots)) or name.endswith(not_stored):
                continue
            if ".experts.w" in name:
                prefix, w = name.rsplit(".experts.", 1)
                first = getattr(self.get_submodule(f"{prefix}.experts"), "first", 0)
                for e in range(t.shape[0]):
                    out[f"{prefix}.experts.{first + e}.{w}.weight"] = t[e]
                continue
            name = name.replace("hc_head.hc_head_", "hc_head_")
            out[name] = t
        return out
