"""Safetensors files memory-mapped: checkpoint tensors used where they lie in the file.

A :class:`MappedFiles` maps each file once, privately (copy-on-write: a write changes this process's pages, never
the file), and hands out tensors that are views of the mapping, so a tensor the model holds as stored costs no
copy and no read at load: its pages are read from the disk (or the page cache, shared with every other process
mapping the same file) when first touched, and the kernel may drop them again under memory pressure. The caller
checks each file's length against its header before mapping it (:func:`flashserve.model.checkpoint._check_length`):
touching a mapped page past the end of a file kills the process with SIGBUS.

:func:`lock_weights` is llama.cpp's ``--mlock``: the weights' pages read in and locked in RAM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import resource
import threading
import time
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
                self.maps[file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if end == start:
            return torch.empty(shape, dtype=torch_dtype)
        flat = torch.frombuffer(self.maps[file], dtype=torch.uint8, count=end - start, offset=start)
        return flat.view(torch_dtype).view(shape)

    def nbytes(self) -> int:
        return sum(len(m) for m in self.maps.values())

    def ranges(self) -> list[tuple[int, int]]:
        """(address, length) of each map."""
        return [(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) for m in self.maps.values()]


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def weight_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of the storage of every weight the model holds in host memory, each once: its parameters
    and buffers, the routed experts held one matrix an expert (``mapped_experts.MappedExperts.matrices``) and the
    host's experts of layers split with a GPU (``hybrid.HybridExperts.host``)."""
    modules = list(model.modules())
    hosts = [getattr(m, "host", None) for m in modules]  # a GPU split's host experts (hybrid: not submodules)
    modules += [sub for host in hosts if isinstance(host, torch.nn.Module) for sub in host.modules()]
    tensors = [t for m in modules for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))]
    for module in modules:
        for held in getattr(module, "matrices", {}).values():
            tensors += [t for pair in held if pair is not None for t in pair]
    spans: dict[tuple[int, int], None] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            spans[(storage.data_ptr(), storage.nbytes())] = None
    return list(spans)


def mapped_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """:func:`weight_spans` that lie in the model's mapped files (the weights used where they lie)."""
    files = getattr(model, "_mapped_files", None)
    if files is None:
        return []
    maps = files.ranges()
    return [(a, n) for a, n in weight_spans(model) if any(b <= a < b + size for b, size in maps)]


def weights_held(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights ``model`` holds in host memory (:func:`weight_spans`: each storage once, copies made
    for the decode step included): ``total``, and ``mapped``, the part that lies in its mapped files."""
    spans = weight_spans(model)
    files = getattr(model, "_mapped_files", None)
    maps = files.ranges() if files is not None else []
    mapped = sum(n for a, n in spans if any(b <= a < b + size for b, size in maps))
    return {"total": sum(n for _, n in spans), "mapped": mapped}


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


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def page_in(model: torch.nn.Module) -> PageIn | None:
    """Start faulting in the pages of the weights ``model`` uses where they lie (:class:`PageIn`), or None where
    there are none, or they do not fit in the available memory (said in the log)."""
    spans = mapped_spans(model)
    total = sum(n for _, n in spans)
    if not total:
        return None
    available = available_memory()
    if total > available:
        log.info("mapped weights (%.2f GB) are more than the available memory (%.2f GB): their pages are read as "
                 "steps touch them", total / 1e9, available / 1e9)
        return None
    return PageIn(spans, keep=getattr(model, "_mapped_files", None)).start()


def lock_weights(model: torch.nn.Module) -> tuple[int, str | None]:
    """Read every weight's pages into RAM and lock them there (``mlock``), as llama.cpp's ``--mlock``: parameters,
    buffers and the routed experts held one matrix an expert. Returns (bytes locked, None) or (bytes locked before
    the failure, why it failed): a process may lock only ``RLIMIT_MEMLOCK`` bytes unless privileged (``ulimit
    -l``)."""
    libc = _libc()
    libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    locked = 0
    for span in weight_spans(model):
        if libc.mlock(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1])) != 0:
            err = ctypes.get_errno()
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            return locked, (f"mlock of {span[1]} bytes failed: {os.strerror(err)} (RLIMIT_MEMLOCK {limit}; "
                            f"raise it with `ulimit -l unlimited`, or run without --mlock)")
        locked += span[1]
    return locked, None


class FileReader:
    """Reads byte ranges of files into tensors with ``pread`` (through the page cache, not this process's
    mapping: the bytes read are resident only where they are copied to)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def read_into(self, file: Path, start: int, end: int, t: torch.Tensor) -> int:
        """Bytes ``start:end`` of ``file`` into the contiguous CPU tensor ``t`` of exactly that many bytes."""
        n = end - start
        if not t.is_contiguous() or t.numel() * t.element_size() != n or t.device.type != "cpu":
            raise ValueError(f"{file}: {n} bytes cannot be read into a tensor of {t.numel() * t.element_size()} "
                             f"bytes ({'contiguous' if t.is_contiguous() else 'not contiguous'}, {t.device})")
        fd = self._fd(file)
        view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
        done = 0
        while done < n:
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                raise OSError(f"{file}: read {done} of {n} bytes at offset {start} (truncated since loading?)")
            done += got
        return n

    def advise(self, file: Path, spans: list[tuple[int, int]]) -> None:
        """Ask the kernel to start reading the byte ranges ``spans`` of ``file`` (``posix_fadvise(WILLNEED)``): many
        small reads then wait on the disk together instead of one after another."""
        fd = self._fd(file)
        for start, end in spans:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def _fd(self, file: Path) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(file, os.O_RDONLY)
        return self.fds[file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __del__(self) -> None:
        self.close()
