"""Safetensors files memory-mapped: checkpoint tensors used where they lie in the file.

A :class:`MappedFiles` maps each file once, read-only and shared (as llama.cpp maps its files: the pages are the
page cache's, shared with every other process mapping the same file, and ``--mlock`` locks those pages rather than
private copies of them), and hands out tensors that are views of the mapping, so a tensor the model holds as
stored costs no copy and no read at load: its pages are read from the disk when first touched, and the kernel may
drop them again under memory pressure. Nothing writes to a loaded weight (a write to a mapped one would fault).
The caller checks each file's length against its header before mapping it
(:func:`flashserve.model.checkpoint._check_length`): touching a mapped page past the end of a file kills the
process with SIGBUS.

:func:`lock_weights` is llama.cpp's ``--mlock``: the weights' pages read in and locked in RAM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# safetensors dtype -> the torch dtype a mapped view takes (FP8 and E8M0 bytes as uint8: the packed formats' own)
DTYPES = {"F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8, "U8": torch.uint8, "I8": torch.int8,
          "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class MappedFiles:
    """Open private memory maps, one per file; alive while any tensor made here is."""

    def __init__(self) -> None:
        self.maps: dict[Path, mmap.mmap] = {}
        self.addresses: dict[Path, int] = {}

    def tensor(self, file: Path, dtype: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor | None:
        """Bytes ``start:end`` of ``file`` as a tensor of ``shape`` (no copy), or None where the dtype has no
        mapped view or the bytes are not aligned to its element size."""
        torch_dtype = DTYPES.get(dtype)
        if torch_dtype is None:
            return None
        size = torch_dtype.itemsize
        if start % size or (end - start) % size:
            return None
        if file not in self.maps:
            with open(file, "rb") as handle:
                self.maps[file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self.addresses[file] = _view(self.maps[file], 1, 0).data_ptr() if len(self.maps[file]) else 0
        if end == start:
            return torch.empty(shape, dtype=torch_dtype)
        return _view(self.maps[file], end - start, start).view(torch_dtype).view(shape)

    def nbytes(self) -> int:
        return sum(len(m) for m in self.maps.values())

    def ranges(self) -> list[tuple[int, int]]:
        """(address, length) of each map."""
        return [(self.addresses[f], len(m)) for f, m in self.maps.items()]


def _view(buffer: mmap.mmap, count: int, offset: int) -> torch.Tensor:
    """Bytes ``offset:offset + count`` of a read-only map as a uint8 tensor (no copy)."""
    with warnings.catch_warnings():  # torch's note that it cannot mark a tensor read-only: nothing writes to it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset)


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


DENSE, EXPERTS, ENGRAM_ROWS = "dense", "routed experts", "engram rows"  # what a weight is, in the order of use


def _part(path: str) -> str:
    if ".experts" in path or path.endswith("experts"):
        return EXPERTS
    if ".engram.embed" in path:
        return ENGRAM_ROWS
    return DENSE


def weight_spans(model: torch.nn.Module, parts: bool = False) -> list:
    """(address, bytes) of the storage of every weight the model holds in host memory, each once: its parameters
    and buffers, the routed experts held one matrix an expert (``mapped_experts.MappedExperts.matrices``) and the
    host's experts of layers split with a GPU (``hybrid.HybridExperts.host``). With ``parts``, (address, bytes,
    part): :data:`DENSE` (read by every token), :data:`EXPERTS` or :data:`ENGRAM_ROWS`."""
    modules = list(model.named_modules())
    hosts = [(name, getattr(m, "host", None)) for name, m in modules]  # a GPU split's host experts (not submodules)
    modules += [(f"{name}.experts", sub) for name, host in hosts if isinstance(host, torch.nn.Module)
                for sub in host.modules()]
    tensors = [(_part(name), t) for name, m in modules
               for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))]
    for name, module in modules:
        for held in getattr(module, "matrices", {}).values():
            tensors += [(EXPERTS, t) for pair in held if pair is not None for t in pair]
    spans: dict[tuple[int, int], str] = {}
    for part, t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            spans.setdefault((storage.data_ptr(), storage.nbytes()), part)
    return [(a, n, p) for (a, n), p in spans.items()] if parts else list(spans)


def mapped_spans(model: torch.nn.Module, parts: bool = False) -> list:
    """:func:`weight_spans` that lie in the model's mapped files (the weights used where they lie)."""
    files = getattr(model, "_mapped_files", None)
    if files is None:
        return []
    maps = files.ranges()
    return [s for s in weight_spans(model, parts) if any(b <= s[0] < b + size for b, size in maps)]


