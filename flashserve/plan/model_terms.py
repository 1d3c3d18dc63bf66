"""The model-side inputs of the roofline: parameter groups, per-layer attention reads, drafter.

Every model family (DeepSeek-V3/R1 MLA, V4 CSA/HCA, V4.1 CSA2) is reduced to this one structure, so the
roofline never looks at a config. Sizes are in parameters or bytes; "per query" means per token row that
attends (a decode token, or one verification row under speculative decoding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAttention:
    """What one layer reads and computes when one query attends at context length ``ctx``.

    ``window``: raw rows of the most recent tokens (0 = none). ``ratio``: tokens per global entry (0 = the
    layer has no global branch). ``topk``: global entries selected per query (0 = attend every entry, as in
    MLA or V4's HCA). ``scan_ratio``/``scan_cap``: an indexer on this layer scores ctx/scan_ratio index rows
    (at most ``scan_cap``, 0 = no cap) before selecting.
    """

    window: int
    window_row_bytes: float
    ratio: int
    topk: int
    main_row_bytes: float
    heads: int
    qk_dim: int
    v_dim: int
    scan_ratio: int = 0
    scan_cap: int = 0
    index_row_bytes: float = 0.0
    index_flops_per_row: float = 0.0  # 2 × index heads × index head dim

    def keys(self, ctx: float) -> tuple[float, float]:
        """(window rows, global entries) one query attends to."""
        win = min(ctx, self.window) if self.window else 0.0
        if not self.ratio:
            return win, 0.0
        pool = ctx / self.ratio
        return win, (min(pool, self.topk) if self.topk else pool)

    def scanned(self, ctx: float) -> float:
        """Index rows the indexer scores (0 when the layer reuses another layer's selection)."""
        if not self.scan_ratio:
            return 0.0
        rows = ctx / self.scan_ratio
        return min(rows, self.scan_cap) if self.scan_cap else rows

    def row_bytes(self, ctx: float) -> float:
        """Cache bytes gathered for each query row: its window rows and, where a top-k is selected, its selected
        entries. Sparse kernels gather these per query token (each row has its own top-k and its own window), so
        the 1 + drafted verification rows of one sequence do not share them (bytes requested; an L2 hit on the
        overlap of neighbouring rows is not credited)."""
        win, glob = self.keys(ctx)
        return win * self.window_row_bytes + (glob * self.main_row_bytes if self.topk else 0.0)

    def shared_bytes(self, ctx: float) -> float:
        """Cache bytes read once per sequence per step whatever its number of query rows: the index rows the
        indexer scans (its MQA-logits kernel scores a sequence's next-n rows in one pass over them) and global
        entries every row attends to (no top-k: MLA, V4's HCA), read once by a dense kernel."""
        _, glob = self.keys(ctx)
        return (0.0 if self.topk else glob * self.main_row_bytes) + self.scanned(ctx) * self.index_row_bytes

    def read_bytes(self, ctx: float, rows: int = 1) -> float:
        """Cache bytes one sequence reads in a step with ``rows`` query rows (1 + drafted when verifying)."""
        return self.shared_bytes(ctx) + rows * self.row_bytes(ctx)

    def flops(self, ctx: float) -> float:
        """Attention-core FLOPs of one query: scores and weighted values over every key, plus indexer scoring."""
        win, glob = self.keys(ctx)
        return 2.0 * self.heads * (win + glob) * (self.qk_dim + self.v_dim) + self.scanned(ctx) * self.index_flops_per_row


@dataclass(frozen=True)
class DraftTerms:
    """A speculative drafter. ``parallel``: drafts its whole block in one pass (DSpark); otherwise one pass
    per drafted token (MTP). Params are per pass: ``dense_params`` always read, experts routed."""

    kind: str  # "mtp", "dspark" or "none"
    layers: int
    dense_params: int
    n_experts: int
    top_k: int
    expert_params: int
    parallel: bool
    block: int  # drafted tokens per step this drafter is built for
    attention: LayerAttention | None = None  # what one drafter layer reads (None: no attention)

    def passes(self, draft_tokens: int) -> int:
        """Sequential drafter forwards per step."""
        if draft_tokens <= 0 or self.kind == "none":
            return 0
        return 1 if self.parallel else draft_tokens

    def rows_per_pass(self, draft_tokens: int) -> int:
        """Token rows per sequence in one drafter forward."""
        return draft_tokens if self.parallel else 1


NO_DRAFT = DraftTerms(kind="none", layers=0, dense_params=0, n_experts=1, top_k=0, expert_params=0,
                      parallel=False, block=0)


@dataclass(frozen=True)
class ModelTerms:
    """One model, reduced to what the planner needs (see module docstring)."""

    name: str
    family: str  # deepseek_v3, deepseek_v4, deepseek_v41
    hidden_size: int
    n_layers: int  # layers a decode token passes
    n_moe_layers: int
    n_experts: int
    top_k: int
    expert_params: int
    dense_params_decode: int  # matmul weights per decode token other than routed experts (head included)
    dense_params_total: int  # every non-routed backbone weight held on GPU
    prefill_layers: int  # layers a prompt token passes (V4.1: the encoder only)
    prefill_moe_layers: int
    dense_params_prefill: int
    params_total: int  # backbone (no engram tables, drafter or vision)
    host_params: int  # tables kept in host memory (V4.1 engram)
    host_row_bytes_per_token: float  # host bytes gathered per decode token (engram rows)
    attention: tuple[LayerAttention, ...]  # one entry per decode layer
    prefill_attention: tuple[LayerAttention, ...]  # layers a prompt token attends through
    kv_bytes_per_token: float  # persistent global cache, grows with context
    state_bytes_per_sequence: float  # bounded per-sequence state (window rings, compressor state)
    kv_dtype: str
    draft: DraftTerms
    route_groups: int = 1  # expert groups of group-limited routing (1: none)
    route_topk_groups: int = 1  # groups a token may pick its experts from
    host_reads_per_token: float = 0.0  # separate rows gathered per decode token (engram lookups)
    head_params: int = 0  # of dense_params_decode: the LM head (0: not separated, as for V3)
    routing_skew: float = 0.0  # Zipf exponent of the experts' popularity (0: uniform routing; ROUTING_SKEW)
    embed_params: int = 0  # of dense_params_total: the token embeddings (0: not separated)
    notes: tuple[str, ...] = ()

    @property
    def params_active_decode(self) -> int:
        return self.dense_params_decode + self.n_moe_layers * self.top_k * self.expert_params

    @property
    def params_active_prefill(self) -> int:
        return self.dense_params_prefill + self.prefill_moe_layers * self.top_k * self.expert_params

    @property
    def routed_params_total(self) -> int:
        return self.n_moe_layers * self.n_experts * self.expert_params

    def kv_read_bytes(self, ctx: float, rows: int = 1) -> float:
        """Cache bytes one sequence reads per decode step across all layers, with ``rows`` query rows."""
        return sum(layer.read_bytes(ctx, rows) for layer in self.attention)

    def attention_flops(self, ctx: float, prefill: bool = False) -> float:
        """Attention-core FLOPs of one query row across its layers."""
        layers = self.prefill_attention if prefill else self.attention
        return sum(layer.flops(ctx) for layer in layers)

    def sequence_bytes(self, ctx: float) -> float:
        """HBM one sequence holds at context ``ctx``: global cache plus bounded state."""
        return self.kv_bytes_per_token * ctx + self.state_bytes_per_sequence


def expert_popularity(n_experts: int, top_k: int, skew: float = 0.0) -> list[float]:
    """Probability that one token selects each expert, the most used first (they sum to ``top_k``).

    ``skew`` is the exponent s of a Zipf law: the i-th most used expert is selected in proportion to i^-s
    (0: uniform, k/E each). A probability above 1 (an expert no token can miss) is capped and its excess spread
    over the others in proportion to theirs."""
    if skew == 0.0:
        return [top_k / n_experts] * n_experts
    w = [(i + 1) ** -skew for i in range(n_experts)]
    total = sum(w)
    q = [top_k * x / total for x in w]
    capped = [False] * n_experts
    while True:
        excess = sum(x - 1.0 for x in q if x > 1.0)
        if excess <= 1e-12:
            return q
        for i, x in enumerate(q):
            if x > 1.0:
                q[i], capped[i] = 1.0, True
        rest = sum(x for x, c in zip(q, capped) if not c)
        q = [x if c else x + excess * x / rest for x, c in zip(q, capped)]


def expected_distinct_experts(n_experts: int, top_k: int, tokens: float, skew: float = 0.0) -> float:
    """Expected experts touched by ``tokens`` tokens, each picking ``top_k`` of ``n_experts`` independently of
    the others: Σᵢ 1 − (1 − qᵢ)^B over the experts' selection probabilities qᵢ (:func:`expert_popularity`);
    uniform routing (skew 0) gives E·(1 − (1 − k/E)^B)."""
    if tokens <= 0 or top_k <= 0:
        return 0.0
    if skew == 0.0:
        return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)
    return sum(1.0 - (1.0 - q) ** tokens for q in expert_popularity(n_experts, top_k, skew))


def _touched(n_experts: int, top_k: int, skew: float, tokens: float) -> list[float]:
    """Probability that a step of ``tokens`` rows touches each expert, the most used first: 1 − (1 − qᵢ)^B."""
    return [1.0 - (1.0 - q) ** tokens for q in expert_popularity(n_experts, top_k, skew)]


def lfu_hit_rate(n_experts: int, top_k: int, cached: int, skew: float, tokens: float = 1) -> float:
    """Share of the experts a step of ``tokens`` rows touches that a cache of the ``cached`` most used experts of
    the layer holds (an LFU cache once its counts have settled, or a static set of the most used), as an engine's
    cache counts a step's hits (each distinct expert once): Σ over the cached of pᵢ / Σ pᵢ, pᵢ = 1 − (1 − qᵢ)^B
    (at one row, their share of the selections)."""
    if cached <= 0:
        return 0.0
    p = _touched(n_experts, top_k, skew, tokens)
    return min(1.0, sum(p[:cached]) / sum(p))


def lru_hit_rate(n_experts: int, top_k: int, cached: int, skew: float, tokens: float = 1) -> float:
    """Share of the experts a step of ``tokens`` rows touches that an LRU cache of ``cached`` experts of the layer
    holds, each step touching expert i with probability pᵢ = 1 − (1 − qᵢ)^B independently of the others (Che's
    approximation: an expert is cached if a step touched it within the last T steps, T set so that the expected
    number of such experts is the cache's size; the share weighted by pᵢ, as an engine's cache counts a step's
    hits). Without skew this is cached / experts, as for a static set."""
    if cached >= n_experts:
        return 1.0
    if cached <= 0:
        return 0.0
    p = _touched(n_experts, top_k, skew, tokens)

    def held(t: float) -> float:
        return sum(1.0 - math.exp(-x * t) for x in p)

    lo, hi = 0.0, 1.0
    while held(hi) < cached:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if held(mid) < cached else (lo, mid)
    t = (lo + hi) / 2.0
    return sum(x * (1.0 - math.exp(-x * t)) for x in p) / sum(p)
