"""Products on the CPU: inductor's own reduction kernels and panel kernels in a compiled step, OpenBLAS eagerly.

At batch 1 a decode step is mostly matrix-vector products, and at a few rows small matrix products; torch's
statically linked MKL runs the first well below the memory bandwidth and repacks the weight on every call for
the second. So (docs/engine-speed.md#products-on-the-cpu):

* **Compiled, one row** (:func:`linear` in a compiled CPU step, :mod:`.modes`): the product is written as a broadcast multiply summed over the
  inputs (:func:`reduce_linear`), which inductor turns into one vectorised reduction kernel per product, called
  from the step's C++ with no dispatch; an int8 weight's conversion and an expert's gather are fused into its
  read (about 3x MKL's ``mm`` over the peers checkpoint's one-row products).
* **Eager, one row** (:func:`takes`): numpy's OpenBLAS for one float32 row with gradients off (about 2x MKL).
* **Small batched products** (:func:`einsum`: attention scores and values, the indexer, the hyper-connection
  mixing) are broadcast sums in a compiled CPU step too, fused into inductor's kernels instead of MKL calls.
* **Several rows of a compiled CPU step** over a float32 weight go through a copy of it in column panels made
  at start-up (:func:`make_panels`) and :func:`flashserve.model.cpu_kernels.dense_rows`, 2-4x MKL's ``mm`` on a
  decode batch's shapes.

Everything else (eager steps of several rows, other dtypes, training, CUDA) stays torch's. The paths sum in
different orders, so a prompt's forward and the decode step's agree to float32 rounding (about 1e-7 relative
per product), not bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels, modes
from .modes import COMPILED, COMPILED_CPU


def _numpy_uses_openblas() -> bool:
    """Whether numpy's BLAS is OpenBLAS (as numpy's wheels ship it), as threadpoolctl reports it."""
    from threadpoolctl import threadpool_info

    np.ones((2, 2)) @ np.ones((2, 2))  # numpy's BLAS is loaded before asking
    return any(i.get("user_api") == "blas" and i.get("internal_api") == "openblas"
               and "numpy" in str(i.get("filepath", "")) for i in threadpool_info())


OPENBLAS = _numpy_uses_openblas()  # read once at import, not while a step is traced

# More than one row and OpenBLAS's lead over torch.mm is gone or small (it runs a general GEMM).
MAX_ROWS = 1
# A weight this large streams from memory, which OpenBLAS's one thread (limit_threads) cannot saturate: torch's
# product on every thread instead. V4.1-Flash's float32 head (662M values) on a 1-layer slice, same run: batch 1
# 3.47 -> 5.06 tok/s. The peers checkpoint's head (16M) keeps OpenBLAS.
OPENBLAS_MAX_VALUES = 64 << 20


def limit_threads() -> None:
    """Keep OpenBLAS at one thread, process-wide: with torch's second thread spinning between its parallel
    regions, a second OpenBLAS thread fights it for the core (a compiled batch-1 step ran 3x slower on 2
    cores), and a single-row product gains little from it anyway."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``F.linear(x, w)`` goes through OpenBLAS: up to :data:`MAX_ROWS` float32 CPU rows, gradients
    off, a weight of at most :data:`OPENBLAS_MAX_VALUES`."""
    return (OPENBLAS and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and x.device.type == "cpu"
            and x.dtype == torch.float32 and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and w.numel() <= OPENBLAS_MAX_VALUES and not torch.is_grad_enabled())


def _mm_np(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` [M, N] by numpy's BLAS (any strides)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    np.matmul(x.detach().numpy(), w.detach().numpy().T, out=out.numpy())
    return out


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` holds one row of its last dimension."""
    return x.numel() == x.shape[-1]


