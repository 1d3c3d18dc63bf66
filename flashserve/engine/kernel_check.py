"""The C++ kernels checked against torch's products at engine start-up, on this CPU and this model's weights.

The kernels (:mod:`flashserve.model.cpu_kernels`) are built for the CPU they run on (``-march=native``) and tested on
the CPU kinds the project's machines come in; a CPU no test ran on, a compiler that builds them otherwise, or a
build cache that holds something else could make one give other products than torch's. :func:`check_kernels` runs
each weight kernel the model calls on a few rows of one weight of each kind the model holds (block-FP8 codes as
stored and in column panels, alone and grouped; MXFP4 experts stacked and mapped, exact and on 8-bit activations;
int8 experts where their kernel is used; float32, bfloat16 and stream panels), at the row counts the engine passes
them, and compares the results with the weights decoded by torch and multiplied in float64. A kernel that
disagrees (or raises) is refused for this process (:func:`cpu_kernels.refuse`): the layers that would call it run
torch's code, slower but right (mapped experts then decode eagerly), and the engine logs an error naming the
kernel, the weight and the difference. The check runs once a model, before the engine decides how its steps run;
it costs milliseconds on the small models and about half a second per FP8 layer kind at real size (each weight is
cut to a few rows: two row blocks of an FP8 weight)."""

from __future__ import annotations

import logging

import torch

from ..model import cpu_kernels, packed

log = logging.getLogger("flashserve.engine")

# a kernel's result r against the float64 product p agrees when |r - p| <= TOLERANCE * (|x| @ |W|.T) + 1e-30 for
# every output: float32 sums of K products are off by about sqrt(K) 2^-24 of that bound (K = 16384: 1e-5); a
# wrong product, a lost block or a misread scale is off by the order of the bound itself
TOLERANCE = 1e-4
ROW_COUNTS = (1, 2, 3, 5, 8, 12, 13, 16, 17, 33, packed.FP8_KERNEL_ROWS)  # each kernel's row paths (passes of 4, 8, 12)
OUT_ROWS = 64  # output rows of a float weight checked (an FP8 weight: two row blocks; experts: whole)


