"""The reads of weights streamed under a budget, as custom operators a compiled step calls like any kernel.

An :class:`~flashserve.model.expert_cache.ExpertCache` must see the router's choice on the host (which experts
are missing, read them into slots, map the choice to slots), and a
:class:`~flashserve.model.row_cache.RowCache` the rows a step gathers. Behind a custom operator that work is one
opaque call in the traced graph (dynamo does not trace it, inductor calls it between its own kernels), so a decode
step under ``weight_memory`` stays compiled, the expert and row caches being the one part that runs on the host:

- ``flashserve::experts_start(idx, x, ids, key)``: start reading the experts ``idx`` [T, k] routes to that the
  layer does not hold (a background thread), and the next layer's guess from its router on this layer's input
  ``x`` [T, D] (tokens ``ids`` [T]); returns a token the next call takes, so the two stay in order while the
  shared expert's products run between them;
- ``flashserve::experts_run(x, idx, w, token, key)``: wait for those reads, then the routed experts' sum [T, D];
- ``flashserve::rows_gather(ids, key, like)``: the table's rows ``ids`` [...] -> [..., dim] of ``like``'s dtype.

``key`` is a one-element int64 tensor a layer's module holds (:func:`key_of`): a compiled graph traced through one
layer is called with each layer's own tensors in its place (engine.graphs.regions), so the cache it reaches
is named by a tensor, never by a constant of the trace. The caches are held weakly: a model's caches go with it.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from . import modes

_CACHES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def key_of(cache: object) -> torch.Tensor:
    """A new key tensor naming ``cache`` for the operators (held by the module the cache serves)."""
    key = next(_NEXT)
    _CACHES[key] = cache
    return torch.tensor([key], dtype=torch.int64)


def _cache(key: torch.Tensor):
    cache = _CACHES.get(int(key[0]))
    if cache is None:
        raise RuntimeError(f"no streamed-weight cache has key {int(key[0])} (its model was freed)")
    return cache


@torch.library.custom_op("flashserve::experts_start", mutates_args=())
def experts_start(idx: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    _cache(key).start(idx, x, ids)
    return torch.zeros(1, dtype=torch.int64)


@experts_start.register_fake
def _(idx, x, ids, key):
    return idx.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("flashserve::experts_run", mutates_args=())
def experts_run(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, token: torch.Tensor,
                key: torch.Tensor) -> torch.Tensor:
    with modes.running(modes.EAGER), torch.inference_mode():
        return _cache(key).finish(x, idx, w)


@experts_run.register_fake
def _(x, idx, w, token, key):
    return x.new_empty(x.shape)


@torch.library.custom_op("flashserve::rows_gather", mutates_args=())
def rows_gather(ids: torch.Tensor, key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    with modes.running(modes.EAGER), torch.inference_mode():
        return _cache(key).gather(ids).to(like.dtype)


@rows_gather.register_fake
def _(ids, key, like):
    return ids.new_empty((*ids.shape, like.shape[-1]), dtype=like.dtype)