def materialized(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself (an identity view), which a compiled graph stores as a buffer of its own before the reduction
    reading it. Otherwise inductor inlines a cheap producer into the reduction's inner loop and recomputes it for
    every output row: an RMSNorm in front of a product (a square root and a division per element per row) made
    the LM head's int8 product 3-7x slower. ``as_strided`` is the view inductor can only make of a stored buffer.
    Non-contiguous ``x`` is left as it is (its stored layout could differ from the strides traced)."""
    if not x.is_contiguous():
        return x
    return x.as_strided(x.shape, x.stride())


def shared_operand(x: torch.Tensor, rows) -> torch.Tensor:
    """``x`` stored once (:func:`materialized`) in a compiled CPU step of several rows, an operand that several
    products read: attention queries after RoPE, keys gathered from the cache's pages and unpacked. Fused, inductor
    recomputed such an operand inside each product's inner loop, once per head and per key or output column (the
    page lookups, the FP8 unpacking, the sines and cosines): at 16 rows three attention kernels took a fifth of
    the peers checkpoint's step. ``rows``: the forward's rows (batch x rows each); a one-row step keeps the
    fused form, which was as fast there."""
    return stored_operand(x) if rows > 1 else x


@modes.per_mode
def stored_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` stored once (:func:`materialized`) in a compiled CPU step, whatever its rows: an operand as long as the
    context, which a product would otherwise recompute per head (the indexer's keys, see
    :meth:`flashserve.model.attention.Indexer.scores`). ``x`` itself in other modes."""
    return x


@stored_operand.variant(COMPILED_CPU)
def _stored_operand_compiled_on_cpu(x: torch.Tensor) -> torch.Tensor:
    return materialized(x.contiguous())