class _Reference:
    """``x @ w.T`` in float64 for the rows of ``x``, and each output's tolerance (see :data:`TOLERANCE`)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, tolerance: float = TOLERANCE):
        self.want = x.double() @ w.double().t()
        self.bound = tolerance * (x.double().abs() @ w.double().abs().t()) + 1e-30

    def disagreement(self, got: torch.Tensor, rows: int | slice, cols: slice = slice(None)) -> str | None:
        """None where ``got`` is the product's ``rows`` (the first ``rows``, or a slice) and ``cols`` within the
        tolerance, else what differs."""
        rows = slice(0, rows) if isinstance(rows, int) else rows
        want, bound = self.want[rows, cols], self.bound[rows, cols]
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
        err = (got.double() - want).abs()
        if bool((err <= bound).all()):
            return None
        r, c = divmod(int((err / bound).flatten().argmax()), want.shape[1])
        return (f"{int((err > bound).sum())} of {want.numel()} outputs wrong with {want.shape[0]} row(s) of x (row "
                f"{r}, column {c}: {float(got[r, c]):.6g} instead of {float(want[r, c]):.6g})")


def _attempt(run) -> tuple[torch.Tensor | None, str | None]:
    """``run()``, or None and the exception it raised (a kernel that raises is refused too)."""
    try:
        return run(), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def _fp8_layers(model) -> list[tuple[str, packed.PackedLinear]]:
    """One block-FP8 CPU layer of each kind the kernels treat apart: input width, block shape, and whether it has
    two row blocks to check as a grouped view of two (the grouped output projection's call)."""
    kinds = {}
    for name, m in model.named_modules():
        if (isinstance(m, packed.PackedLinear) and m.packed.fmt.name == packed.FP8 and m.packed.qweight.dim() == 2
                and m.packed.qweight.device.type == "cpu" and m.packed.fmt.col_block % 8 == 0):
            (N, K), f = m.packed.shape, m.packed.fmt
            kinds.setdefault((K, f.row_block, f.col_block, N >= 2 * f.row_block), (name, m))
    return list(kinds.values())


def _check_fp8(model, gen) -> dict[str, str]:
    out = {}
    for name, layer in _fp8_layers(model):
        if not cpu_kernels.fp8_pairs_available():
            break
        for kernel, why in _check_fp8_layer(name, layer, gen).items():
            out.setdefault(kernel, why)
    return out


def _check_fp8_layer(name: str, layer: packed.PackedLinear, gen: torch.Generator) -> dict[str, str]:
    p = layer.packed
    rb, cb = p.fmt.row_block, p.fmt.col_block
    N, K = p.shape
    n = min(N, 2 * rb * max(1, -(-32 // (2 * rb))))  # two row blocks where there are (a grouped view of two)
    q, s = p.qweight[:n], p.scale[:-(-n // rb)]
    w = packed.decode(q, s, p.fmt, K, torch.float32)
    panels = (cpu_kernels.pack_fp8_panels(q[None]) if rb % cpu_kernels.LANES == 0
              and cpu_kernels.fp8_panels_available() else None)
    half = n // 2 if n % (2 * rb) == 0 else 0  # two groups of whole row blocks
    x_all = torch.randn(max(ROW_COUNTS), K, generator=gen)
    ref = _Reference(x_all, w)
    where = f"{name} ({N}x{K}, blocks {rb}x{cb})"
    out = {}
    for rows in ROW_COUNTS:
        x, one = x_all[:rows], torch.zeros(rows, dtype=torch.long)
        runs = {"fp8_pairs": lambda: cpu_kernels.fp8_pairs(x, one, q[None], s[None], rb, cb)}
        if panels is not None:
            runs["fp8_panels"] = lambda: cpu_kernels.fp8_panels(x, one, panels, s[None], n, rb, cb)
        for kernel, run in runs.items():
            got, why = _attempt(run)
            why = why or ref.disagreement(got, rows)
            if why:
                out.setdefault(kernel, f"{where}: {why}")
        if not half:
            continue
        # the grouped view: each row twice, row 2t against group 0 (w's first half), row 2t + 1 against group 1
        groups, xg, sg = torch.arange(2).repeat(rows), x.repeat_interleave(2, 0), s.view(2, -1, s.shape[-1])
        runs = {"fp8_pairs": lambda: cpu_kernels.fp8_pairs(xg, groups, q.view(2, half, K), sg, rb, cb)}
        if panels is not None:
            runs["fp8_panels"] = lambda: cpu_kernels.fp8_panels(xg, groups, panels.view(2, -1, K, cpu_kernels.LANES),
                                                                sg, half, rb, cb)
        for kernel, run in runs.items():
            got, why = _attempt(run)
            why = why or (ref.disagreement(got[0::2], rows, slice(0, half))
                          or ref.disagreement(got[1::2], rows, slice(half, n)))
            if why:
                out.setdefault(kernel, f"{where} grouped in 2: {why}")
    return out


def _expert_matrices(m) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """Each projection's (codes, scales) of the first two experts of ``m`` (stacked or mapped), None if not held."""
    from ..model.mapped_experts import MappedExperts

    if isinstance(m, MappedExperts):
        held = {n: m.matrices[n][:2] for n in ("w1", "w2", "w3")}
        return None if any(h is None for hs in held.values() for h in hs) else held
    return {n: [(getattr(m, f"{n}_packed").qweight[e], getattr(m, f"{n}_packed").scale[e])
                for e in range(min(2, m.n_experts))] for n in ("w1", "w2", "w3")}


def _check_experts(model, gen) -> dict[str, str]:
    """The first layer of MXFP4 experts (stacked or mapped) and of int8 experts, where the model's experts call
    their kernel: the gate's and the up projection's products in one call with each token's row read for two
    pairs, and the down projection's with a row a pair, routed at random between two experts, as exact products
    and (MXFP4) on activations rounded to 8 bits (``w4a8``: within 2% of the products' sizes)."""
    from ..model.mapped_experts import MappedExperts

    out: dict[str, str] = {}
    for name, m in model.named_modules():
        mapped = isinstance(m, MappedExperts)
        if not (mapped or isinstance(m, packed.PackedExperts)):
            continue
        fmt = m.fmt.name if mapped else m.w1_packed.fmt.name
        kernel = {packed.MXFP4: "mxfp4_pairs", packed.INT8: "int8_pairs"}.get(fmt)
        if kernel is None or kernel in out or (kernel, mapped) in out.get("_seen", ()):
            continue
        if fmt == packed.MXFP4 and not (cpu_kernels.mxfp4_pairs_available() and m.dim % 32 == 0
                                        and m.inter % 32 == 0):
            continue
        if fmt == packed.INT8 and not cpu_kernels.int8_pairs_preferred():
            continue
        mats = _expert_matrices(m)
        if mats is None or mats["w1"][0][0].device.type != "cpu":
            continue
        out.setdefault("_seen", set()).add((kernel, mapped))
        why = _check_expert_layer(m, mats, mapped, fmt, gen)
        if why:
            out[kernel] = f"{name} ({'mapped ' if mapped else ''}{fmt} experts of {m.inter}x{m.dim}): {why}"
    out.pop("_seen", None)
    return out


def _check_expert_layer(m, mats, mapped: bool, fmt: str, gen) -> str | None:
    E = len(mats["w1"])
    f = m.fmt if mapped else m.w1_packed.fmt
    dec = {n: [packed.decode(q, s, f, q.shape[-1] * (2 if fmt == packed.MXFP4 else 1), torch.float32)
               for q, s in mats[n]] for n in mats}
    stack = {n: tuple(torch.stack([t[i] for t in mats[n]]) for i in range(2)) for n in mats}
    x_all = torch.randn(max(ROW_COUNTS), m.dim, generator=gen)
    h_all = torch.randn(2 * max(ROW_COUNTS), m.inter, generator=gen)
    ids_all = torch.randint(0, E, (max(ROW_COUNTS), 2), generator=gen)
    for a8 in ((False, True) if fmt == packed.MXFP4 else (False,)):
        tol = 0.02 if a8 else TOLERANCE
        refs = {n: [_Reference(x_all if n != "w2" else h_all, w, tol) for w in dec[n]] for n in dec}
        for rows in ROW_COUNTS:
            x, ids, h = x_all[:rows], ids_all[:rows], h_all[:2 * rows]
            flat = ids.flatten()
            if mapped:
                gate_up, why = _attempt(lambda: cpu_kernels.mxfp4_mapped(x, flat, m.gate_up_table, m.inter, a8))
                down, why2 = _attempt(lambda: cpu_kernels.mxfp4_mapped(h, flat, m.down_table, m.dim, a8))
                down = None if down is None else down[0]
            elif fmt == packed.MXFP4:
                gate_up, why = _attempt(lambda: cpu_kernels.mxfp4_pairs_eager(x, ids, *stack["w1"], up=stack["w3"],
                                                                             a8=a8))
                down, why2 = _attempt(lambda: cpu_kernels.mxfp4_pairs_eager(h, flat, *stack["w2"], a8=a8))
            else:
                gate_up, why = _attempt(lambda: cpu_kernels.int8_pairs_eager(x, ids, *stack["w1"], up=stack["w3"]))
                down, why2 = _attempt(lambda: cpu_kernels.int8_pairs_eager(h, flat, *stack["w2"]))
            why = why or why2
            for p in range(2 * rows):  # pair p: token p // 2's row (gate, up), row p of h (down)
                if why:
                    break
                e, t = int(flat[p]), p // 2
                why = (refs["w1"][e].disagreement(gate_up[0][p:p + 1], slice(t, t + 1))
                       or refs["w3"][e].disagreement(gate_up[1][p:p + 1], slice(t, t + 1))
                       or refs["w2"][e].disagreement(down[p:p + 1], slice(p, p + 1)))
            if why:
                return f"{'on 8-bit activations, ' if a8 else ''}{why}"
    return None


def _check_dense_rows(model, gen) -> dict[str, str]:
    """A float weight of the model (its first rows) in each panel layout dense_rows reads."""
    if not cpu_kernels.dense_rows_available():
        return {}
    w = next((t for t in model.parameters() if t.dim() == 2 and t.is_floating_point() and t.device.type == "cpu"
              and min(t.shape) >= 16), None)
    if w is None:
        return {}
    w = w.detach()[:OUT_ROWS].float()
    wb = w.to(torch.bfloat16).float()
    n, K = w.shape
    x_all = torch.randn(17, K, generator=gen)
    ref, ref_b = _Reference(x_all, w), _Reference(x_all, wb)
    layouts = {"float32 panels": (cpu_kernels.pack_panels(w), ref),
               "bfloat16 panels": (cpu_kernels.pack_panels(wb, torch.bfloat16), ref_b),
               "stream panels": (cpu_kernels.pack_stream_panels(w), ref)}
    for rows in (1, 3, 8, 16, 17):
        for what, (panels, ref) in layouts.items():
            got, why = _attempt(lambda: cpu_kernels.dense_rows(x_all[:rows], panels, n))
            why = why or ref.disagreement(got, rows)
            if why:
                return {"dense_rows": f"{what} of a {n}x{K} weight: {why}"}
    return {}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        import platform

        return platform.processor() or "unknown"


def check_kernels(model) -> dict[str, str]:
    """Check the weight kernels ``model`` can call against torch's products (see the module's text); refuse each
    one that disagrees, log it as an error, and return kernel -> what disagreed (empty where all agree, or where
    the kernels are not built)."""
    if cpu_kernels.build() is None:
        return {}
    done = getattr(model, "_kernel_check", None)
    if done is not None:  # checked once a model (the engine checks before the plan, which asks again)
        return dict(done)
    gen = torch.Generator().manual_seed(0)
    failed: dict[str, str] = {}
    with torch.no_grad():
        for check in (_check_fp8, _check_experts, _check_dense_rows):
            failed.update(check(model, gen))
    if "fp8_pairs" in failed:  # the panels' layers fall back to the codes as stored, which fp8_pairs reads
        failed.setdefault("fp8_panels", "refused with fp8_pairs")
    for kernel, why in failed.items():
        cpu_kernels.refuse(kernel, why)
        log.error("C++ kernel %s failed its check against torch's products on this CPU (%s, %s): %s. The layers "
                  "that would call it run without it (slower, not wrong); please report this with the CPU's model.",
                  kernel, torch.backends.cpu.get_cpu_capability(), _cpu_model(), why)
    model._kernel_check = dict(failed)
    return failed
