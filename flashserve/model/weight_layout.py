"""Memory layouts of float weights chosen for the decode step's matmul kernels (values unchanged).

A vocabulary-sized projection (the LM head, DSpark's Markov head) is a tall, narrow matrix [V, D]. torch's CPU
``F.linear(x, W)`` over it at one row runs at about half the memory bandwidth when ``W`` is stored row-major;
stored column-major (``W.t()`` contiguous, so ``F.linear`` multiplies by a contiguous [D, V]) the same product
reads the same bytes twice as fast. Measured with 1 and 2 threads, float32, median of 15 (AMD EPYC, AVX2):
32000x512 5.2-7.0 -> 2.9-3.3 ms at one row, 129280x64 3.2-4.2 -> 1.45 ms; square and moderately tall matrices
(16384x2048, 512x128) within noise; bfloat16 column-major is 4-40x *slower* (no fast kernel), so only float32
is converted. At one row the head is most of the step's matmul time (5.2 of 6.6 ms on the benchmark's peers
checkpoint). The engine converts only for an eager decode step: a compiled CPU step multiplies one row by its
own reduction kernel (:func:`flashserve.model.blas.reduce_linear`), which reads a row-major head faster
(32000x512 in one graph, 2 threads: 1.9-2.0 ms row-major against 2.9-3.1 column-major).

A compiled one-row step on a CPU whose int8 products take flashserve's kernel multiplies the int8 weights of one
input in one call (:func:`join_int8_rows`): their rows stored one after another, the layers' own weights views of
them, no bytes added.

A compiled CPU step of several rows (a batch, or speculative verification) multiplies its float32 weights
through copies in column panels made once at start-up (:func:`prepack_for_rows`,
:func:`flashserve.model.blas.make_panels`): torch's ``mm`` repacks the weight inside MKL on every call (the LM
head at 16 rows, 2 threads: 8.8 ms against 1.7). The weights a layer multiplies one input by share one copy,
multiplied in one call. The copies cost the weights' bytes again. Eager and one-row steps keep the float32
weights as they are, except where a copy is bfloat16 (a bf16 checkpoint's LM head in a float32 engine: half the
bytes of the weight), which every decode row reads; an eager engine makes such copies of its large bf16 weights
too (:func:`bf16_panels_for_decode`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import blas, cpu_kernels, packed

TALL_RATIO = 16  # rows per column from which a float32 CPU weight is stored column-major
TALL_MIN_ELEMENTS = 1 << 20  # smaller matrices stay as they are (the difference is within noise there)


def is_tall(w: torch.Tensor) -> bool:
    """Whether ``w`` is a float32 CPU matrix the decode step multiplies faster column-major."""
    return (w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.shape[0] >= TALL_RATIO * w.shape[1] and w.numel() >= TALL_MIN_ELEMENTS)


@torch.no_grad()
def column_major_tall_weights(model: nn.Module) -> list[str]:
    """Store every tall float32 ``nn.Linear`` weight of ``model`` column-major, in place (same shape and values,
    strides ``(1, V)``); returns the converted parameters' names. A weight shared with an embedding stays
    row-major (lookups read its rows), and so does one with bfloat16 panels (:func:`bf16_panels_for_decode`: its
    decode rows read those). Only ``nn.Linear`` parameters are looked at: a packed module's ``weight`` decodes
    its whole matrix when read (V4.1-Flash's FP8 layers: seconds of start-up)."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    done = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or blas.panels(mod, "weight") is not None:
            continue
        w = mod._parameters.get("weight")
        if (isinstance(w, torch.Tensor) and id(w) not in shared and is_tall(w)
                and w.stride() != (1, w.shape[0])):
            w.data = w.t().contiguous().t()
            done.append(f"{name}.weight" if name else "weight")
    return done


def bf16_panels_for_decode(model: nn.Module, held_only: bool = False) -> list[str]:
    """Give the large float32 weights of ``model``'s modules (their ``ROW_WEIGHTS``) whose values bfloat16 holds
    (a bf16 checkpoint's LM head read into a float32 engine) bfloat16 panels that an eager step's decode rows
    read (:func:`flashserve.model.blas.make_bf16_panels`): half the bytes to stream. Returns the panels' names
    (``<weight>_panels``); in a float32 model, also those held in bfloat16 as the checkpoint stores them
    (``loader.hold_as_stored``), and with ``held_only`` only those (a compiled step's products read them too)."""
    done = []
    stored = getattr(model, "dtype", None) == torch.float32
    for name, mod in model.named_modules():
        for w in getattr(mod, "ROW_WEIGHTS", ()):
            weight = getattr(mod, w, None)
            if held_only and not (stored and isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16):
                continue
            if blas.make_bf16_panels(mod, w, stored_bf16=stored):
                done.append(_full(name, w + blas.PANELS))
    return done


def prepack_for_rows(model: nn.Module) -> list[str]:
    """Give the float32 CPU weights that ``model``'s modules multiply several rows by panel copies for compiled
    steps: the weights a module multiplies one input by (its ``joint_row_weights()``) one joined copy per input
    (:func:`flashserve.model.blas.make_joint_panels`), every other weight of a module's ``ROW_WEIGHTS`` its own
    (:func:`flashserve.model.blas.make_panels`). Returns the names of the weights copied."""
    done, joined = [], set()
    for name, mod, group, paths in _input_groups(model):
        if blas.make_joint_panels(mod, group, paths):
            names = [_full(name, p) for p in paths]
            done += names
            joined.update(names)
    for name, mod in model.named_modules():
        for w in getattr(mod, "ROW_WEIGHTS", ()):
            full = _full(name, w)
            if full not in joined and blas.make_panels(mod, w):
                done.append(full)
    return done


def join_int8_rows(model: nn.Module) -> list[str]:
    """Give the int8 weights ``model``'s modules multiply one input by (their ``joint_row_weights()``) one tensor
    of rows per input (:func:`flashserve.model.packed.join_int8_rows`), where compiled one-row steps multiply int8
    weights through the kernel (:func:`~flashserve.model.cpu_kernels.int8_pairs_preferred`). Returns the names of
    the weights joined."""
    if not cpu_kernels.int8_pairs_preferred():
        return []
    done = []
    for name, mod, group, paths in _input_groups(model):
        if packed.join_int8_rows(mod, group, paths):
            done += [_full(name, p) for p in getattr(mod, group + blas.INT8_JOINT + "_of")[0]]
    return done


def _input_groups(model: nn.Module):
    """(module name, module, input, weight paths) of every group a module's ``joint_row_weights()`` names."""
    for name, mod in model.named_modules():
        for group, paths in getattr(mod, "joint_row_weights", dict)().items():
            yield name, mod, group, paths


def _full(name: str, path: str) -> str:
    return f"{name}.{path}" if name else path
