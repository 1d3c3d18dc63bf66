"""Expert-parallel dispatch and combine bytes of one prompt token, per link.

Prefill moves tokens with DeepEP's normal (high-throughput) kernels: a token crosses the scale-out network at
most once per remote node that holds one of its experts, then is forwarded to the expert's GPU over the
scale-up link (NVLink); DeepSeek-V3's node-limited routing caps the nodes a token reaches (it picks
``topk_group`` of ``n_group`` expert groups). Sources: DeepSeek-V3 technical report (arXiv 2412.19437,
§3.2.2: at most 4 nodes per token, IB then NVLink forwarding); DeepEP README (normal kernels forward between
the NVLink and RDMA domains). Decode's low-latency kernels send each (token, expert) pair directly and are
modelled in :mod:`flashserve.plan.roofline`.
"""

from __future__ import annotations

import math

from .model_terms import ModelTerms

DISPATCH_BYTES = 1.0 + 4 / 128  # FP8 activations with one fp32 scale per 128 (DeepEP dispatch)
COMBINE_BYTES = 2.0  # bf16 combine


def node_touch_probability(m: ModelTerms, nodes: int) -> float:
    """Chance that one token's experts include one on a given node, experts spread evenly over ``nodes``.

    With group-limited routing and whole groups per node: 1 − C(G − G/n, g)/C(G, g) for ``g`` of ``G``
    groups; otherwise 1 − C(E − E/n, k)/C(E, k) for ``k`` of ``E`` experts.
    """
    if nodes <= 1:
        return 1.0
    groups, picked = m.route_groups, m.route_topk_groups
    if groups > 1 and groups % nodes == 0:
        return 1.0 - math.comb(groups - groups // nodes, picked) / math.comb(groups, picked)
    per_node = m.n_experts // nodes
    return 1.0 - math.comb(m.n_experts - per_node, m.top_k) / math.comb(m.n_experts, m.top_k)


def prefill_link_bytes(m: ModelTerms, ep: int, domain: int) -> tuple[float, float]:
    """(scale-out, scale-up) bytes one prompt token sends and receives back over all MoE layers."""
    per_copy = m.hidden_size * (DISPATCH_BYTES + COMBINE_BYTES)
    if ep <= domain:
        return 0.0, m.prefill_moe_layers * m.top_k * (1.0 - 1.0 / ep) * per_copy
    nodes = math.ceil(ep / domain)
    remote_nodes = (nodes - 1) * node_touch_probability(m, nodes)
    scale_out = m.prefill_moe_layers * remote_nodes * per_copy
    scale_up = m.prefill_moe_layers * m.top_k * (1.0 - 1.0 / domain) * per_copy
    return scale_out, scale_up
