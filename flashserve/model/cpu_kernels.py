"""C++ kernels for the CPU where torch's and inductor's code fall short, built for this CPU with torch's extension
API when an engine starts (:func:`build`; cached between runs).

* :func:`mxfp4_pairs`: the (row, expert) pair products of MXFP4 experts, each expert's bytes decoded once for
  all its rows (``csrc/mxfp4_pairs.cpp``); an MXFP4 projection of the peers checkpoint at 16 rows takes about a
  ninth of the time of inductor's code for :func:`flashserve.model.packed.mxfp4_pairs_linear`.
  :func:`mxfp4_gate_up` runs a MoE's gate and up projections in one pass over the tokens' rows.
* :func:`dense_rows`: a few float32 rows times a weight copied once into column panels (:func:`pack_panels`;
  ``csrc/dense_rows.cpp``), 2-4x torch's ``mm`` on a decode batch's shapes. A weight that streams from memory
  on an AVX2 CPU (the LM head) is copied into stream panels instead (:func:`pack_stream_panels`), read once a
  call with up to 16 rows in the registers' lanes.
* :func:`int8_pairs`: rows times int8 matrices with a float32 scale per matrix row, as the ``int8``
  quantization stores them (``csrc/int8_pairs.cpp``): a dense product, or each row its own expert. Compiled
  steps use it on CPUs with AVX2 but not AVX-512 (:func:`int8_pairs_preferred`), where inductor's code for
  the same product converts the bytes one at a time (slower than float32 weights there).
  :func:`int8_gate_up` runs a MoE's gate and up projections in one call.
* :func:`fp8_pairs`: rows times block-FP8 matrices read as stored (E4M3 codes, a UE8M0 scale a block;
  ``csrc/fp8_pairs.cpp``): the released checkpoints' dense layers (one matrix every row uses) and grouped output
  projection (a matrix a group), without decoding the matrix into float32 first.
  :func:`fp8_panels` makes the same products over a copy of the codes in column panels (:func:`pack_fp8_panels`,
  ``csrc/fp8_panels.cpp``), made at start-up: each output a sum of its column blocks' sums in order, the decode of
  a panel line shared by up to 12 rows, 1.4-1.7x :func:`fp8_pairs`' rate at 16 rows.
* :func:`attend_rows`: a few query rows' attention (``csrc/attend_rows.cpp``): one softmax over the window keys,
  the compressed entries (or picked ones) and the sink, reading and multiplying only the keys each row may see,
  where a decode step's fixed shapes give every row the indexer's whole pick and the whole window.
* :func:`sinkhorn`: mHC's Sinkhorn normalisation of a batch of small matrices, eight matrices a vector
  (``csrc/sinkhorn.cpp``). Compiled CPU steps call it instead of tracing the iterations
  (:func:`flashserve.model.mhc.sinkhorn`): the same values (bit for bit for mHC's 4x4 matrices), and far fewer
  graph operations to compile.
* :func:`index_topk`: the lightning indexer's top-k (and V4.1's candidate pool) over the FP4 index keys where the
  paged cache stores them (``csrc/index_topk.cpp``): integer products of the FP4-rounded query and the keys'
  codes, the k best kept as the entries go by. Fixed-shape steps call it instead of unpacking the whole cache,
  storing its scores and taking about ten passes over them (``Attention._select_paged``).

They are operators on torch's dispatcher, declared and implemented in C++ (``csrc/ops.cpp`` and each kernel's
source) and built with torch's extension API (``torch.utils.cpp_extension``) for this CPU, once a machine: later
processes load the cached build in well under a second. A compiled step's C++ wrapper calls them with no Python in
between (a call through Python costs microseconds, and a step makes about a hundred); their fake implementations,
for tracing, are registered here. The engine builds them before it serves (:func:`build`, from its execution
plan) and logs how long it took. Where no C++ compiler works the kernels are not available (``*_available`` says
so, and the log says why, once) and torch's or inductor's code runs. What each kernel is worth, and when it
runs: docs/engine-speed.md#the-c-kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: builds are not locked (see _BuildLock)
    fcntl = None

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# built as two translation units compiled side by side, csrc/kernels.cpp (which includes the other sources) and
# mxfp4_pairs.cpp: torch's headers, most of a build's time, are parsed twice instead of seven times
_UNITS = ("kernels.cpp", "mxfp4_pairs.cpp")
ISAS = ("native", "avx2", "scalar")  # the paths of each source: what the CPU has, AVX2 only, no intrinsics
# each path's build: its operator namespace (the model calls the native one) and its flags
_NAMESPACES = {"native": "flashserve", "avx2": "flashserve_avx2", "scalar": "flashserve_scalar"}
_ISA_FLAGS = {"native": (), "avx2": ("-DFLASHSERVE_NO_AVX512",), "scalar": ("-DFLASHSERVE_NO_SIMD",)}
# inductor's own flags for its C++ kernels: no fused multiply-adds or value-changing rewrites (the kernels' sums are
# tested bit for bit against torch's), gcc's loop vectorizer off (the kernels vectorize themselves)
_CFLAGS = ("-O3", "-DNDEBUG", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-signed-zeros",
           "-ffp-contract=off", "-fexcess-precision=fast", "-fno-tree-loop-vectorize")
LANES = 16  # output columns per panel of :func:`pack_panels`
STREAM_LANES = 6  # output columns per stream panel (:func:`pack_stream_panels`)
STREAM_MIN_BYTES = 16 << 20  # float32 weights from this size get stream panels on AVX2 CPUs (:func:`streams`)


# how long a start waits for another process's build of the same kernels before it runs torch's code without them
# (seconds; $FLASHSERVE_KERNEL_BUILD_WAIT, read when a build waits): a first build takes about 10 s on 2 idle
# cores, minutes on busy ones
BUILD_WAIT_S = 900.0


def build_wait_s() -> float:
    """$FLASHSERVE_KERNEL_BUILD_WAIT (seconds, 0 or more), else :data:`BUILD_WAIT_S`; a value that is not such a
    number is named in a warning and the default used."""
    raw = os.environ.get("FLASHSERVE_KERNEL_BUILD_WAIT", "").strip()
    if not raw:
        return BUILD_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # NaN too
        log.warning("FLASHSERVE_KERNEL_BUILD_WAIT=%r is not a number of seconds (0 or more); waiting at most %g s",
                    raw, BUILD_WAIT_S)
        return BUILD_WAIT_S
    return value


@functools.cache
def build(isa: str = "native") -> str | None:
    """Build the kernels' ``isa`` path with torch's extension API, or load the build cached for this CPU (torch's
    extensions folder, ``$TORCH_EXTENSIONS_DIR``), and return its operator namespace; None where it cannot be
    built here (the reason is logged once). The first build on a machine runs the C++ compiler (about 10 s on
    2 cores); later processes load it. One process builds at a time (:func:`_built_library`): the others wait,
    say so, and load its build; one that waits longer than :func:`build_wait_s` runs torch's code."""
    if isa not in _NAMESPACES:
        raise ValueError(f"unknown kernel path {isa!r}; choose one of {', '.join(ISAS)}")
    if isa in _READY:  # loaded in this process already: loading another build would define its operators twice
        return _NAMESPACES[isa]
    t0 = time.perf_counter()
    try:
        path = _built_library(isa)
    except Exception as e:  # no compiler, no ninja: torch's or inductor's code runs instead
        log.warning("CPU kernels (%s) unavailable, running torch's code instead (%s: %s)", isa, type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    if path is None:
        return None
    if isa == "native" and "native" not in _READY:
        _register_fakes_once()
    _READY.add(isa)
    log.info("CPU kernels (%s) ready in %.1f s: %s", isa, time.perf_counter() - t0, ", ".join(KERNELS))
    return _NAMESPACES[isa]


def _cflags(isa: str) -> list[str]:
    return [*_CFLAGS, f"-DFLASHSERVE_OPS={_NAMESPACES[isa]}", *_ISA_FLAGS[isa],
            f"-DFLASHSERVE_SOURCES={_sources_hash()}"]


def _library_name(isa: str) -> str:
    """The name of ``isa``'s build for this CPU, these sources and flags, this torch and this compiler: a build of
    another tree, another CPU kind or another torch has another name."""
    import hashlib

    what = [_sources_hash(), *_cflags(isa), torch.__version__, sys.version, os.environ.get("CXX", "c++")]
    return f"flashserve_kernels_{isa}_{_cpu_tag()}_{hashlib.sha256(repr(what).encode()).hexdigest()[:10]}"


def _built_library(isa: str) -> str | None:
    """The path of ``isa``'s library, loaded into this process: the finished build in torch's extensions folder
    (its ``flashserve`` folder), or one built now. A build runs in a folder of its own and its library is renamed
    into place only when it is whole, so a build that was killed leaves nothing a later start loads. Builders
    take an exclusive lock on ``<name>.lock`` (``fcntl.flock``: the kernel drops it when its holder dies, however
    it dies); a start that finds it held says once who holds it and waits, at most :func:`build_wait_s` (then
    None: torch's code runs)."""
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / "flashserve"
    root.mkdir(parents=True, exist_ok=True)
    name = _library_name(isa)
    final = root / f"{name}.so"
    if final.exists() and _loaded(final):
        return str(final)
    wait_s = build_wait_s()
    with _BuildLock(root / f"{name}.lock", wait_s) as held:
        if not held:
            log.warning("CPU kernels (%s): waited %g s for another process's build (lock %s); running torch's code "
                        "without them (slower)", isa, wait_s, held.path)
            return None
        if final.exists() and _loaded(final):  # built by the process this one waited for
            return str(final)
        if final.exists():  # a library that does not load (a disk that lost its end): built again
            final.unlink()
        if held.previous:  # the lock's last holder left no library: it was killed while building
            log.warning("CPU kernels (%s): the build by %s did not finish (interrupted); building again", isa,
                        held.previous)
        if held.exclusive:  # an interrupted build's files (no other build runs: the lock is this process's)
            for old in root.glob(f"{name}.build-*"):
                shutil.rmtree(old, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=root))
        log.info("CPU kernels (%s): building them for this CPU in %s (once a machine: about 10 s on 2 idle cores)",
                 isa, work)
        try:
            path = cpp_extension.load(name=name, sources=[str(_CSRC / u) for u in _UNITS], extra_cflags=_cflags(isa),
                                      extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)],
                                      build_directory=str(work), is_python_module=False)
            with open(path, "rb") as f:  # on the disk before it is named: a crash cannot leave a short library
                os.fsync(f.fileno())
            os.replace(path, final)  # the loaded library keeps its mapping; later starts load it at its new path
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return str(final)


