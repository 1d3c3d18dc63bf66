"""GGUF files of DeepSeek-V4 in llama.cpp's ``deepseek4`` layout, read with llama.cpp's own ``gguf`` package.

* :mod:`.file` opens a file or a split set (``-00001-of-0000N.gguf`` by its first file) and checks it before
  anything is loaded: the architecture, every tensor's type, the files' lengths against the tensors' extents,
  and that every split is present. Torch-free.
* :mod:`.config` builds the :class:`~flashserve.config.ModelConfig` from the file's metadata. Torch-free.
* :mod:`.names` maps GGUF tensor names to the released checkpoint names (the inverse of llama.cpp's
  converter). Torch-free.
* :mod:`.vocab` builds a ``tokenizers`` byte-level BPE from the vocabulary fields. Torch-free.
* :mod:`flashserve.model.gguf_weights` (the model's layer: torch) fills a model: float tensors of the compute
  dtype mapped where they lie, MXFP4 experts repacked into flashserve's MXFP4, everything else decoded at load
  with ``gguf.quants.dequantize``.

DeepSeek-V4.1 has no GGUF layout in llama.cpp, so only V4 (Flash, Pro) GGUFs load.
"""

from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


def is_gguf_path(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; a folder never is)."""
    return str(path).lower().endswith(GGUF_SUFFIX) and not Path(str(path)).is_dir()
