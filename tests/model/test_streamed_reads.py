"""Reads of weights streamed under a budget (``weight_memory``) are those of the files that were loaded: a shard
replaced by a rename or deleted while serving is still read as loaded (its descriptor held since loading, as a map
keeps its pages), a shard changed in place is refused naming it, and a read that fails loses no slot of the expert
or row caches (flashserve/model/mapped.py FileReader, expert_cache.py, row_cache.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flashserve.config import load_config
from flashserve.model import row_cache
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.expert_cache import LFU, LFU_HALVING_STEPS, LRU, ExpertCache, expert_caches
from flashserve.model.loader import load_model
from flashserve.model.mapped import WeightFileChanged
from flashserve.model.moe import MoE

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """tiny-v41 as released from another seed: the same files, other weights."""
    path = tmp_path_factory.mktemp("tiny_v41_seed1")
    save_checkpoint(load_model("tiny-v41", with_mtp=False, seed=1).checkpoint_tensors(), path,
                    load_config("tiny-v41"))
    return path


@pytest.fixture
def folder(released_tiny_v41, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(released_tiny_v41, out)
    return out


def _streamed(folder: Path):
    """tiny-v41 under a budget holding two experts of eight a layer, the engram rows streamed too."""
    ref = load_model(folder, with_mtp=False)
    held = {t.untyped_storage().data_ptr(): t for t in list(ref.parameters()) + list(ref.buffers())}
    whole = sum(t.untyped_storage().nbytes() for t in held.values())
    moe = [m for m in ref.modules() if isinstance(m, MoE)]
    expert = sum(t.numel() * t.element_size() for t in moe[0].experts.buffers() if t.dim() == 3) // 8
    model = load_model(folder, with_mtp=False, weight_memory=whole - 6 * 10 * expert)
    assert expert_caches(model) and row_cache.row_caches(model)
    with torch.inference_mode():
        expected = ref(IDS).logits
    return model, expected


def _forward(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_shard_replaced_or_deleted_after_loading_is_still_read_as_loaded(folder, other, how, caplog):
    model, expected = _streamed(folder)
    shard = folder / "model.safetensors"
    if how == "replaced":
        staged = folder / "staged.tmp"
        shutil.copyfile(other / "model.safetensors", staged)
        os.replace(staged, shard)  # as a download tool puts a finished file in place
    else:
        shard.unlink()
    with caplog.at_level("WARNING", logger="flashserve.model.mapped"):
        assert torch.equal(_forward(model), expected)  # every expert and row read here is the loaded file's
    assert f"checkpoint file {shard} was replaced or deleted since it was loaded" in caplog.text
    assert caplog.text.count("was replaced or deleted") == 1  # said once


def _expert_span(shard: Path, name: str) -> tuple[int, int]:
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start, end = header[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def test_a_shard_changed_in_place_is_refused_naming_it_and_no_slot_is_lost(folder):
    model, expected = _streamed(folder)
    shard = folder / "model.safetensors"
    start, end = _expert_span(shard, "layers.0.ffn.experts.7.w1.weight")
    with open(shard, "r+b") as f:  # other bytes where an expert lies: a read of them would be another model's
        f.seek(start)
        f.write(bytes(end - start))
    with pytest.raises(WeightFileChanged, match=rf"checkpoint file {shard} changed since it was loaded \(\d+ bytes, "
                                                r"modified .*; now \d+ bytes, modified .*\): the weights read from it "
                                                r"would not be the loaded model's"):
        _forward(model)
    for cache in expert_caches(model):  # every slot holds an expert or is empty, to be filled by a later miss
        held = [e for e in cache.owner if e >= 0]
        assert len(held) + len(cache.empty) == cache.slots and set(held) == set(cache.recency)
    for cache in row_cache.row_caches(model):  # no tag names a row that was not read
        sets = cache.sets
        assert sets.misses * 17 == sets.bytes_read


class _FakeExperts:
    def __init__(self, slots: int):
        self.n_experts = slots


def _cache(policy: str, slots: int = 2, experts: int = 4, fail: set | None = None) -> tuple[ExpertCache, list]:
    reads = []

    def reader(e: int):
        def read(_experts, name: str, slot: int) -> int:
            if fail and e in fail:
                fail.discard(e)
                raise OSError(f"disk error reading expert {e}")
            reads.append((e, slot))
            return 1
        return read

    cache = ExpertCache(_FakeExperts(slots), experts, {e: {"w1": reader(e)} for e in range(experts)},
                        list(range(slots)), policy)
    return cache, reads


def test_lfu_gives_up_the_least_used_expert_and_lru_the_least_recent():
    for policy, evicted in ((LFU, 1), (LRU, 0)):
        cache, reads = _cache(policy)
        for _ in range(5):
            cache._ensure([0])
        cache._ensure([1])  # 1 used once, after 0's five uses
        cache._ensure([2])
        assert reads == [(2, evicted)]  # LFU keeps the much-used 0; LRU keeps the recent 1
        assert sorted(cache.recency) == sorted({0, 1, 2} - {evicted})


def test_lfu_counts_halve_so_an_expert_used_long_ago_gives_way():
    """Expert 0 used 8 x LFU_HALVING_STEPS times, then 2 and 3 taking turns in the other slot: without the
    halving each would need 16 x LFU_HALVING_STEPS steps to pass 0's count; with it, 0 gives way within a few."""
    cache, reads = _cache(LFU)
    for _ in range(8 * LFU_HALVING_STEPS):
        cache._ensure([0])
    steps = 0
    while 0 in cache.recency:
        cache._ensure([2 + steps % 2])
        steps += 1
        assert steps < 4 * LFU_HALVING_STEPS, "expert 0 kept: its old uses never decayed"
    assert steps > 8  # kept at first: used far more than the others