def _loaded(path: Path) -> bool:
    """Whether the finished library at ``path`` loaded into this process (False, logged, if it does not load)."""
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        log.warning("CPU kernels: %s does not load (%s); building it again", path, e)
        return False
    return True


class _BuildLock:
    """An exclusive ``fcntl.flock`` on ``path`` for as long as the block runs, waited for at most ``wait_s``
    seconds; the ``with`` target is true when held (``exclusive``), or when nothing can be locked here. The holder
    writes its pid and host into the file, which a waiter names in its log line and the next holder reads as
    ``previous``. Where ``fcntl`` is missing (Windows) or the filesystem refuses locks (some NFS and FUSE mounts)
    nothing is locked: concurrent builds each build in their own folder, and each renames a whole library."""

    def __init__(self, path: Path, wait_s: float):
        self.path, self.wait_s = path, wait_s
        self.previous = ""  # "process <pid> on <host>" of the last holder that did not finish, if any
        self.exclusive = False  # held with fcntl: no other flashserve process builds this library meanwhile
        self._file = None
        self._unlocked = fcntl is None  # nothing to lock with here: go on without

    def __bool__(self) -> bool:
        return self.exclusive or self._unlocked

    def __enter__(self) -> "_BuildLock":
        if fcntl is None:
            return self
        f = open(self.path, "a+")
        deadline, said = time.monotonic() + self.wait_s, False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.warning("CPU kernels: waiting for %s, which is building them (%s)",
                                self._holder(f) or "another process", self.path.parent)
                    said = True
                if time.monotonic() >= deadline:
                    f.close()
                    return self
                time.sleep(0.2)
            except OSError as e:  # ENOLCK, EOPNOTSUPP: this filesystem does not lock
                log.warning("CPU kernels: %s cannot be locked here (%s); building without a lock", self.path, e)
                f.close()
                self._unlocked = True
                return self
        self.previous = self._holder(f)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file, self.exclusive = f, True
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()  # finished (or failed with an error this process reported): nothing to report
            self._file.close()  # closing drops the lock
            self._file = None

    @staticmethod
    def _holder(f) -> str:
        f.seek(0)
        return f.read().strip()


