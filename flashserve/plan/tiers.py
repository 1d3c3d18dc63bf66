"""Where a machine's routed experts live (device memory, host memory, disk) and what one decode step reads
from each tier.

Placement is per MoE layer, as the engines name it: ``resident`` experts of each layer in the memory of the
device that computes (each GPU of a discrete machine, shared among its GPUs as EP shares them; the unified
memory; the host memory of a machine without a GPU), ``host`` experts in host memory beside a discrete GPU,
the remaining ``disk`` experts read from the disk when a token selects them (memory-mapped checkpoint, no
cache credited). Attention, dense and shared weights, the drafter and the KV cache stay on the device.

Which experts a tier holds is not known for a static placement (``--expert-cache static``, the default): a
selected expert is in a tier with probability (experts of the layer in that tier) / (experts of the layer),
so the distinct experts a step touches split over the tiers in those proportions, however skewed the routing
(the routing's skew sets how many distinct experts a step touches: model_terms.expected_distinct_experts).
When the resident experts are an engine's cache of the experts tokens select (``--expert-cache lru``: ds4's
dynamic expert cache, flashserve's ``--weight-memory``; ``lfu``: flashserve's ``--expert-cache-policy lfu``) the
used experts stay in it: its hit rate follows from the routing's skew (model_terms.lru_hit_rate, lfu_hit_rate). An engine's cache measures better still: ``--expert-hit-rate H``
(flashserve's ``flashserve_expert_cache_{hits,misses}_total``, or what another engine reports) replaces both
for the resident tier, and the misses split over host memory and disk in proportion to the experts each holds.

Host-memory experts are computed either by CPU expert kernels reading host memory (``cpu``, the default, as
ktransformers and llama.cpp ``-ot``/``--n-cpu-moe`` do) or moved over the GPU link and computed on the GPU
(``gpu``). An expert read from disk lands in memory first and is then computed as one held there: its bytes
count once in the disk tier and once more in the tier that computes it (host memory under ``cpu``, the link
under ``gpu``, the device memory on a unified or GPU-less machine).

The tiers' times are summed by default: a single decode stream waits for its experts layer by layer, as
llama.cpp's ``--n-cpu-moe`` and a memory-mapped checkpoint do. ``--tier-overlap overlapped`` takes the slowest
tier instead, for engines that run the tiers at once (ktransformers computes the CPU experts while the GPU runs
attention and the shared expert of the next micro-batch; SGLang's offload prefetches the next layer's experts;
ds4 stages SSD reads ahead): the step is then as long as its slowest tier.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import PlanError
from .model_terms import lfu_hit_rate, lru_hit_rate

HOST_COMPUTE = ("cpu", "gpu")
DEFAULT_HOST_COMPUTE = "cpu"
TIER_OVERLAP = ("summed", "overlapped")
EXPERT_CACHE = ("static", "lru", "lfu")  # the resident experts: a fixed set, or a cache of the selected ones
ENGRAM_TABLES = ("memory", "disk")  # where V4.1's engram tables live on a machine
DEFAULT_TIER_OVERLAP = "summed"


@dataclass(frozen=True)
class ExpertPlacement:
    """Routed experts per MoE layer in each tier (``resident + host + disk`` = the layer's experts)."""

    resident: int
    host: int
    disk: int
    host_compute: str = DEFAULT_HOST_COMPUTE  # "cpu": CPU kernels at host bandwidth; "gpu": over the link
    hit_rate: float | None = None  # fraction of selected experts found resident (None: the tier's share)
    hit_source: str = "measured"  # where hit_rate comes from: "measured", "lru" or "lfu" (the routing's skew)
    overlap: str = DEFAULT_TIER_OVERLAP  # "summed": tiers one after another; "overlapped": the slowest tier
    prefill_chunk: int = 512  # prompt tokens per prefill step (each reads or moves the experts it touches once)

    @property
    def n_experts(self) -> int:
        return self.resident + self.host + self.disk

    def fraction(self, tier: str) -> float:
        """Probability that a selected expert sits in ``tier``: the tier's share of the layer's experts under
        uniform routing, or the measured hit rate for the resident tier (the misses split over host memory
        and disk by their experts)."""
        if self.hit_rate is None:
            return getattr(self, tier) / self.n_experts
        if tier == "resident":
            return self.hit_rate
        return (1.0 - self.hit_rate) * getattr(self, tier) / (self.host + self.disk)

    def routing(self) -> str:
        if self.hit_rate is None:
            return "static placement: hit fraction = experts in the tier / experts per layer"
        if self.hit_source in ("lru", "lfu"):
            return (f"{self.hit_source.upper()} cache of {self.resident} experts per layer: hit rate "
                    f"{self.hit_rate:.3g} from the routing's skew; misses split by experts per tier")
        return f"measured hit rate {self.hit_rate:.3g} of the resident tier; misses split by experts per tier"

    def as_dict(self) -> dict[str, object]:
        return {"resident_experts_per_layer": self.resident, "host_experts_per_layer": self.host,
                "disk_experts_per_layer": self.disk, "experts_per_layer": self.n_experts,
                "host_expert_compute": self.host_compute, "routing": self.routing(),
                "expert_hit_rate": self.hit_rate, "expert_hit_rate_from": self.hit_source if self.hit_rate is not None
                else None, "tiers_combined": self.overlap,
                "prefill_chunk": self.prefill_chunk}


def resolve_placement(resident: int | None, host: int | None, compute: str | None, n_experts: int,
                      machine_kind: str | None, machine_name: str, hit_rate: float | None = None,
                      overlap: str | None = None, prefill_chunk: int = 512, cache: str | None = None,
                      top_k: int = 1, skew: float = 0.0, tokens: float = 1) -> ExpertPlacement | None:
    """The placement the flags ask for (None: every expert on the device, as without the flags), with the
    measured hit rate, or under ``cache="lru"``/``"lfu"`` the hit rate of such a cache of the resident experts for
    a router choosing ``top_k`` at popularity ``skew``, over steps of ``tokens`` rows, and the tiers' overlap when
    given.

    On a discrete-GPU machine ``--resident-experts N`` alone puts the rest in host memory, ``--host-experts M``
    alone keeps the rest on the GPU, both put what is left on disk. On a unified or GPU-less machine there is
    no separate host memory: the experts not resident are on disk."""
    if resident is None and host is None:
        for flag, value in (("--host-expert-compute", compute), ("--expert-hit-rate", hit_rate),
                            ("--tier-overlap", overlap), ("--expert-cache", cache)):
            if value is not None:
                raise PlanError(flag, "needs --resident-experts or --host-experts (with neither, every expert is "
                                "on the device)")
        return None
    placement = _counts(resident, host, compute, n_experts, machine_kind, machine_name)
    for flag, given in (("--expert-hit-rate", hit_rate), ("--expert-cache", cache in ("lru", "lfu") or None)):
        if given is not None and placement.host + placement.disk == 0:
            raise PlanError(flag, f"every one of the {n_experts} experts per layer is resident: nothing is missed "
                            "(leave it out)")
    source = "measured"
    if cache in ("lru", "lfu"):
        if hit_rate is not None:
            raise PlanError("--expert-cache", f"{cache} derives the hit rate that --expert-hit-rate gives: pass one "
                            "of them")
        rate = lru_hit_rate if cache == "lru" else lfu_hit_rate
        hit_rate, source = rate(n_experts, top_k, placement.resident, skew, tokens), cache
    return replace(placement, hit_rate=hit_rate, hit_source=source, overlap=overlap or DEFAULT_TIER_OVERLAP,
                   prefill_chunk=prefill_chunk)


def _counts(resident: int | None, host: int | None, compute: str | None, n_experts: int,
            machine_kind: str | None, machine_name: str) -> ExpertPlacement:
    flag = "--resident-experts" if resident is not None else "--host-experts"
    if machine_kind is None:
        raise PlanError(flag, f"places experts on a machine (a machine preset or a JSON file given to --hardware); "
                        f"on the datacenter preset {machine_name} every expert is in GPU memory")
    for name, value in (("--resident-experts", resident), ("--host-experts", host)):
        if value is not None and value > n_experts:
            raise PlanError(name, f"{value} exceeds the {n_experts} routed experts of each layer")
    if machine_kind != "gpu":
        if host is not None:
            raise PlanError("--host-experts", f"{machine_name} is a {machine_kind} machine: its host memory is the "
                            "memory that computes; use --resident-experts N (the other experts are read from disk)")
        if compute is not None:
            raise PlanError("--host-expert-compute", f"{machine_name} has no discrete GPU: there is no host tier "
                            "beside the device")
        return ExpertPlacement(resident=resident or 0, host=0, disk=n_experts - (resident or 0))
    if resident is not None and host is not None:
        if resident + host > n_experts:
            raise PlanError("--host-experts", f"--resident-experts {resident} + --host-experts {host} exceed the "
                            f"{n_experts} routed experts of each layer")
        res, hst = resident, host
    elif resident is not None:
        res, hst = resident, n_experts - resident
    else:
        assert host is not None
        res, hst = n_experts - host, host
    return ExpertPlacement(resident=res, host=hst, disk=n_experts - res - hst,
                           host_compute=compute or DEFAULT_HOST_COMPUTE)