def test_a_failed_read_leaves_its_slot_empty_and_a_later_miss_fills_it():
    cache, reads = _cache(LRU, fail={3})
    with pytest.raises(OSError, match="disk error reading expert 3"):
        cache._ensure([3])
    assert cache.empty == [0] and cache.owner == [-1, 1] and list(cache.recency) == [1]
    cache._ensure([3])  # read again: the empty slot first, expert 1 kept
    assert reads == [(3, 0)] and cache.owner == [3, 1] and not cache.empty
    assert int(cache.table[3]) == 0


def test_a_failed_row_read_leaves_no_row_named_that_was_not_read():
    calls = []

    def read(rows, slots):
        calls.append(rows.tolist())
        if len(calls) == 1:
            raise OSError("disk error")
        return len(rows)

    sets = row_cache.Sets(4, 4, read)
    with pytest.raises(OSError):
        sets.placed(np.array([10, 20]))
    assert (sets.tags == -1).all()  # nothing claims 10 or 20
    sets.placed(np.array([10, 20]))
    assert calls == [[10, 20], [10, 20]] and sets.misses == 2  # read again, not taken as found


def test_loading_and_streaming_where_linux_only_calls_are_missing(folder, monkeypatch, caplog, tmp_path):
    """macOS has no posix_fadvise and no /proc/meminfo, Windows neither nor preadv, pread or the resource module:
    a budgeted model loads and streams the same logits there, and the log says once what it does without them."""
    import subprocess
    import sys

    from flashserve.model import mapped

    for name in ("posix_fadvise", "preadv", "pread"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.setattr(mapped, "MEMINFO", str(tmp_path / "no-meminfo"))
    monkeypatch.setattr(os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    monkeypatch.setattr(mapped, "_SAID", set())
    with caplog.at_level("INFO", logger="flashserve.model.mapped"):
        model, expected = _streamed(folder)
        assert torch.equal(_forward(model), expected)  # rows missed together: no fadvise; reads: seek and read
        assert mapped.available_memory() is None
        pages = mapped.page_in(model)  # the available memory unknown: the dense weights paged in ahead, only
        pages.stop(timeout=30)
        dense = sum(n for _, n, p in mapped.mapped_spans(model, parts=True) if p == mapped.DENSE)
        assert pages.total == dense > 0
    said = caplog.text
    assert said.count("posix_fadvise is not available here") == 1
    assert "the available memory cannot be read here" in said
    monkeypatch.undo()

    # no resource module (Windows): flashserve imports, loads, and a failed mlock says the limit is unknown
    script = ("import sys; sys.modules['resource'] = None\n"
              "from flashserve.model import mapped\n"
              "from flashserve.model.loader import load_model\n"
              "m = load_model(sys.argv[1], with_mtp=False)\n"
              "class Fail:\n"
              "    def __getattr__(self, name): return self\n"
              "    def __call__(self, *a): return -1\n"
              "mapped._libc = lambda: Fail()\n"
              "print(mapped.lock_weights(m)[1])\n")
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(RLIMIT_MEMLOCK unknown;" in done.stdout


def test_the_next_layer_reads_ahead_the_experts_its_router_picks_from_this_layers_input():
    """Layer A's step starts layer B's guess: B's router applied to A's input picks experts 4 and 5, which B reads
    (into the slots of its least recently used, 0 and 1) while A runs; B's step then finds 4 held (a hit, read
    ahead and used), and 0, which the guess evicted, is a miss: what a wrong guess costs."""
    first, _ = _cache(LRU, slots=2, experts=4)
    second, reads = _cache(LRU, slots=4, experts=6)  # holds 0..3 at first
    seen = []

    class Router(torch.nn.Module):
        def forward(self, x, ids, image):
            seen.append((x.clone(), None if ids is None else ids.clone()))
            return torch.tensor([[4, 5]]), torch.ones(1, 2)

    first.next, first.next_gate = second, Router()
    x, ids = torch.ones(1, 8), torch.tensor([7])
    first.prefetch(torch.tensor([[0, 1]]), x, ids)[1].result()
    x.zero_()  # the caller's buffer reused: the guess reads its own copy
    second.prefetch(torch.tensor([[4, 0]]))[1].result()  # queued after the guess on B's thread
    assert len(seen) == 1 and seen[0][0].sum() == 8 and seen[0][1].tolist() == [7]
    assert [e for e, _ in reads] == [4, 5, 0]  # two read ahead (at most half of four slots), then 0's miss
    assert second.ahead_read == 2 and second.ahead_used == 1
    assert (second.hits, second.misses) == (1, 1)  # the step's own counts: 4 found, 0 read
    counts = second.counts()
    assert counts["read_ahead"] == 2 and counts["read_ahead_used"] == 1
    second.prefetch(torch.tensor([[5, 3]]))[1].result()  # 5, read ahead a step before, is used now
    assert second.ahead_used == 2 and (second.hits, second.misses) == (3, 1)