@functools.cache
def _sources_hash() -> str:
    """A hash of every file of ``csrc``: torch names a build by its listed source and flags, and the unit's
    included sources would otherwise change without a new name."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(_CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _cpu_tag() -> str:
    """A short name for this CPU's instruction sets (a hash of /proc/cpuinfo's flags), which names its builds: a
    ``-march=native`` build cached in a shared home is not loaded on another kind of CPU."""
    import hashlib
    import platform

    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.machine() + platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


KERNELS = ("mxfp4_pairs", "dense_rows", "int8_pairs", "fp8_pairs", "fp8_panels", "attend_rows", "sinkhorn",
           "index_topk")
_READY: set[str] = set()  # the paths built or loaded in this process
# kernels that gave other products than torch's on this machine (the engine's start-up check,
# flashserve.engine.kernel_check): kernel -> what disagreed. The model runs torch's code instead of each.
_REFUSED: dict[str, str] = {}


def refuse(kernel: str, why: str) -> None:
    """Stop the model calling ``kernel`` (one of :data:`KERNELS`) in this process: its products disagreed with
    torch's here (``why``). Layers that would call it run torch's code (a refused ``fp8_pairs`` takes ``fp8_panels``
    with it: the panels' layers fall back to the codes as stored)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    _REFUSED[kernel] = why


def refused() -> dict[str, str]:
    """The kernels :func:`refuse` took out of use in this process, with why."""
    return dict(_REFUSED)


def _usable(kernel: str) -> bool:
    return kernel not in _REFUSED and build() is not None


def built() -> list[str]:
    """The C++ kernels this process has built or loaded (the native path's) and not refused."""
    return [k for k in KERNELS if k not in _REFUSED] if "native" in _READY else []


def _ops(isa: str):
    """``torch.ops.<namespace>`` of the ``isa`` path's build (building it if needed)."""
    ns = build(isa)
    if ns is None:
        raise RuntimeError(f"the CPU kernels ({isa}) could not be built here (see the log)")
    return getattr(torch.ops, ns)


@torch.compiler.assume_constant_result  # a traced step reads the answer as a constant
def mxfp4_pairs_available() -> bool:
    """Whether :func:`mxfp4_pairs` has its compiled kernel on this machine (compiling it if needed)."""
    return _usable("mxfp4_pairs")


@torch.compiler.assume_constant_result
def dense_rows_available() -> bool:
    """Whether :func:`dense_rows` has its compiled kernel on this machine (compiling it if needed)."""
    return _usable("dense_rows")


@torch.compiler.assume_constant_result
def fp8_pairs_available() -> bool:
    """Whether :func:`fp8_pairs` has its compiled kernel on this machine (building it if needed)."""
    return _usable("fp8_pairs")


@torch.compiler.assume_constant_result
def fp8_panels_available() -> bool:
    """Whether block-FP8 layers may read their codes through :func:`fp8_panels` (with :func:`fp8_pairs`)."""
    return _usable("fp8_panels") and fp8_pairs_available()


@torch.compiler.assume_constant_result
def sinkhorn_available() -> bool:
    """Whether :func:`sinkhorn` has its compiled kernel on this machine (compiling it if needed)."""
    return build() is not None


@torch.compiler.assume_constant_result
def index_topk_available() -> bool:
    """Whether :func:`index_topk` has its compiled kernel on this machine (compiling it if needed)."""
    return build() is not None


@torch.compiler.assume_constant_result
def int8_pairs_preferred() -> bool:
    """Whether compiled steps multiply int8 weights through :func:`int8_pairs`: on CPUs with AVX2 but not
    AVX-512, where inductor's code converts the bytes one at a time, and where it is built. AVX-512 CPUs keep
    inductor's products, fast there (docs/engine-speed.md#the-c-kernels)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and _usable("int8_pairs")


def int8_pairs_eager(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     isa: str = "native", up: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Pair ``p`` (``experts`` flattened) is a row of ``x`` times expert ``experts[p]``'s int8 matrix ``q [E, N,
    K]`` with its rows' float32 ``scale [E, N]`` (or their bits as int32, as the int8 quantization stores
    them): [P, N] float32. ``x [P, K]`` gives each pair its own row, ``x [T, K]`` with ``experts [T, k]`` gives
    token ``t``'s row to its ``k`` pairs. With ``up`` (the up projection's ``q, scale`` beside the gate's) both
    matrices' products in one call, [2, P, N]. ``isa`` as in :func:`mxfp4_pairs_eager`."""
    E, N, K = q.shape
    if (x.dim() != 2 or x.shape[1] != K or scale.shape != (E, N) or not x.shape[0] or q.dtype != torch.int8
            or experts.numel() % x.shape[0]
            or (up is not None and (up[0].shape != q.shape or up[0].dtype != q.dtype or up[1].shape != scale.shape))):
        ups = "" if up is None else f", up {tuple(up[0].shape)} {up[0].dtype} and {tuple(up[1].shape)}"
        raise ValueError(f"int8_pairs: x {tuple(x.shape)}, experts {tuple(experts.shape)}, q {tuple(q.shape)} "
                         f"{q.dtype}, scale {tuple(scale.shape)}{ups} do not match")
    ops = _ops(isa)
    if up is None:
        return ops.int8_pairs(x, experts, q, _float_scale(scale))
    return ops.int8_gate_up(x, experts, q, _float_scale(scale), up[0], _float_scale(up[1]))


def _float_scale(scale: torch.Tensor) -> torch.Tensor:
    """int8 row scales as float32 (their bits as int32, as the int8 quantization stores them, read as they are)."""
    return (scale.view(torch.float32) if scale.dtype == torch.int32 else scale.to(torch.float32)).contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (q * scale[:, None]).T`` for int8 rows ``q [N, K]`` and float32 ``scale [N]`` (or its bits
    as int32) through :func:`int8_pairs` (one expert that every row uses); [..., N] float32."""
    flat = x.reshape(-1, x.shape[-1])
    experts = torch.zeros(flat.shape[0], dtype=torch.int64, device=x.device)
    return int8_pairs(flat, experts, q[None], scale[None]).view(*x.shape[:-1], q.shape[0])


def fp8_pairs_eager(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor, row_block: int,
                    col_block: int, isa: str = "native") -> torch.Tensor:
    """Pair ``p`` (``experts`` flattened) is a row of ``x`` times expert ``experts[p]``'s block-FP8 matrix: ``q [E,
    N, K]`` E4M3 codes (uint8 or float8_e4m3fn), ``s [E, ceil(N / row_block), ceil(K / col_block)]`` UE8M0 scales
    (uint8 or float8_e8m0fnu); [P, N] float32, each weight the value :func:`flashserve.model.packed.decode` gives.
    ``x [P, K]`` gives each pair its own row, ``x [T, K]`` with ``experts [T, k]`` gives token ``t``'s row to its
    ``k`` pairs. ``isa`` as in :func:`mxfp4_pairs_eager`."""
    E, N, K = q.shape if q.dim() == 3 else (0, 0, 0)
    if (q.dim() != 3 or x.dim() != 2 or x.shape[1] != K or not x.shape[0] or experts.numel() % x.shape[0]
            or row_block < 1 or col_block < 8 or col_block % 8
            or s.shape != (E, -(-N // row_block), -(-K // col_block))):
        raise ValueError(f"fp8_pairs: x {tuple(x.shape)}, experts {tuple(experts.shape)}, q {tuple(q.shape)}, "
                         f"s {tuple(s.shape)}, blocks {row_block}x{col_block} do not match")
    return _ops(isa).fp8_pairs(x, experts, q, s, row_block, col_block)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, row_block: int, col_block: int) -> torch.Tensor:
    """``x [..., K]`` times the block-FP8 matrix ``q [N, K]`` with scales ``s [ceil(N / row_block), ceil(K /
    col_block)]`` through :func:`fp8_pairs` (one expert that every row uses); [..., N] float32."""
    flat = x.reshape(-1, x.shape[-1])
    experts = torch.zeros(flat.shape[0], dtype=torch.int64, device=x.device)
    return fp8_pairs(flat, experts, q[None], s[None], row_block, col_block).view(*x.shape[:-1], q.shape[0])


def pack_fp8_panels(q: torch.Tensor) -> torch.Tensor:
    """E4M3 codes ``q [E, N, K]`` (uint8 or float8_e4m3fn) as the panels :func:`fp8_panels` reads, uint8 [E,
    ceil(N / 16), K, 16]: panel ``j``, line ``k`` holds ``q[e, 16 j + c, k]`` in slot ``c``, code 0 (zero) past
    ``N``. The same bytes as ``q`` (plus the padding), laid out again."""
    if q.dim() != 3:
        raise ValueError(f"pack_fp8_panels: q must be [E, N, K], not {tuple(q.shape)}")
    E, N, K = q.shape
    out = torch.zeros(E, -(-N // LANES), K, LANES, dtype=torch.uint8)
    full = N // LANES
    codes = q.detach().view(torch.uint8)
    out[:, :full] = codes[:, :full * LANES].view(E, full, LANES, K).transpose(2, 3)
    if N % LANES:
        out[:, full, :, :N % LANES] = codes[:, full * LANES:].transpose(1, 2)
    return out


def fp8_panels_eager(x: torch.Tensor, experts: torch.Tensor, panels: torch.Tensor, s: torch.Tensor, n: int,
                     row_block: int, col_block: int, isa: str = "native") -> torch.Tensor:
    """:func:`fp8_pairs_eager`'s products over ``panels = pack_fp8_panels(q)`` (``q [E, n, K]``), with the same
    scales ``s``: [P, n] float32, each output the sum of its column blocks' sums in order, each block's one fused
    multiply-add a k in order (fp8_pairs sums sixteen lanes over k, then the lanes: the same products, summed in
    another order), whatever the rows beside it or the threads. ``row_block`` must be a multiple of 16 (a panel
    lies in one row block)."""
    E, J, K, lanes = panels.shape if panels.dim() == 4 else (0, 0, 0, 0)
    if (panels.dim() != 4 or lanes != LANES or n < 1 or J != -(-n // LANES) or x.dim() != 2 or x.shape[1] != K
            or not x.shape[0] or experts.numel() % x.shape[0] or row_block < LANES or row_block % LANES
            or col_block < 1 or s.shape != (E, -(-n // row_block), -(-K // col_block))):
        raise ValueError(f"fp8_panels: x {tuple(x.shape)}, experts {tuple(experts.shape)}, panels "
                         f"{tuple(panels.shape)}, s {tuple(s.shape)}, n {n}, blocks {row_block}x{col_block} do "
                         "not match")
    return _ops(isa).fp8_panels(x, experts, panels, s, n, row_block, col_block)


def fp8_panels_linear(x: torch.Tensor, panels: torch.Tensor, s: torch.Tensor, n: int, row_block: int,
                      col_block: int) -> torch.Tensor:
    """``x [..., K]`` times the block-FP8 matrix in ``panels [ceil(n / 16), K, 16]`` (:func:`pack_fp8_panels`)
    with scales ``s [ceil(n / row_block), ceil(K / col_block)]`` through :func:`fp8_panels`; [..., n] float32."""
    flat = x.reshape(-1, x.shape[-1])
    experts = torch.zeros(flat.shape[0], dtype=torch.int64, device=x.device)
    return fp8_panels(flat, experts, panels[None], s[None], n, row_block, col_block).view(*x.shape[:-1], n)


ATTEND_ROWS_MAX = 16  # query rows a forward attends through attend_rows (decode and verification steps)
# heads x head width from which a layer attends through attend_rows (V4-Flash and V4.1-Flash: 64 x 512); narrower
# layers keep torch's (inductor's) products, whose fused loops the kernel's call would not beat (the peers
# checkpoint, 8 x 64: batch 1 in float32 measured 1.06-1.07x llama.cpp with the kernel, 1.08-1.20x without)
ATTEND_ROWS_MIN_WIDTH = 8192


@torch.compiler.assume_constant_result
def attend_rows_preferred() -> bool:
    """Whether decode rows attend through :func:`attend_rows`: on CPUs with AVX-512 (its vector path; others keep
    torch's products), where it is built."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and _usable("attend_rows")


def attend_rows_eager(q: torch.Tensor, win: torch.Tensor, win_ok: torch.Tensor, ent: torch.Tensor,
                      ent_ok: torch.Tensor, sink: torch.Tensor, scale: float, isa: str = "native") -> torch.Tensor:
    """Each query row ``q [B, S, H, D]``'s attention: one softmax over the window keys ``win [B, T, D]`` it may see
    (``win_ok [B, S, T]``), the entries ``ent [B, Se, E, D]`` it may see (``ent_ok [B, S, E]``; ``Se`` 1: one list
    for every row, ``S``: each row its own picks) and each head's ``sink [H]`` logit, with logits ``q . k *
    scale``; returns the probability-weighted sum of the keys and entries (V4's keys are their values), [B, S, H,
    D] float32. Only the keys and entries a row may see are read. ``Attention._attend``'s masked softmax and
    products, tested equal to them."""
    B, S, H, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if (q.dim() != 4 or win.dim() != 3 or win.shape[::2] != (B, D) or win_ok.shape != (B, S, win.shape[1])
            or ent.dim() != 4 or ent.shape[0] != B or ent.shape[1] not in (1, S) or ent.shape[3] != D
            or ent_ok.shape != (B, S, ent.shape[2]) or sink.shape != (H,)
            or win_ok.dtype != torch.bool or ent_ok.dtype != torch.bool):
        raise ValueError(f"attend_rows: q {tuple(q.shape)}, win {tuple(win.shape)}, win_ok {tuple(win_ok.shape)}, "
                         f"ent {tuple(ent.shape)}, ent_ok {tuple(ent_ok.shape)}, sink {tuple(sink.shape)} do not "
                         "match (masks bool)")
    return _ops(isa).attend_rows(q, win, win_ok, ent, ent_ok, sink, float(scale))


def sinkhorn_eager(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`flashserve.model.mhc._sinkhorn_scalings` of float32 matrices ``comb`` [.., n, n] (n <= 8, ``iters``
    >= 1) through the C++ kernel: the same operations, rounded alike, each sum in index order (bit for bit the
    traced values for n <= 4, where torch sums in that order too). The source has no intrinsics (the compiler
    vectorizes it), so its native build is the only one."""
    n = comb.shape[-1] if comb.dim() >= 2 else 0
    if not 1 <= n <= 8 or comb.shape[-2] != n or iters < 1 or comb.dtype != torch.float32:
        raise ValueError(f"sinkhorn: comb {tuple(comb.shape)} {comb.dtype}, iters {iters}: expected float32 "
                         "[.., n, n] with 1 <= n <= 8 and iters >= 1")
    return _ops("native").sinkhorn(comb, iters, float(eps))


def index_topk_eager(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, limit: torch.Tensor,
                     cand: torch.Tensor, k: int, block: int, n_blocks: int,
                     isa: str = "native") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lightning indexer's top-k over FP4 index keys in a paged cache (``csrc/index_topk.cpp``), without
    unpacking the cache or storing its scores. Row ``r`` of ``q [R, H, d]`` (float32) with head weights ``w [R,
    H]`` belongs to sequence ``r // (R // B)`` of ``table [B, P]`` (page ids into ``pages [NP, epp, d/2 + d/32]``,
    records of :func:`flashserve.model.quant.pack_fp4_ue8m0`) and sees its entries ``j < limit[r]``; entry
    ``j``'s score is ``sum_h w[r, h] relu(q[r, h] . K_j) / sqrt(d)``. Returns ``idx [R, k]`` (the k best
    entries, higher score then lower index first, in ascending order, filled up with the lowest other entries),
    ``valid [R, k]`` (False for the fill) and ``pool [R, n_blocks]``: the ``n_blocks`` best blocks of ``block``
    entries by their best score, the block of entry ``limit - 1`` first, ascending, -1 past the end. With
    ``cand [R, C]`` (C > 0: block ids, -1 none) only those blocks' entries are scored (and ``n_blocks`` is 0);
    ``cand [R, 0]`` scores every visible entry. This is :func:`flashserve.model.attention.select_topk` and
    :func:`~flashserve.model.attention.candidate_pool` over ``Indexer.scores``, tested equal to them."""
    R, H, d = q.shape if q.dim() == 3 else (0, 0, 0)
    B, P = table.shape if table.dim() == 2 else (0, 0)
    if (q.dim() != 3 or w.shape != (R, H) or pages.dim() != 3 or table.dim() != 2 or limit.shape != (R,)
            or cand.dim() != 2 or cand.shape[0] != R or not B or R % B or d < 32 or d % 32 or d > 1024
            or pages.shape[2] != d // 2 + d // 32 or not 0 <= k <= P * pages.shape[1] or block < 1 or n_blocks < 0
            or (cand.shape[1] and n_blocks)):
        raise ValueError(f"index_topk: q {tuple(q.shape)}, w {tuple(w.shape)}, pages {tuple(pages.shape)}, table "
                         f"{tuple(table.shape)}, limit {tuple(limit.shape)}, cand {tuple(cand.shape)}, k {k}, "
                         f"block {block}, n_blocks {n_blocks} do not match")
    if pages.dtype != torch.uint8:
        raise ValueError(f"index_topk: pages must be uint8 records, not {pages.dtype}")
    return _ops(isa).index_topk(q.to(torch.float32), w.to(torch.float32), pages, table.to(torch.int64),
                                limit.to(torch.int64), cand.to(torch.int64), k, block, n_blocks)


def mxfp4_pairs_eager(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      isa: str = "native", up: tuple[torch.Tensor, torch.Tensor] | None = None,
                      a8: bool = False) -> torch.Tensor:
    """Pair ``p`` (``experts`` flattened) is a row of ``x`` times expert ``experts[p]``'s MXFP4 matrix: ``q [E,
    N, K/2]`` bytes (two E2M1 codes each, the low nibble the even column), ``s [E, N, K/32]`` E8M0 block scales;
    [P, N] float32. ``x [P, K]`` gives each pair its own row; ``x [T, K]`` with ``experts [T, k]`` gives token
    ``t``'s row to its ``k`` pairs. With ``up`` (the up projection's ``q, s`` beside the gate's) both matrices'
    products, [2, P, N]. ``isa`` picks one of the source's paths (:data:`ISAS`; the tests run each). ``a8``: each
    32-block of a row of ``x`` is first rounded to int8 codes times a float32 scale (``max |x| / 127``, llama.cpp's
    Q8_0) and the products are integer dot products: not exact, about 2x faster (``--quantization w4a8``)."""
    E, N, half = q.shape
    if (x.dim() != 2 or x.shape[1] != 2 * half or half % 16 or s.shape != (E, N, half // 16) or not x.shape[0]
            or (experts.dim() == 1 and experts.numel() != x.shape[0])
            or (experts.dim() != 1 and experts.shape[0] != x.shape[0])
            or (up is not None and (up[0].shape != q.shape or up[1].shape != s.shape))):
        raise ValueError(f"mxfp4_pairs: x {tuple(x.shape)}, experts {tuple(experts.shape)}, q {tuple(q.shape)}, "
                         f"s {tuple(s.shape)} do not match")
    ops = _ops(isa)
    if up is None:
        return (ops.mxfp4_pairs_a8 if a8 else ops.mxfp4_pairs)(x, experts, q, s)
    return (ops.mxfp4_gate_up_a8 if a8 else ops.mxfp4_gate_up)(x, experts, q, s, up[0], up[1])


# where a bfloat16 panel line keeps column c: slot BF16_SLOTS[c] (csrc/dense_rows.cpp, COLUMN_SLOT)
BF16_SLOTS = tuple(2 * c if c < 8 else 2 * (c - 8) + 1 for c in range(LANES))


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether bfloat16 holds every value of ``w`` exactly (a checkpoint's bf16 tensor read into float32): for
    float32, whether every value's low 16 bits are zero, read in place (a V4.1-Flash LM head: one pass over its
    2.65 GB, where converting it to bfloat16 and back took seconds). A NaN whose low bits are zero counts as
    held: bfloat16 keeps it a NaN."""
    w = w.detach()
    if w.dtype == torch.float32 and w.dim() >= 1 and sys.byteorder == "little":
        flat = w if w.is_contiguous() else w.t() if w.dim() == 2 and w.t().is_contiguous() else w.contiguous()
        return not bool(flat.view(torch.int16).view(-1, 2)[:, 0].any())  # each value's low half
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


def _in_panels(w: torch.Tensor, lanes: int, dtype: torch.dtype) -> torch.Tensor:
    """``w [N, K]`` as [ceil(N / lanes), K, lanes] (a view of a zero-padded copy): panel ``p``, line ``k`` holds
    ``w[lanes * p + c, k]`` in slot ``c``."""
    N, K = w.shape
    padded = torch.zeros(-(-N // lanes) * lanes, K, dtype=dtype)
    padded[:N] = w.detach()
    return padded.view(-1, lanes, K).transpose(1, 2)


def pack_panels(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w [N, K]`` (any strides) as the panels :func:`dense_rows` reads: [ceil(N / 16), K, 16], panel ``p``
    holding output columns ``16p .. 16p + 15`` k by k, zero past ``N``. ``dtype`` bfloat16 halves the bytes for
    weights that :func:`bf16_exact` (the products are the same: the kernel widens each value back exactly); each
    line's 16 values are then stored in the kernel's slot order (:data:`BF16_SLOTS`)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_panels: panels are float32 or bfloat16, not {dtype}")
    if dtype == torch.bfloat16 and not bf16_exact(w):
        raise ValueError("pack_panels: bfloat16 panels would round this weight (bf16_exact is False)")
    if dtype != torch.bfloat16:
        return _in_panels(w, LANES, dtype).contiguous()
    return bf16_panels_of_exact(w)


def bf16_panels_of_exact(w: torch.Tensor) -> torch.Tensor:
    """:func:`pack_panels` in bfloat16 for a ``w`` already known to be :func:`bf16_exact` (not checked again).
    Column ``c = 8h + i`` of a panel goes to slot ``2i + h`` (:data:`BF16_SLOTS`), so a panel's 16 rows viewed as
    [2, 8] and read transposed are its slots in order: a float32 ``w`` (little-endian, contiguous) is copied once,
    its values' high halves (exactly its values, in bfloat16) straight into place (V4.1-Flash's LM head: about 2 s
    where converting, gathering and transposing in turn took about 6)."""
    N, K = w.shape
    panels = -(-N // LANES)
    w = w.detach()
    if w.dtype == torch.float32 and w.is_contiguous() and sys.byteorder == "little":
        src = w.view(torch.int16).view(N, K, 2)[..., 1]  # each value's high half: its bfloat16 bits
        out = torch.empty(panels, K, LANES, dtype=torch.int16)
    else:
        src, out = w.to(torch.bfloat16), torch.empty(panels, K, LANES, dtype=torch.bfloat16)
    full = N // LANES
    out[:full].view(full, K, 8, 2).copy_(src[:full * LANES].view(full, 2, 8, K).permute(0, 3, 2, 1))
    if full < panels:  # the last panel, zero past N
        tail = torch.zeros(LANES, K, dtype=src.dtype)
        tail[:N - full * LANES] = src[full * LANES:]
        out[full].view(K, 8, 2).copy_(tail.view(2, 8, K).permute(2, 1, 0))
    return out.view(torch.bfloat16)


def pack_stream_panels(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` (any strides) as the stream panels :func:`dense_rows` reads: [ceil(N / 6), K, 6] float32, panel
    ``p`` holding output columns ``6p .. 6p + 5`` k by k, zero past ``N``. The kernel reads each line once a call,
    with up to 16 rows in its registers' lanes (``csrc/dense_rows.cpp``)."""
    return _in_panels(w, STREAM_LANES, torch.float32).contiguous()


def streams(w: torch.Tensor) -> bool:
    """Whether :func:`dense_rows` multiplies the float32 weight ``w`` faster through stream panels: on CPUs with AVX2
    but not AVX-512 (where 16-column panels need three passes over each line at 16 rows; about 1.3x on the peers
    checkpoint's LM head, docs/engine-speed.md#the-c-kernels), for weights of at least :data:`STREAM_MIN_BYTES`,
    which come from memory on every call. AVX-512 CPUs keep the panels, fast there."""
    return (w.dtype == torch.float32 and w.numel() * 4 >= STREAM_MIN_BYTES
            and torch.backends.cpu.get_cpu_capability() == "AVX2")


def dense_rows_eager(x: torch.Tensor, panels: torch.Tensor, n: int, isa: str = "native") -> torch.Tensor:
    """``x [M, K] @ w.T`` [M, n] float32 for ``panels = pack_panels(w)`` (``w [n, K]``, float32 or bfloat16
    panels) or ``pack_stream_panels(w)``; ``isa`` as in :func:`mxfp4_pairs_eager`."""
    lanes = panels.shape[2] if panels.dim() == 3 else 0
    if (x.dim() != 2 or lanes not in (LANES, STREAM_LANES) or panels.shape[1] != x.shape[1]
            or not 0 < n <= panels.shape[0] * lanes or n <= (panels.shape[0] - 1) * lanes):
        raise ValueError(f"dense_rows: x {tuple(x.shape)}, panels {tuple(panels.shape)}, n {n} do not match")
    if panels.dtype != torch.float32 and (panels.dtype != torch.bfloat16 or lanes != LANES):
        raise ValueError(f"dense_rows: panels are float32 or bfloat16 (stream panels float32), not {panels.dtype}")
    return _ops(isa).dense_rows(x, panels, n)


def _register_fakes_once() -> None:
    """The native operators' fake implementations (output shapes and dtypes), which tracing a step needs; once a
    process."""
    fake = torch.library.register_fake

    @fake("flashserve::index_topk")
    def _(q, w, pages, table, limit, cand, k, block, n_blocks):
        R = q.shape[0]
        return (q.new_empty((R, k), dtype=torch.int64), q.new_empty((R, k), dtype=torch.bool),
                q.new_empty((R, n_blocks), dtype=torch.int64))

    def pairs(x, experts, q, s):  # one product an (expert, row) pair
        return x.new_empty((experts.numel(), q.shape[1]), dtype=torch.float32)

    def gate_up(x, experts, q1, s1, q3, s3):  # the gate and up products of each pair
        return x.new_empty((2, experts.numel(), q1.shape[1]), dtype=torch.float32)

    for name in ("mxfp4_pairs", "mxfp4_pairs_a8", "int8_pairs"):
        fake(f"flashserve::{name}")(pairs)
    for name in ("mxfp4_gate_up", "mxfp4_gate_up_a8", "int8_gate_up"):
        fake(f"flashserve::{name}")(gate_up)

    @fake("flashserve::mxfp4_mapped")
    def _(x, experts, table, n, a8):
        return x.new_empty((table.shape[0] // 2, experts.numel(), n), dtype=torch.float32)

    @fake("flashserve::fp8_pairs")
    def _(x, experts, q, s, row_block, col_block):
        return x.new_empty((experts.numel(), q.shape[1]), dtype=torch.float32)

    @fake("flashserve::fp8_panels")
    def _(x, experts, panels, s, n, row_block, col_block):
        return x.new_empty((experts.numel(), n), dtype=torch.float32)

    @fake("flashserve::attend_rows")
    def _(q, win, win_ok, ent, ent_ok, sink, scale):
        return q.new_empty(q.shape, dtype=torch.float32)

    @fake("flashserve::sinkhorn")
    def _(comb, iters, eps):
        return torch.empty_like(comb, memory_format=torch.contiguous_format)

    @fake("flashserve::dense_rows")
    def _(x, panels, n):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)


def mxfp4_pairs(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                a8: bool = False) -> torch.Tensor:
    """:func:`mxfp4_pairs_eager` with the CPU's own path, as the operator ``flashserve::mxfp4_pairs``."""
    return (torch.ops.flashserve.mxfp4_pairs_a8 if a8 else torch.ops.flashserve.mxfp4_pairs)(x, experts, q, s)


def mxfp4_gate_up(x: torch.Tensor, experts: torch.Tensor, q1: torch.Tensor, s1: torch.Tensor, q3: torch.Tensor,
                  s3: torch.Tensor, a8: bool = False) -> torch.Tensor:
    """The gate's and the up projection's pair products in one pass, [2, P, N] (:func:`mxfp4_pairs_eager` with
    ``up``), as the operator ``flashserve::mxfp4_gate_up``."""
    op = torch.ops.flashserve.mxfp4_gate_up_a8 if a8 else torch.ops.flashserve.mxfp4_gate_up
    return op(x, experts, q1, s1, q3, s3)


def mxfp4_mapped(x: torch.Tensor, experts: torch.Tensor, table: torch.Tensor, n: int, a8: bool = False) -> torch.Tensor:
    """The pair products of MXFP4 experts held one matrix an expert, [m, P, n]: ``table`` [2m, E] int64 holds the
    addresses of each expert's bytes ``[n, K/2]`` and scales ``[n, K/32]`` for m = 1 matrix (``mxfp4_pairs``) or
    2 (``mxfp4_gate_up``: gate, then up), as the operator ``flashserve::mxfp4_mapped``. The same kernel and sums
    as the stacked operators; the caller keeps the tensors at those addresses alive."""
    return torch.ops.flashserve.mxfp4_mapped(x, experts, table, n, a8)


def int8_pairs(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`int8_pairs_eager` with the CPU's own path, as the operator ``flashserve::int8_pairs``."""
    return torch.ops.flashserve.int8_pairs(x, experts, q, scale)


def int8_gate_up(x: torch.Tensor, experts: torch.Tensor, q1: torch.Tensor, s1: torch.Tensor, q3: torch.Tensor,
                 s3: torch.Tensor) -> torch.Tensor:
    """The gate's and the up projection's int8 pair products in one call, [2, P, N] (:func:`int8_pairs_eager` with
    ``up``), as the operator ``flashserve::int8_gate_up``."""
    return torch.ops.flashserve.int8_gate_up(x, experts, q1, s1, q3, s3)


def fp8_pairs(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor, row_block: int,
              col_block: int) -> torch.Tensor:
    """:func:`fp8_pairs_eager` with the CPU's own path, as the operator ``flashserve::fp8_pairs``."""
    return torch.ops.flashserve.fp8_pairs(x, experts, q, s, row_block, col_block)


def fp8_panels(x: torch.Tensor, experts: torch.Tensor, panels: torch.Tensor, s: torch.Tensor, n: int, row_block: int,
               col_block: int) -> torch.Tensor:
    """:func:`fp8_panels_eager` with the CPU's own path, as the operator ``flashserve::fp8_panels``."""
    return torch.ops.flashserve.fp8_panels(x, experts, panels, s, n, row_block, col_block)


def attend_rows(q: torch.Tensor, win: torch.Tensor, win_ok: torch.Tensor, ent: torch.Tensor, ent_ok: torch.Tensor,
                sink: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attend_rows_eager` with the CPU's own path, as the operator ``flashserve::attend_rows``."""
    return torch.ops.flashserve.attend_rows(q, win, win_ok, ent, ent_ok, sink, scale)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn_eager` as the operator ``flashserve::sinkhorn``."""
    return torch.ops.flashserve.sinkhorn(comb, iters, eps)


def index_topk(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, limit: torch.Tensor,
               cand: torch.Tensor, k: int, block: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`index_topk_eager` as the operator ``flashserve::index_topk``."""
    return torch.ops.flashserve.index_topk(q, w, pages, table, limit, cand, k, block, n_blocks)


def dense_rows(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`dense_rows_eager` with the CPU's own path, as the operator ``flashserve::dense_rows``."""
    return torch.ops.flashserve.dense_rows(x, panels, n)


__all__ = ["ISAS", "KERNELS", "LANES", "build", "built", "fp8_linear", "fp8_pairs", "fp8_pairs_available",
           "fp8_pairs_eager", "fp8_panels", "fp8_panels_available", "refuse", "refused", "build_wait_s",
           "ATTEND_ROWS_MAX", "ATTEND_ROWS_MIN_WIDTH", "attend_rows",
           "attend_rows_eager", "attend_rows_preferred", "fp8_panels_eager", "fp8_panels_linear", "pack_fp8_panels",
           "STREAM_LANES", "dense_rows", "dense_rows_available", "dense_rows_eager", "index_topk",
           "index_topk_available", "index_topk_eager", "int8_gate_up",
           "int8_linear", "int8_pairs", "int8_pairs_eager", "int8_pairs_preferred", "mxfp4_gate_up", "mxfp4_mapped",
           "mxfp4_pairs",
           "mxfp4_pairs_available", "mxfp4_pairs_eager", "bf16_panels_of_exact", "pack_panels", "pack_stream_panels",
           "sinkhorn",
           "sinkhorn_available", "sinkhorn_eager", "streams"]
