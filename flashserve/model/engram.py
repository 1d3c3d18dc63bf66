"""Engram: hashed 2/3/4-gram memory rows injected into the residual streams of a few layers
(docs/architecture.md#engram)."""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from ..config.engram_primes import engram_primes
from ..config.model_config import ModelConfig
from ..errors import UserError
from . import blas
from .norms import fp32

_SPACE_SENTINEL = "\ue000"


class EngramMapError(UserError):
    """The tokenizer's engram class count disagrees with the config's ``engram_compressed_vocab_size``."""


def engram_normalizer() -> normalizers.Normalizer:
    """The reference's normaliser, built from the ``tokenizers`` library's own steps
    (docs/architecture.md#engram-hash-ids, step 1): NFKC, NFD, strip accents, lowercase, whitespace runs to one space, a
    lone space kept, strip."""
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),  # so Strip keeps a token that is one space
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def compressed_token_map(tok: HFTokenizer) -> tuple[list[int], int]:
    """Class id of every id of ``tok`` (first-seen order) and the class count, as the reference builds them.

    Walks the tokenizer's own length (added tokens included). A token whose lone decode holds U+FFFD (a
    partial UTF-8 sequence) is keyed by its raw vocabulary string, in the same dictionary as the normalised
    texts; a text that normalises to nothing is keyed by itself.
    """
    norm = engram_normalizer()
    classes: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = (tok.id_to_token(i) or "") if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(classes.setdefault(key, len(classes)))
    return out, len(classes)


def engram_multipliers(layer_id: int, n: int, compressed_vocab: int) -> list[int]:
    """Odd int64 multipliers of one engram layer: numpy's PCG64 seeded with 10007·layer
    (docs/architecture.md#engram-hash-ids, step 3)."""
    bound = ((2 ** 63 - 1) // compressed_vocab) // 2
    vals = np.random.default_rng(10007 * layer_id).integers(0, bound, size=n, dtype=np.int64)
    return [int(2 * v + 1) for v in vals]


class EngramHasher(nn.Module):
    """Token ids → per-layer table row ids ``[B, S, n_layers, (max_ngram-1)·heads]``; no learned weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        for name in ("primes", "offsets", "multipliers", "token_map"):
            self.register_buffer(name, torch.empty(0, dtype=torch.long), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute primes, offsets, multipliers and the identity token map (also after meta init)."""
        cfg = self.cfg
        n_layers, order = len(cfg.engram_layer_ids), cfg.engram_max_ngram_size
        primes = engram_primes(n_layers, order, cfg.engram_n_heads, cfg.engram_vocab_size)
        offsets = [[sum(p[:i]) for i in range(len(p))] for p in primes]
        mults = [engram_multipliers(lid, order, max(cfg.engram_compressed_vocab_size, 1))
                 for lid in cfg.engram_layer_ids]
        device = self.primes.device
        self.primes = torch.tensor(primes, dtype=torch.long, device=device)
        self.offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.multipliers = torch.tensor(mults, dtype=torch.long, device=device)
        # compressed class per token; identity until a tokenizer provides the real map
        self.token_map = torch.arange(cfg.vocab_size, dtype=torch.long, device=device)

    @property
    def needs_token_map(self) -> bool:
        """False when the config asks for identity hashing (compressed vocabulary = model vocabulary, as in
        the random presets); a real checkpoint's classes come from its tokenizer."""
        return self.cfg.engram_compressed_vocab_size != self.cfg.vocab_size

    def set_token_map(self, token_map: list[int], n_classes: int) -> None:
        """Install the tokenizer's class map; ids past the tokenizer's length (a head padded beyond it) take
        the pad token's class. Refuses a class count that differs from the config's: every hash multiplier
        derives from it, so a mismatch would silently degrade the model."""
        cfg = self.cfg
        if n_classes != cfg.engram_compressed_vocab_size:
            raise EngramMapError(
                f"the tokenizer gives {n_classes} engram token classes but the config's "
                f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}: this tokenizer does not "
                f"belong to this checkpoint")
        if len(token_map) > cfg.vocab_size or cfg.engram_pad_token_id >= len(token_map):
            raise EngramMapError(f"the tokenizer has {len(token_map)} ids; the model has {cfg.vocab_size} and "
                                 f"engram_pad_token_id is {cfg.engram_pad_token_id}")
        pad_class = token_map[cfg.engram_pad_token_id]
        full = list(token_map) + [pad_class] * (cfg.vocab_size - len(token_map))
        self.token_map.copy_(torch.tensor(full, dtype=torch.long))

    def forward(self, ids: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
        """Row ids for the last ``S`` of ``ids`` [B, n-1+S] (history first; −1 = before the sequence);
        ``dead`` [B, n-1+S] marks image-span tokens. Returns [B, S, n_layers, (n-1)·heads]."""
        order = self.cfg.engram_max_ngram_size
        S = ids.shape[1] - (order - 1)
        z = self.token_map[ids.clamp(min=0)]
        blocked_tok = (ids < 0) | dead
        pad = self.token_map[self.cfg.engram_pad_token_id]
        heads = self.cfg.engram_n_heads
        out = []
        for li in range(self.primes.shape[0]):
            mult = self.multipliers[li]
            blocked = torch.zeros(ids.shape[0], S, dtype=torch.bool, device=ids.device)
            h = None
            ids_l = []
            for s in range(order):
                cur = order - 1 - s  # column offset of token t-s
                blocked = blocked | blocked_tok[:, cur:cur + S]
                v = torch.where(blocked, pad, z[:, cur:cur + S])
                term = v * mult[s]
                h = term if h is None else torch.bitwise_xor(h, term)
                if s >= 1:
                    p = self.primes[li, (s - 1) * heads:s * heads]
                    o = self.offsets[li, (s - 1) * heads:s * heads]
                    ids_l.append(torch.remainder(h[..., None], p) + o)
            out.append(torch.cat(ids_l, dim=-1))
        return torch.stack(out, dim=2)


class Engram(nn.Module):
    """``engram``: FP8 table rows → keys (one per stream) and a value; gated add to each stream
    (docs/architecture.md#engram-injection)."""

    def __init__(self, cfg: ModelConfig, rows: int):
        super().__init__()
        n, D, d = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
        lookups = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.n, self.dim, self.eps = n, D, cfg.rms_norm_eps
        self.embed = nn.Embedding(rows, d)
        self.wkv = blas.Linear(lookups * d, (n + 1) * D, bias=False)
        self.q_weight = nn.Parameter(torch.ones(n, D))
        self.k_weight = nn.Parameter(torch.ones(n, D))

    def forward(self, x: torch.Tensor, row_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B,S,n,D] streams, ``row_ids`` [B,S,lookups] → updated streams."""
        e = self.embed(row_ids).flatten(-2)
        kv = fp32(self.wkv(e)).unflatten(-1, (self.n + 1, self.dim))
        keys, value = kv[..., :self.n, :], kv[..., self.n, :]
        xf = fp32(x)
        r = torch.rsqrt(xf.square().mean(-1) + self.eps) * torch.rsqrt(keys.square().mean(-1) + self.eps)
        wprod = (fp32(self.q_weight) * fp32(self.k_weight))
        dot = (xf * wprod * keys).sum(-1) * r / self.dim ** 0.5
        # the reference's signed square root: copysign keeps +0's sign, so a zero dot gives sigmoid(+1e-3)
        g = torch.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))
        if dead is not None:
            g = g.masked_fill(dead[..., None], 0.0)
        return (xf + g[..., None] * value[..., None, :]).to(x.dtype)
