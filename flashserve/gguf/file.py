"""Open a DeepSeek-V4 GGUF (or a split set) with ``gguf.GGUFReader`` and check it before anything heavy.

:func:`open_gguf` returns a :class:`GGUFModel`: the metadata of the first file and every tensor of every split,
with where its bytes lie. It refuses, each with a :class:`GGUFError` naming the file and what is wrong:

* a file that is not a GGUF, or whose header is cut short;
* a tensor whose type id is unknown, or whose type nothing here decodes (named);
* a file shorter than its tensors' extents (truncated);
* a split set with a split missing, or opened by a split other than the first;
* an architecture other than ``deepseek4`` (V4.1 has no GGUF layout in llama.cpp), or a ``deepseek4`` file holding
  only the MTP drafter.

Torch-free: numpy and the ``gguf`` package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

ARCH = "deepseek4"
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# ggml types that hold plain numbers (everything else is a block format decoded with gguf.quants)
PLAIN_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
FLOAT_TYPES = ("F32", "F16", "BF16")
_OTHER_ARCHS = {
    "dflash": "a DSpark/MTP drafter GGUF (llama.cpp's 'dflash'), not a model",
    "clip": "a vision projector (mmproj) GGUF, not a model",
}


class GGUFError(UserError):
    """A GGUF file flashserve cannot load; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a GGUF file: its ggml type, its logical shape in row-major order (the reverse of the GGUF
    dims: ``[out, in]`` for a weight, ``[experts, out, in]`` for stacked experts) and where its bytes lie."""

    name: str
    type_name: str  # ggml type name: F32, BF16, Q8_0, MXFP4, ...
    type_id: int
    shape: tuple[int, ...]
    file: Path
    start: int  # bytes start:end of ``file``
    end: int
    data: Any = field(repr=False, compare=False)  # the reader's numpy view (typed for plain types, bytes otherwise)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class GGUFModel:
    """A GGUF model: its files (the splits in order), the first file's metadata and every tensor by name."""

    path: Path
    files: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, StoredTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        """Metadata ``{arch}.name`` (or a full key when it holds a dot before any ``{``)."""
        return self.metadata.get(name if name.startswith(("general.", "tokenizer.", "split.")) else
                                 f"{self.architecture}.{name}", default)