def weights_held(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights ``model`` holds in host memory (:func:`weight_spans`: each storage once, copies made
    for the decode step included): ``total``, and ``mapped``, the part that lies in its mapped files."""
    spans = weight_spans(model)
    files = getattr(model, "_mapped_files", None)
    maps = files.ranges() if files is not None else []
    mapped = sum(n for a, n in spans if any(b <= a < b + size for b, size in maps))
    return {"total": sum(n for _, n in spans), "mapped": mapped}


MADV_DONTNEED = 4


def release_unused(model: torch.nn.Module) -> int:
    """Drop from this process the pages of the model's mapped files that no weight it holds lies in any more (a
    compiled step's weight arenas hold copies of the weights it moved out of the maps): their page-table entries
    go (``madvise(MADV_DONTNEED)``; the files' pages stay in the page cache, and a read of one faults it back in),
    so the process's resident memory counts each weight once. Returns the bytes released; 0 where nothing is
    mapped or madvise is not there."""
    files = getattr(model, "_mapped_files", None)
    if files is None or not files.maps:
        return 0
    try:
        libc = _libc()
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return 0
    page = mmap.PAGESIZE
    used = sorted((a, a + n) for a, n in weight_spans(model))
    released = 0

    def drop(lo: int, hi: int) -> int:  # the whole pages within [lo, hi)
        lo, hi = -(-lo // page) * page, hi // page * page
        ok = hi > lo and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0
        return hi - lo if ok else 0

    for start, size in files.ranges():
        end, cursor = start + size, start
        for a, b in used:
            if b <= cursor:
                continue
            if a >= end:
                break
            if a > cursor:
                released += drop(cursor, a)
            cursor = b
        if cursor < end:
            released += drop(cursor, end)
    return released


MADV_POPULATE_READ = 22  # Linux 5.14: fault pages in, reading those not in the page cache
PAGE_IN_CHUNK = 64 << 20  # bytes a madvise call: the stop flag is looked at between calls


class PageIn:
    """The mapped weights' pages faulted in on a thread of their own, as llama.cpp maps its files with
    ``MAP_POPULATE``: a step no longer pays a page fault a 4 KiB page the first time it reads an expert (about
    1.6 us each on a 2-core VM, tens of milliseconds for a step that reads 100 MB of new experts), and the engine
    does not wait for it (``madvise(MADV_POPULATE_READ)`` through ctypes, which lets go of the GIL). Only where the
    pages fit in the memory the system has available, so that a checkpoint larger than memory is still read as it
    is touched; ``--mlock`` reads and locks them instead."""

    def __init__(self, spans: list[tuple[int, int]], keep=None):
        self.spans, self.total = spans, sum(n for _, n in spans)
        self.keep = keep  # what keeps the spans mapped while the thread runs (the model's MappedFiles)
        self.done = 0  # bytes faulted in so far
        self.seconds: float | None = None  # when finished
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="flashserve-page-in", daemon=True)

    def start(self) -> "PageIn":
        self._thread.start()
        return self

    def run(self) -> None:
        try:
            self._fault_in()
        except Exception as e:  # a thread's exception would only reach threading.excepthook
            self.error = f"{type(e).__name__}: {e}"
        if self.error is not None:
            log.info("mapped weights not paged in ahead (%s): their pages are read as steps touch them", self.error)
        self.keep = None

    def _fault_in(self) -> None:
        libc = _libc()
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        page = mmap.PAGESIZE
        t0 = time.perf_counter()
        for address, nbytes in self.spans:
            start, end = address // page * page, address + nbytes
            while start < end and not self._stop.is_set():
                n = min(PAGE_IN_CHUNK, end - start)
                if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(n), MADV_POPULATE_READ) != 0:
                    self.error = f"madvise(MADV_POPULATE_READ): {os.strerror(ctypes.get_errno())}"
                    return
                start += n
                self.done += n
        self.seconds = time.perf_counter() - t0
        if not self._stop.is_set():
            log.info("mapped weights paged in: %.2f GB in %.1f s, on a thread of their own", self.total / 1e9,
                     self.seconds)

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)


_SAID: set[str] = set()  # the missing system calls already said in the log (once a process)


def _say_once(what: str, message: str, *args) -> None:
    if what not in _SAID:
        _SAID.add(what)
        log.info(message, *args)


MEMINFO = "/proc/meminfo"


def available_memory() -> int | None:
    """The memory the system has available, in bytes: MemAvailable of /proc/meminfo (Linux), else the free pages
    ``sysconf`` counts; None where neither can be read (macOS, Windows), said once in the log."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        _say_once("meminfo", "the available memory cannot be read here (no /proc/meminfo or sysconf's "
                  "SC_AVPHYS_PAGES): weights are paged in ahead only as far as the weight budget says")
        return None


PAGE_IN_SHARE = 0.75  # of the memory available at start-up, the most paged in ahead: the rest is the KV cache's,
# the activations' and the system's


def page_in(model: torch.nn.Module) -> PageIn | None:
    """Start faulting in the pages of the weights ``model`` uses where they lie (:class:`PageIn`) in the order a
    token reads them: the dense weights (every token's), then the routed experts, then the engram tables (a few
    rows a token), up to :data:`PAGE_IN_SHARE` of the available memory (the last span cut to fit); where the
    available memory cannot be read, the dense weights only. None where nothing is mapped. What is paged in, and
    what is left to be read as steps touch it, is said in the log."""
    spans = mapped_spans(model, parts=True)
    total = sum(n for _, n, _ in spans)
    if not total:
        return None
    order = (DENSE, EXPERTS, ENGRAM_ROWS)
    spans.sort(key=lambda s: order.index(s[2]))
    available = available_memory()
    room = int(available * PAGE_IN_SHARE) if available is not None else sum(n for _, n, p in spans if p == DENSE)
    taken, by_part = [], dict.fromkeys(order, 0)
    for address, n, part in spans:
        n = min(n, room)
        if n <= 0:
            break
        taken.append((address, n))
        by_part[part] += n
        room -= n
    done = sum(by_part.values())
    if done < total:
        log.info("mapped weights %.2f GB, of which %.2f GB paged in ahead (%s) within %s: the rest is read as "
                 "steps touch it", total / 1e9, done / 1e9,
                 ", ".join(f"{p} {b / 1e9:.2f} GB" for p, b in by_part.items() if b),
                 f"{PAGE_IN_SHARE:.0%} of the available memory ({available / 1e9:.2f} GB)" if available is not None
                 else "the dense weights (the available memory is unknown here)")
    if not taken:
        return None
    return PageIn(taken, keep=getattr(model, "_mapped_files", None)).start()


def lock_weights(model: torch.nn.Module) -> tuple[int, str | None]:
    """Read every weight's pages into RAM and lock them there (``mlock``), as llama.cpp's ``--mlock``: parameters,
    buffers and the routed experts held one matrix an expert. Returns (bytes locked, None) or (bytes locked before
    the failure, why it failed): a process may lock only ``RLIMIT_MEMLOCK`` bytes unless privileged (``ulimit
    -l``)."""
    try:
        libc = _libc()
        libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    except (OSError, AttributeError) as e:
        return 0, f"mlock is not available here ({e})"
    locked = 0
    for span in weight_spans(model):
        if libc.mlock(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1])) != 0:
            err = ctypes.get_errno()
            try:
                import resource  # POSIX only
                soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            except ImportError:
                limit = "unknown"
            return locked, (f"mlock of {span[1]} bytes failed: {os.strerror(err)} (RLIMIT_MEMLOCK {limit}; "
                            f"raise it with `ulimit -l unlimited`, or run without --mlock)")
        locked += span[1]
    return locked, None


