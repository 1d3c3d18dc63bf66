"""A graph pass that lets inductor write the cache in place.

A decode step reads each cache ring (window rows, partial compressor groups) and then writes this step's rows
into it. In the functional graph inductor compiles, the write is ``index_put(ring, ...)`` followed by
``ring.copy_(...)`` at the end of the graph, and inductor turns it back into an in-place ``index_put_`` only
when nothing reads ``ring`` after the ``index_put``. Its ``reorder_for_locality`` pass moves every producer
next to its consumer, which puts the ring's gather (consumed late, by attention) after the ``index_put``
(consumed only by the final ``copy_``). Inductor then clones the whole ring before the write and copies it back
after it: on the engine benchmark's peers checkpoint at 16 rows, about 4 MB of rings copied twice a step.

:class:`SinkInputWrites` moves such an ``index_put`` after the last read of the input it updates, which is
where the eager program had it, so the write happens in place. The graph's values are unchanged: only the
order of independent nodes moves.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
WRITES = (aten.index_put.default, aten._unsafe_index_put.default)


def _aliases(base: torch.fx.Node) -> list[torch.fx.Node]:
    """``base`` and every view of it (transitively) in the graph."""
    out, todo = [], [base]
    while todo:
        node = todo.pop()
        out.append(node)
        todo += [u for u in node.users
                 if isinstance(u.target, torch._ops.OpOverload) and u.target.is_view and u.args[0] is node]
    return out


class SinkInputWrites(CustomGraphPass):
    """Moves each functional write of a graph input (``index_put`` whose only user is the ``copy_`` back into
    that input) after the last other node that reads the input, so inductor can reinplace it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in [n for t in WRITES for n in graph.find_nodes(op="call_function", target=t)]:
            base = node.args[0]
            users = list(node.users)
            if base.op != "placeholder" or len(users) != 1:
                continue
            copy = users[0]
            if copy.target is not aten.copy_.default or copy.args[0] is not base:
                continue
            readers = [u for a in _aliases(base) for u in a.users
                       if u is not node and u is not copy and order[node] < order[u] < order[copy]]
            if not readers:
                continue
            last = max(readers, key=order.__getitem__)
            last.append(node)
            order[node] = order[last] + 0.5

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
