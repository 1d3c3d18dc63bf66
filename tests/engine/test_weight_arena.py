"""A model's weights moved into one buffer per dtype, and compiled graphs that take those buffers instead."""

from __future__ import annotations

import torch
from torch import nn

from flashserve.engine.graphs.graph_call import GraphRecorder
from flashserve.engine.graphs.weight_arena import ALIGN, pack_weights


class Mixed(nn.Module):
    """Float and int8 weights, a transposed (column-major) one, a tied pair and a view sharing a storage."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 24, bias=False)
        self.tied = nn.Linear(40, 24, bias=False)
        self.tied.weight = self.b.weight
        with torch.no_grad():  # from g, not the global generator: the same values whatever ran before
            for t in (self.a.weight, self.a.bias, self.b.weight):
                t.copy_(torch.randn(t.shape, generator=g) / 8)
        self.register_buffer("q", torch.randint(-127, 128, (24, 24), dtype=torch.int8, generator=g))
        self.register_buffer("q_scale", torch.rand(24, generator=g) / 64)
        self.register_buffer("col", torch.randn(24, 16, generator=g).t())  # [16, 24], strides (1, 16)
        base = torch.randn(2, 16, generator=g)
        self.register_buffer("row0", base[0])
        self.register_buffer("row1", base[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        y = self.b(h) + self.tied(h)
        y = (y.unsqueeze(-2) * self.q.to(y.dtype)).sum(-1) * self.q_scale
        return (y.unsqueeze(-2) * self.col).sum(-1) * self.row0 + self.row1


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pack_weights_moves_each_tensor_into_one_buffer_per_dtype_unchanged():
    model = Mixed()
    before, params = _snapshot(model), dict(model.named_parameters())
    strides = {k: v.stride() for k, v in model.state_dict().items()}
    own_start = [k for k, v in model.state_dict().items() if v.storage_offset() == 0]
    arenas = pack_weights(model)
    assert sorted(str(a.dtype) for a in arenas) == ["torch.float32", "torch.int8"]
    homes = {a.untyped_storage().data_ptr(): a for a in arenas}
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, before[name], rtol=0, atol=0)
        assert t.stride() == strides[name]
        assert t.untyped_storage().data_ptr() in homes, name
    assert all(p is params[k] for k, p in model.named_parameters())  # the same Parameter objects, moved
    assert model.b.weight is model.tied.weight  # still tied
    # buffers that were views of one storage still share one, as the same view of it
    assert model.row1.data_ptr() - model.row0.data_ptr() == 16 * 4
    # each storage starts on a cache line, so tensors that started their storage still do
    assert len(own_start) == 8 and all(model.state_dict()[k].data_ptr() % ALIGN == 0 for k in own_start)
    assert pack_weights(model) is arenas  # packed once


def test_parts_are_packed_apart_in_the_order_of_their_modules():
    """With ``parts``, only the tensors under those names move, into buffers of their own; two modules of one
    structure hold each tensor at the same offset of their buffers (a graph compiled for one reads the other)."""
    one, two = Mixed(), Mixed()
    a1, a2 = pack_weights(one, parts=("a", "b")), pack_weights(two, parts=("a", "b"))
    rest = pack_weights(one, parts=("q", "col", "row"))
    assert all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x in a1 for y in rest)
    assert one.a.weight.untyped_storage().data_ptr() == a1[0].untyped_storage().data_ptr()
    assert one.q.untyped_storage().data_ptr() in {r.untyped_storage().data_ptr() for r in rest}
    for name in ("a.weight", "a.bias", "b.weight"):
        assert one.get_parameter(name).storage_offset() == two.get_parameter(name).storage_offset()


def test_graph_takes_the_arenas_instead_of_each_weight():
    """Compiled by inductor through the step's recorder with the arenas, the graph's inputs are the arenas
    and the one input tensor, and its outputs equal the eager model's."""
    model = Mixed().eval()
    x = torch.randn(1, 24, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(x)
        arenas = pack_weights(model)
        recorder = GraphRecorder("inductor", {}, arenas)
        compiled = torch.compile(model, backend=recorder, dynamic=False)
        got = compiled(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (gm, _, args, _), = recorder.calls
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(args) == len(placeholders) == len(arenas) + 1
    assert all(a is b for a, b in zip(args, arenas)) and args[-1] is x


PEAK = """
import re, torch
from torch import nn
from flashserve.engine.graphs.weight_arena import pack_weights
def kb(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
m = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])  # 8 x 16 MiB
with torch.no_grad():
    for p in m.parameters():
        p.fill_(1.0)
before = kb("VmHWM")
pack_weights(m)
print(before, kb("VmHWM"), kb("VmRSS"))
"""


def test_packing_holds_one_storage_at_a_time_beyond_the_model():
    """Each weight's old storage goes as soon as it is copied: packing 128 MiB of weights raises the process's
    peak memory by less than two of its 16 MiB storages, and leaves its resident memory where it was."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True).stdout
    before, peak, after = (int(v) for v in out.split())
    assert peak - before < 2 * 16 * 1024
    assert after < before + 16 * 1024
