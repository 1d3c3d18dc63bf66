"""Engram tables held by a sharded engine stay in host memory: loaded from a checkpoint they are views of the
memory-mapped safetensors files (no copy per rank), gathered per step for the rows needed, and the forward is
unchanged; an expert-parallel rank reads only its own experts."""


import torch

from flashserve.config import load_config
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.loader import load_model
from flashserve.model.engram_host import HostTable, host_engram_tables


def test_tables_memory_mapped_from_the_checkpoint(tmp_path):
    cfg = load_config("tiny-v41")
    save_checkpoint(load_model("tiny-v41", with_mtp=False).checkpoint_tensors(), tmp_path, cfg)  # FP8 tables
    ref = load_model(tmp_path, with_mtp=False, mmap=False)
    model = load_model(tmp_path, with_mtp=False)
    held = host_engram_tables(model)
    tables = [b.engram.embed for b in model.layers if b.engram is not None]
    assert tables and all(isinstance(t, HostTable) for t in tables)
    assert held == sum(t.host_bytes() for t in tables) > 0
    assert not any(".engram.embed." in n for n, _ in model.named_parameters())  # not moved by model.to(device)
    ranges = model._mapped_files.ranges()
    for t in tables:
        ptr = t.table.packed.qweight.data_ptr()
        assert any(a <= ptr < a + n for a, n in ranges)  # the file's pages, not a copy
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_expert_parallel_rank_reads_only_its_experts(tmp_path, monkeypatch):
    """From a checkpoint, an EP rank reads only its own experts' tensors, and ends with the same weights as a
    rank that loaded everything and then kept its slice."""
    from flashserve.model import checkpoint
    from flashserve.config.ranks import Layout
    from flashserve.parallel.shard import keep_rank_experts, shard_model

    cfg = load_config("tiny-v41")
    save_checkpoint(load_model("tiny-v41", with_mtp=False).checkpoint_tensors(), tmp_path, cfg)
    layout = Layout(2, True, 1)
    read: list[str] = []
    get = checkpoint._Handles.get

    def counting(self, stored, index=None):
        read.append(stored.key)
        return get(self, stored, index)

    for rank in range(2):
        whole = shard_model(load_model(tmp_path, with_mtp=False), layout, rank, None)
        read.clear()
        monkeypatch.setattr(checkpoint._Handles, "get", counting)
        part = load_model(tmp_path, with_mtp=False, prepare=lambda m: keep_rank_experts(m, layout, rank))
        monkeypatch.setattr(checkpoint._Handles, "get", get)
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        shard_model(part, layout, rank, None)
        a, b = whole.state_dict(), part.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