def _reader_class():
    """``gguf.GGUFReader`` with each tensor's type and extent checked before the reader builds its views (the reader
    itself stops with a bare ValueError at an unknown type id or a view past the file's end)."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # noqa: D401 - the reader's own hook, checked first
            size = len(self.data)
            for f in fields:
                _, name_data, _, dims, raw_dtype, offset = f.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                type_id = int(raw_dtype[0])
                try:
                    qtype = gguf.GGMLQuantizationType(type_id)
                except ValueError:
                    raise GGUFError(f"tensor {name!r} has ggml type id {type_id}, which the gguf package "
                                    f"{_gguf_version()} does not know: cannot decode it") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                count = int(np.prod(dims.astype(np.int64))) if len(dims) else 1
                if len(dims) and int(dims[0]) % block:
                    raise GGUFError(f"tensor {name!r} ({qtype.name}) has rows of {int(dims[0])} values, not a "
                                    f"multiple of its {block}-value blocks")
                end = int(start_offs) + int(offset[0]) + count * type_size // block
                if end > size:
                    raise GGUFError(f"tensor {name!r} ends at byte {end} but the file has {size} bytes "
                                    f"({end - size} missing): the file is truncated")
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - only for a message
        return "(unknown version)"


def _read(path: Path):
    """One file's reader; every failure as a GGUFError naming the file."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFError("reading GGUF files needs the 'gguf' package (llama.cpp's reader): pip install gguf") from None
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = _reader_class()(path, "r")
    except GGUFError as exc:
        raise GGUFError(f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the reader raises plain ValueError/IndexError on a cut header
        raise GGUFError(f"cannot read the GGUF header of {path} ({size} bytes; truncated or corrupt?): "
                        f"{type(exc).__name__}: {exc}") from None
    if getattr(reader, "byte_order", "I") != "I":
        raise GGUFError(f"{path} is a big-endian GGUF; flashserve reads little-endian files only")
    return reader


def _metadata(reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = f.contents()
        except Exception as exc:  # noqa: BLE001
            raise GGUFError(f"cannot read metadata {key!r}: {exc}") from None
    return out


def _tensors(reader, path: Path) -> dict[str, StoredTensor]:
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        start = int(t.data_offset)
        out[t.name] = StoredTensor(t.name, t.tensor_type.name, int(t.tensor_type), shape, path, start,
                                   start + int(t.n_bytes), t.data)
    return out


def split_files(path: Path, count: int) -> list[Path]:
    """The files of a split set of ``count`` files, from its first file's name."""
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        raise GGUFError(f"{path} says it is split {count} ways (split.count) but its name does not end in "
                        f"-00001-of-{count:05d}.gguf, so its other files cannot be found")
    if int(m["no"]) != 1:
        first = path.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        raise GGUFError(f"{path} is split {int(m['no'])} of a set: open the set by its first file, {first}")
    if int(m["count"]) != count:
        raise GGUFError(f"{path} is named as one of {int(m['count'])} splits but its metadata says {count}")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]


def open_gguf(path: str | Path) -> GGUFModel:
    """Open and check a GGUF model (its first file for a split set): see the module docstring."""
    path = Path(path)
    if path.is_file():
        path = path.resolve()
    return _open(path, _stamp(path))


def _stamp(path: Path) -> tuple:
    """Size and modification time of the file and of the other splits of its set: a file changed since it was
    opened is read again."""
    m = _SPLIT_NAME.match(path.name)
    files = [path] if m is None else [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf")
                                      for i in range(1, int(m["count"]) + 1)]
    return tuple((s.st_size, s.st_mtime_ns) if (s := _stat(f)) else None for f in files)


def _stat(path: Path):
    try:
        return path.stat()
    except OSError:
        return None


@lru_cache(maxsize=4)
def _open(path: Path, stamp: tuple) -> GGUFModel:
    m = _SPLIT_NAME.match(path.name)
    if m is not None and int(m["no"]) != 1:
        first = path.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        raise GGUFError(f"{path} is split {int(m['no'])} of {int(m['count'])}: open the set by its first file, {first}")
    if m is not None and not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    reader = _read(path)
    meta = _metadata(reader)
    count = int(meta.get("split.count", 1) or 1)
    files = [path]
    tensors = _tensors(reader, path)
    if count > 1:
        files = split_files(path, count)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise GGUFError(f"{path} is the first of {count} splits, but {len(missing)} of them are missing from "
                            f"{path.parent}: {', '.join(missing)}")
        for i, f in enumerate(files[1:], start=1):
            r = _read(f)
            sm = _metadata(r)
            if int(sm.get("split.no", -1)) != i or int(sm.get("split.count", -1)) != count:
                raise GGUFError(f"{f} says it is split {sm.get('split.no')} of {sm.get('split.count')}, expected "
                                f"{i} of {count} (0-based split.no)")
            for name, t in _tensors(r, f).items():
                if name in tensors:
                    raise GGUFError(f"tensor {name!r} is in both {tensors[name].file.name} and {f.name}")
                tensors[name] = t
        want = meta.get("split.tensors.count")
        if want is not None and int(want) != len(tensors):
            raise GGUFError(f"the {count} splits of {path.name} hold {len(tensors)} tensors; the first says "
                            f"{int(want)} (split.tensors.count)")
    model = GGUFModel(path, files, meta, tensors)
    _check_architecture(model)
    _check_types(model)
    return model


def _check_architecture(model: GGUFModel) -> None:
    arch = model.architecture
    if arch != ARCH:
        what = _OTHER_ARCHS.get(arch, f"architecture {arch!r}")
        raise GGUFError(f"{model.path}: {what} is not supported. flashserve loads DeepSeek-V4 GGUFs in llama.cpp's "
                        f"'{ARCH}' layout (V4-Flash, V4-Pro, as llama.cpp's convert_hf_to_gguf.py writes them); "
                        "DeepSeek-V4.1 has no GGUF layout in llama.cpp: serve its safetensors checkpoint folder")
    if model.key("nextn_predict_layers") and "blk.0.attn_norm.weight" not in model.tensors:
        raise GGUFError(f"{model.path} holds only DeepSeek-V4's MTP drafter (nextn_predict_layers), not the model")


@lru_cache(maxsize=None)
def decodable(type_name: str) -> bool:
    """Whether tensors of this ggml type can be read: plain numbers, or a block format ``gguf.quants`` decodes."""
    if type_name in PLAIN_TYPES:
        return True
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - a decoder that fails on zeros still exists
        return True
    return True


def _check_types(model: GGUFModel) -> None:
    bad = sorted({t.type_name for t in model.tensors.values() if not decodable(t.type_name)})
    if bad:
        names = [t.name for t in model.tensors.values() if t.type_name in bad]
        raise GGUFError(f"{model.path}: tensors of type {', '.join(bad)} cannot be decoded by the gguf package "
                        f"{_gguf_version()} ({len(names)} tensors, e.g. {names[0]!r})")