def reduce_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [..., N, K].T`` [..., N] written as a broadcast product summed over ``K``; an int8
    ``w`` is converted as it is read. Compiled, inductor makes it one vectorised reduction kernel that streams
    ``w`` once (its own GEMV, called from the step's C++ with no dispatch), with an int8 conversion or an
    expert gather fused into the read. Eager it would materialise the product: use it inside compiled steps."""
    x = materialized(x)
    if w.dim() == 2 and w.stride(0) == 1 and w.shape[0] > 1:  # column-major (weight_layout): sum over rows
        return (x.unsqueeze(-1) * w.t().to(x.dtype)).sum(-2)
    return (x.unsqueeze(-2) * w.to(x.dtype)).sum(-1)


def _aligned(t: torch.Tensor, labels: str, order: list[str]) -> torch.Tensor:
    """``t`` (dims named by ``labels``) permuted to ``order`` with size-1 dims for the labels it lacks."""
    present = [c for c in order if c in labels]
    t = t.permute([labels.index(c) for c in present])
    return t.reshape([t.shape[present.index(c)] if c in labels else 1 for c in order])


@modes.per_mode
def einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(eq, a, b)`` for two operands (no label repeated within one). In a compiled CPU step a
    product of fewer than :data:`FUSED_EINSUM_MACS` multiply-adds is written as a broadcast product summed over the
    contracted labels, which inductor fuses into its kernels: as ``bmm`` each was an external MKL call with a
    parallel region of its own (45 a batch-1 step of the peers checkpoint, about 4 us each, for products of a
    few KB: attention scores and values, the indexer, the hyper-connection mixing). Larger ones are one ``bmm``
    (MKL's, :func:`_bmm_einsum`): inductor's reduction loops make a dot product per output element, and the
    V4-Flash slice's attention at 16 rows (64 heads of 512 over about 200 keys) took 27 ms of its 45 ms layer in
    one such kernel."""
    return torch.einsum(eq, a, b)


# a compiled CPU step's einsum (without an ellipsis: the hyper-connection mixing stays fused) of at least this many
# multiply-adds calls MKL's bmm (:func:`einsum`), counted with each size that varies at the least it can be (a batch
# marked dynamic: 2) so that the choice holds for every size the graph serves and adds no guard. The V4-Flash
# slice's attention at several rows makes 64 heads x 512 x 128 window keys x 2 rows (2^23) and 64 x 512 x 2 rows
# x 2 selected entries (2^17); the peers checkpoint's largest is 8 x 64 x 32 window keys x 2 rows (2^15), the
# tiny presets' 4 x 64 x 16 x 2 rows x 8 verified rows (2^16).
FUSED_EINSUM_MACS = 1 << 17


def _label_sizes(a: torch.Tensor, la: str, b: torch.Tensor, lb: str) -> dict[str, int]:
    """Each label's size in the operands that have it."""
    sizes: dict[str, int] = {}
    for t, lab in ((a, la), (b, lb)):
        for c, n in zip(lab, t.shape):
            sizes.setdefault(c, n)
    return sizes


def _product(sizes: list) -> int:
    """The product of ``sizes`` as a plain loop: dynamo traces it (math.prod over a dict's values broke the graph)."""
    n = 1
    for size in sizes:
        n = n * size
    return n


def _large(sizes: dict[str, int]) -> bool:
    """Whether the product of every label's size is at least :data:`FUSED_EINSUM_MACS` for every size a varying
    one can take (``statically_known_true``: decided from the sizes' ranges, no guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(_product([sizes[c] for c in sizes]) >= FUSED_EINSUM_MACS)


def _bmm_einsum(la: str, a: torch.Tensor, lb: str, b: torch.Tensor, out: str, size: dict[str, int]) -> torch.Tensor:
    """``torch.einsum(f"{la},{lb}->{out}", a, b)`` as one ``bmm`` (``size``: :func:`_label_sizes`): labels in both
    operands and the output batch it, those in both operands only are summed, the rest are the rows of ``a`` and
    the columns of ``b``: permutes and reshapes to the operands' own sizes around it, so one traced graph serves
    every batch size (tests/model/test_blas.py)."""
    batch = [c for c in out if c in la and c in lb]
    summed = [c for c in la if c in lb and c not in out]
    rows, cols = [c for c in la if c not in lb], [c for c in lb if c not in la]

    def flat(t: torch.Tensor, lab: str, groups: list[list[str]]) -> torch.Tensor:
        t = t.permute([lab.index(c) for g in groups for c in g])
        return t.reshape([_product([size[c] for c in g]) for g in groups])

    y = torch.bmm(flat(a, la, [batch, rows, summed]), flat(b, lb, [batch, summed, cols]))
    order = batch + rows + cols
    y = y.view([size[c] for c in order])
    return y.permute([order.index(c) for c in out])


@einsum.variant(COMPILED_CPU)
def _einsum_compiled_on_cpu(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ins, out = eq.replace(" ", "").split("->")
    la, lb = ins.split(",")
    if "..." not in eq:
        sizes = _label_sizes(a, la, b, lb)
        if _large(sizes):
            return _bmm_einsum(la, a, lb, b, out, sizes)
    else:  # the ellipsis as capital labels, aligned from the right as broadcasting aligns them
        na, nb = (t.dim() - len(lab) + 3 if "..." in lab else 0 for t, lab in ((a, la), (b, lb)))
        caps = "ABCDEFGHIJ"[10 - max(na, nb):]
        la, lb = la.replace("...", caps[len(caps) - na:]), lb.replace("...", caps[len(caps) - nb:])
        out = out.replace("...", caps)
    summed = [c for c in dict.fromkeys(la + lb) if c not in out]
    order = list(out) + summed
    prod = _aligned(a, la, order) * _aligned(b, lb, order)
    return prod.sum(tuple(range(len(out), len(order)))) if summed else prod


@modes.per_mode
def linear(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias). Eager: decode rows over bfloat16 ``panels`` (:func:`bf16_rows`), else OpenBLAS
    where :func:`takes` says so, torch otherwise. In a compiled CPU step: one row :func:`reduce_linear`, several
    float32 rows over ``panels`` (``w``'s copy from :func:`make_panels`, None where it has none)
    :func:`~flashserve.model.cpu_kernels.dense_rows`, and one row too where the panels are bfloat16 (half the
    bytes of the float32 weight)."""
    # decode rows over bf16 panels; a weight held in bf16 (loader.hold_as_stored) at any row count, rather than a
    # float32 copy of it each call
    if bf16_rows(x, panels) or (w.dtype == torch.bfloat16 and _bf16_panels_for(x, panels) and x.numel()):
        flat = x.reshape(-1, x.shape[-1])
        return cpu_kernels.dense_rows(flat, panels, w.shape[0]).view(*x.shape[:-1], w.shape[0])
    if not takes(x, w):
        return F.linear(x, as_compute(w, x))
    flat = x.reshape(-1, x.shape[-1])
    return _mm_np(flat, w).view(*x.shape[:-1], w.shape[0])


def as_compute(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w`` in float32 where it is held in bfloat16 as a checkpoint stores it (``loader.KEEP_STORED``) and ``x``
    is float32 (an exact conversion, for the products that do not read its panels); else ``w``."""
    return w.float() if w.dtype == torch.bfloat16 and x.dtype == torch.float32 else w


def bf16_rows(x: torch.Tensor, panels: torch.Tensor | None) -> bool:
    """Whether an eager product of ``x`` reads a weight's bfloat16 panels (:func:`make_bf16_panels`): float32
    decode rows (at most :data:`BF16_PANEL_MAX_ROWS`) against panels that hold the weight's values in half its
    bytes."""
    return (_bf16_panels_for(x, panels) and 0 < x.numel() <= BF16_PANEL_MAX_ROWS * x.shape[-1]
            and not torch.is_grad_enabled())


def _bf16_panels_for(x: torch.Tensor, panels: torch.Tensor | None) -> bool:
    """Whether ``panels`` are bfloat16 panels that float32 rows ``x`` may read instead of the weight."""
    return panels is not None and panels.dtype == torch.bfloat16 and x.dtype == torch.float32


@linear.variant(COMPILED)
def _linear_compiled(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w)


@linear.variant(COMPILED_CPU)
def _linear_compiled_on_cpu(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
    if (one_row(x) and x.dtype in (torch.float32, torch.float64) and w.dtype == x.dtype
            and not _bf16_panels_for(x, panels)):
        return reduce_linear(x, w)
    # several rows, or one row where the panels are bfloat16 (a bf16 checkpoint's weight, such as DeepSeek's LM
    # head, computed in float32): the panels hold the same values in half the bytes of the weight itself
    if panels is not None and x.dtype == torch.float32:
        flat = x.reshape(-1, x.shape[-1])
        return cpu_kernels.dense_rows(flat, panels, w.shape[0]).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, as_compute(w, x))


@modes.per_mode
def pairs_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``p`` of ``x [P, K]`` times its own matrix ``w[p]`` (``w [P, N, K]``, optional per-row ``scale [P, N]``):
    [P, N], the gathered experts' product: a batched product; in a compiled CPU step :func:`reduce_linear`,
    each ``w[p]`` read in place (an int8 ``w`` converted as read)."""
    y = torch.bmm(w.to(x.dtype), x.unsqueeze(-1)).squeeze(-1)
    return y if scale is None else y * scale.to(y.dtype)


@pairs_linear.variant(COMPILED_CPU)
def _pairs_linear_compiled_on_cpu(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    y = reduce_linear(x, w)
    return y if scale is None else y * scale.to(y.dtype)


@modes.per_mode
def grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                   panels: torch.Tensor | None = None) -> torch.Tensor:
    """Group ``g`` of ``x [..., G, K]`` times group ``g`` of ``w``'s rows (``w [G * N, K]``, optional per-row
    ``scale``): [..., G, N]. In a compiled CPU step, one token: :func:`reduce_linear` (an int8 ``w`` read as is);
    several float32 rows with ``panels`` (``w``'s copy from :func:`make_panels`): each group through
    :func:`~flashserve.model.cpu_kernels.dense_rows` over its own panels, instead of MKL's batched product,
    which packs the weight on every call, on one thread."""
    return _grouped_einsum(x, w, scale)


def _grouped_einsum(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    G, K = x.shape[-2], x.shape[-1]
    y = torch.einsum("...gk,gnk->...gn", x, w.view(G, -1, K).to(x.dtype))
    return y if scale is None else y * scale.view(G, -1).to(y.dtype)


@grouped_linear.variant(COMPILED_CPU)
def _grouped_linear_compiled_on_cpu(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                                 panels: torch.Tensor | None = None) -> torch.Tensor:
    G, K = x.shape[-2], x.shape[-1]
    N = w.shape[0] // G
    if (panels is not None and x.numel() > G * K and x.dtype == torch.float32 and scale is None
            and N % cpu_kernels.LANES == 0 and panels.shape[-1] == cpu_kernels.LANES):
        per = N // cpu_kernels.LANES  # group g's outputs: panels g * per .. (g + 1) * per - 1
        flat = x.reshape(-1, G, K)
        y = torch.stack([cpu_kernels.dense_rows(flat[:, g], panels[g * per:(g + 1) * per], N) for g in range(G)], 1)
        return y.view(*x.shape[:-1], N)
    if x.numel() != G * K:
        return _grouped_einsum(x, w, scale)
    y = reduce_linear(x, w.view(G, -1, K))
    return y if scale is None else y * scale.view(G, -1).to(y.dtype)


PANELS = "_panels"  # suffix of a weight's panel copy: a buffer beside it, not a checkpoint tensor


def panels(module: nn.Module, name: str) -> torch.Tensor | None:
    """The panel copy :func:`make_panels` gave ``module.<name>``, or None."""
    return getattr(module, name + PANELS, None)


@torch.no_grad()
def make_panels(module: nn.Module, name: str) -> bool:
    """Copy ``module.<name>`` (a float32 CPU weight [N, K]) into the column panels that
    :func:`~flashserve.model.cpu_kernels.dense_rows` reads, as the buffer ``<name>_panels``. The engine does it
    at start-up for a compiled CPU step of several rows; the copy costs the weight's bytes again (each panel
    padded to 16 columns). The panels are bfloat16 when that holds every value exactly (a checkpoint stored in
    bf16, as DeepSeek releases its LM head): half the bytes to stream, the same products, so every decode row
    reads them (:func:`linear`); float32 panels serve only a compiled step's several rows. A large float32
    weight on an AVX2 CPU gets stream panels (:func:`~flashserve.model.cpu_kernels.streams`), read once a call.
    False, changing nothing, for a weight it does not take or where the kernel is not available."""
    w = getattr(module, name)
    if not _panel_source(w):
        return False
    if cpu_kernels.bf16_exact(w):
        copy = cpu_kernels.bf16_panels_of_exact(w)
    elif cpu_kernels.streams(w):
        copy = cpu_kernels.pack_stream_panels(w)
    else:
        copy = cpu_kernels.pack_panels(w)
    module.register_buffer(name + PANELS, copy, persistent=False)
    return True


def _panel_source(w: object) -> bool:
    """Whether ``w`` is a float32 CPU matrix that panels can be made of (where the kernel is available)."""
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
            and cpu_kernels.dense_rows_available())


BF16_PANEL_MIN_ELEMENTS = 1 << 24  # a weight this large streams from memory at one row: its bytes are the time
BF16_PANEL_MAX_ROWS = 32  # a decode batch's rows (dense_rows' range); a prompt's keep torch's product


@torch.no_grad()
def make_bf16_panels(module: nn.Module, name: str, stored_bf16: bool = False) -> bool:
    """Give ``module.<name>`` (a float32 CPU weight of at least :data:`BF16_PANEL_MIN_ELEMENTS` values, every one
    of which bfloat16 holds: a bf16 checkpoint's LM head in a float32 engine; with ``stored_bf16``, also such a
    weight held in bfloat16 as the checkpoint stores it) bfloat16 panels, which an eager step's decode rows read
    (:func:`linear`): half the bytes, the same products to float32 rounding. False, changing nothing, for any
    other weight or where the kernel is not available."""
    w = getattr(module, name)
    if not isinstance(w, torch.Tensor) or w.numel() < BF16_PANEL_MIN_ELEMENTS or panels(module, name) is not None:
        return False
    held_bf16 = (stored_bf16 and w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                 and cpu_kernels.dense_rows_available())
    if not (held_bf16 or (_panel_source(w) and cpu_kernels.bf16_exact(w))):
        return False
    module.register_buffer(name + PANELS, cpu_kernels.bf16_panels_of_exact(w), persistent=False)
    return True


JOINT = "_joint"  # a joint group's panels: the buffer <group>_joint_panels, its (paths, widths): <group>_joint_of


@torch.no_grad()
def make_joint_panels(module: nn.Module, group: str, paths: tuple[str, ...]) -> bool:
    """Copy the float32 CPU weights ``paths`` of ``module`` (``[N_i, K]``, all multiplied by one input) into one
    panel copy, each weight's columns from a panel boundary on, as the buffer ``<group>_joint_panels`` beside
    the attribute ``<group>_joint_of`` (the paths and their widths): :func:`joint_products` then makes all their
    products in one call of :func:`~flashserve.model.cpu_kernels.dense_rows` (the same sums as one call each).
    False, changing nothing, for fewer than two weights, other dtypes or shapes, or where the kernel is not
    available."""
    ws = [_parameter(module, p) for p in paths]
    if (len(ws) < 2 or not cpu_kernels.dense_rows_available()
            or any(w is None or w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu"
                   or w.shape[1] != ws[0].shape[1] for w in ws)):
        return False
    lanes = cpu_kernels.LANES
    padded = torch.cat([F.pad(w.detach(), (0, 0, 0, -w.shape[0] % lanes)) for w in ws])
    module.register_buffer(group + JOINT + PANELS, cpu_kernels.pack_panels(padded), persistent=False)
    setattr(module, group + JOINT + "_of", (tuple(paths), tuple(w.shape[0] for w in ws)))
    return True


def _parameter(module: nn.Module, path: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(path)
    except AttributeError:  # a packed or quantized weight (not a parameter of that name)
        return None


@modes.per_mode
def joint_products(x: torch.Tensor, module: nn.Module, group: str) -> dict[str, torch.Tensor]:
    """``x`` times each weight of ``module``'s joint ``group`` in one call, by path (``"wq_a.weight"``:
    ``[..., N]``, a view), in a compiled CPU step: over the joined panels of :func:`make_joint_panels` for several
    float32 rows (the peers checkpoint's 16-row step makes 66 calls where it made 112; a call costs about
    5 us besides its products, docs/engine-speed.md#products-on-the-cpu), or over the joined int8 rows of
    :func:`flashserve.model.packed.join_int8_rows` for one row (:func:`joint_int8_products`). Empty otherwise
    (and in other modes); the group's other weights are the caller's to multiply."""
    return {}


@joint_products.variant(COMPILED_CPU)
def _joint_products_compiled_on_cpu(x: torch.Tensor, module: nn.Module, group: str) -> dict[str, torch.Tensor]:
    if one_row(x):
        return joint_int8_products(x, module, group)
    panels = getattr(module, group + JOINT + PANELS, None)
    if panels is None or x.dtype != torch.float32:
        return {}
    paths, widths = getattr(module, group + JOINT + "_of")
    lanes = cpu_kernels.LANES
    y = cpu_kernels.dense_rows(x.reshape(-1, x.shape[-1]), panels, panels.shape[0] * lanes)
    out, start = {}, 0
    for path, n in zip(paths, widths):
        out[path] = y[:, start:start + n].view(*x.shape[:-1], n)
        start += -(-n // lanes) * lanes
    return out


INT8_JOINT = "_joint_int8"  # int8 rows of one input: buffers <group>_joint_int8_q / _s, (paths, widths): _of
# names' ends of those buffers: the layers' own bytes (they are views of them), not checkpoint tensors
INT8_JOINT_BUFFERS = (INT8_JOINT + "_q", INT8_JOINT + "_s")


def joint_int8_products(x: torch.Tensor, module: nn.Module, group: str) -> dict[str, torch.Tensor]:
    """One row ``x`` of a compiled CPU step times the int8 weights of ``module``'s ``group`` whose rows
    :func:`flashserve.model.packed.join_int8_rows` stored one after another, by path: one call of the int8 kernel
    where the weights took one each, every output the same sum (the kernel sums each output row alone, in a fixed
    order). Empty where a one-row product of those weights would not take the kernel (CPUs that prefer
    inductor's product: :func:`~flashserve.model.cpu_kernels.int8_pairs_preferred`)."""
    if getattr(module, group + INT8_JOINT + "_of", None) is None or not cpu_kernels.int8_pairs_preferred():
        return {}
    q, s = getattr(module, group + INT8_JOINT + "_q"), getattr(module, group + INT8_JOINT + "_s")
    paths, widths = getattr(module, group + INT8_JOINT + "_of")
    y = cpu_kernels.int8_linear(x, q, s).to(x.dtype)  # [..., sum of widths]
    return dict(zip(paths, y.split(list(widths), dim=-1)))


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products run through :func:`linear`: one row by OpenBLAS eagerly or
    inductor's reduction compiled, several rows of a compiled step over the weight's panels once
    :func:`make_panels` made them (``ROW_WEIGHTS``)."""

    ROW_WEIGHTS = ("weight",)  # what the engine's prepack_for_rows gives panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, panels(self, "weight"))
        return y if self.bias is None else y + self.bias

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., G, in / G]`` by the weight's G row groups (the grouped output projection): [..., G, out / G]."""
        return grouped_linear(x, self.weight, panels=panels(self, "weight"))