class WeightFileChanged(OSError):
    """A checkpoint file the weights are read from changed in place since it was loaded (its bytes would no
    longer be the loaded model's)."""


class FileReader:
    """Reads byte ranges of checkpoint files into tensors with ``pread`` (through the page cache, not this process's
    mapping: the bytes read are resident only where they are copied to).

    Each file is opened once, when the reader is made at load (``files``) or at its first read, and held open, so
    a file replaced by a rename or deleted while serving is still the file that was loaded (read through the
    descriptor held, as a mapping keeps the pages it maps: the weights stay the loaded model's), which is logged
    once, naming the file. A file changed in place (its size or modification time not what they were when it
    was opened) is refused with :class:`WeightFileChanged` naming it: its bytes would be another model's."""

    def __init__(self, files=()) -> None:
        self.fds: dict[Path, int] = {}
        self.opened: dict[Path, os.stat_result] = {}
        self._said: set[Path] = set()
        self._lock = threading.Lock()
        for f in files:
            self._fd(Path(f))

    def read_into(self, file: Path, start: int, end: int, t: torch.Tensor) -> int:
        """Bytes ``start:end`` of ``file`` into the contiguous CPU tensor ``t`` of exactly that many bytes."""
        n = end - start
        if not t.is_contiguous() or t.numel() * t.element_size() != n or t.device.type != "cpu":
            raise ValueError(f"{file}: {n} bytes cannot be read into a tensor of {t.numel() * t.element_size()} "
                             f"bytes ({'contiguous' if t.is_contiguous() else 'not contiguous'}, {t.device})")
        fd = self.checked(file)
        view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")
        done = 0
        while done < n:
            got = self._pread_into(fd, view[done:], start + done)
            if got <= 0:
                raise WeightFileChanged(f"{file}: read {done} of {n} bytes at offset {start} (truncated since "
                                        "loading?)")
            done += got
        return n

    def _pread_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Read at ``offset`` into ``view``: ``preadv`` where there is one (Linux, macOS), else ``pread`` and a copy,
        else (Windows) a seek and a read under the reader's lock."""
        if hasattr(os, "preadv"):
            return os.preadv(fd, [view], offset)
        if hasattr(os, "pread"):
            data = os.pread(fd, len(view), offset)
        else:
            with self._lock:
                os.lseek(fd, offset, os.SEEK_SET)
                data = os.read(fd, len(view))
        view[:len(data)] = data
        return len(data)

    def checked(self, file: Path) -> int:
        """The descriptor of ``file`` held since it was opened, after checking that the file has not changed in
        place (size, modification time); a file replaced or deleted under its name is said once."""
        fd = self._fd(file)
        was, now = self.opened[file], os.fstat(fd)
        if (now.st_size, now.st_mtime_ns) != (was.st_size, was.st_mtime_ns):
            raise WeightFileChanged(
                f"checkpoint file {file} changed since it was loaded ({was.st_size} bytes, modified "
                f"{time.ctime(was.st_mtime)}; now {now.st_size} bytes, modified {time.ctime(now.st_mtime)}): the "
                "weights read from it would not be the loaded model's; restore it, or restart to load it again")
        if file not in self._said:
            try:
                named = os.stat(file)
                gone = (named.st_ino, named.st_dev) != (was.st_ino, was.st_dev)
            except FileNotFoundError:
                gone = True
            with self._lock:  # reads run on several layers' threads: said once
                first = gone and file not in self._said
                if gone:
                    self._said.add(file)
            if first:
                log.warning("checkpoint file %s was replaced or deleted since it was loaded: the weights are read "
                            "from the file that was loaded (held open); restart to load the new one", file)
        return fd

    def advise(self, file: Path, spans: list[tuple[int, int]]) -> None:
        """Ask the kernel to start reading the byte ranges ``spans`` of ``file`` (``posix_fadvise(WILLNEED)``): many
        small reads then wait on the disk together instead of one after another. Where the call is missing
        (macOS, Windows), nothing (the reads then wait one after another), said once."""
        fd = self._fd(file)
        if not hasattr(os, "posix_fadvise"):
            _say_once("fadvise", "posix_fadvise is not available here: a step's missed rows are read one after "
                      "another")
            return
        for start, end in spans:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def _fd(self, file: Path) -> int:
        fd = self.fds.get(file)
        if fd is None:
            with self._lock:
                if file not in self.fds:
                    fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                    self.opened[file] = os.fstat(fd)
                    self.fds[file] = fd
                fd = self.fds[file]
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __del__(self) -> None:
        self.close()
