"""Mapped loading: a checkpoint's tensors held as stored are views of the memory-mapped safetensors files (no copy,
no read at load), everything else is copied, the load report says which by part, and the model computes the same
logits as one loaded with ``mmap=False`` (llama.cpp's ``--no-mmap``). ``mlock`` locks the weights in RAM or says
why it could not (flashserve/model/loader.py, flashserve/model/mapped.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashserve.model import checkpoint
from flashserve.model.checkpoint import CheckpointError
from flashserve.model.loader import load_model

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])


@pytest.fixture(scope="module")
def released(released_tiny_v41) -> Path:
    """tiny-v41 in the released storage: FP8 blocks, MXFP4 experts, FP8 engram tables, BF16 embedding and head."""
    return released_tiny_v41


def _mapped_ranges(model) -> list[tuple[int, int]]:
    return model._mapped_files.ranges()


def _in(ranges, t: torch.Tensor) -> bool:
    return any(a <= t.data_ptr() < a + n for a, n in ranges)


def test_tensors_held_as_stored_are_views_of_the_files_and_the_logits_are_those_of_a_copy(released, monkeypatch):
    read: list[str] = []
    get = checkpoint._Handles.get
    monkeypatch.setattr(checkpoint._Handles, "get",
                        lambda self, stored, index=None: read.append(stored.key) or get(self, stored, index))
    mapped = load_model(released, dtype="bfloat16", with_mtp=False)
    monkeypatch.setattr(checkpoint._Handles, "get", get)
    copied = load_model(released, dtype="bfloat16", with_mtp=False, mmap=False)
    with torch.inference_mode():
        assert torch.equal(mapped(IDS).logits, copied(IDS).logits)

    report, plain = mapped.load_report, copied.load_report
    # FP8 attention blocks, FP8 engram tables, the BF16 embedding and head are used where they lie; the routed
    # experts are stacked per layer (a copy); nothing is mapped without mmap, and both loads account for every byte
    assert {"attention", "engram_table", "embed", "head", "shared_expert"} <= report.mapped.keys()
    assert report.copied.keys() == {"routed_expert"} and report.copied["routed_expert"] > 0
    assert plain.mapped == {} and sum(plain.copied.values()) == sum(report.mapped.values()) + report.copied[
        "routed_expert"]
    ranges = _mapped_ranges(mapped)
    attn = mapped.layers[0].attn.wq_a.packed
    assert _in(ranges, attn.qweight) and _in(ranges, attn.scale) and _in(ranges, mapped.embed.weight)
    assert not _in(ranges, mapped.layers[0].ffn.experts.w1_packed.qweight)
    # the loader read only what it copied: the mapped tensors' bytes come from the page faults of their first use
    assert read and all(".ffn.experts." in key for key in read)
    said = report.describe()
    assert said.startswith("weights loaded in ") and " mapped in place (" in said and "routed expert" in said


def _file_maps(folder: Path) -> list[dict[str, str]]:
    """This process's mappings of ``folder``'s files (from /proc/self/smaps): permissions and the kB counts."""
    maps, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                current = {"perms": head[1], "file": head[5] if len(head) > 5 else ""}
                if current["file"].startswith(str(folder)):
                    maps.append(current)
            elif current is not None and head[0].endswith(":") and len(head) >= 2:
                current[head[0][:-1]] = head[1]
    return maps


def test_the_files_are_mapped_read_only_and_shared(released):
    """As llama.cpp maps them: read-only and shared, so the pages are the page cache's (no private copy of a page,
    ever), and nothing the model does writes to them."""
    model = load_model(released, dtype="bfloat16", with_mtp=False)
    x = torch.tensor([[1, 5, 9, 33]])
    with torch.inference_mode():
        model(x)
    maps = _file_maps(released)
    assert maps and all(m["perms"] == "r--s" for m in maps), maps
    assert all(m["Anonymous"] == "0" for m in maps)
    assert _in(_mapped_ranges(model), model.embed.weight)


def test_a_truncated_shard_is_refused_before_it_is_mapped(released, tmp_path):
    """A shard shorter than its header says is refused with the file and both sizes (a mapped page past its end
    would kill the process with SIGBUS when touched)."""
    folder = tmp_path / "cut"
    folder.mkdir()
    for f in released.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    shard = sorted(folder.glob("*.safetensors"))[0]
    whole = shard.stat().st_size
    os.truncate(shard, whole - 4096)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is {whole - 4096} bytes, but its header describes "
                                              rf"{whole} \(4096 missing: truncated\?\)"):
        load_model(folder, with_mtp=False)


_MLOCK = textwrap.dedent("""
    import resource, sys, torch
    from flashserve.model.loader import load_model
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    model = load_model(sys.argv[1], dtype="bfloat16", with_mtp=False, mlock=True)
    held = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in
               list(model.parameters()) + list(model.buffers()) if t.untyped_storage().nbytes()}.values())
    anonymous = 0
    with open("/proc/self/smaps") as f:  # the private copies of the files' pages (none where the maps are shared)
        mapping = False
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                mapping = len(head) > 5 and head[5].startswith(sys.argv[1])
            elif mapping and head[0] == "Anonymous:":
                anonymous += int(head[1])
    print("locked", model.load_report.locked, "of", held, "anonymous", anonymous)
""")


def test_mlock_locks_every_weight_and_copies_no_page(released):
    """Under the process's hard ``RLIMIT_MEMLOCK`` (8 MiB in a default container, more than tiny-v41's weights;
    root is not bound by it) every weight's bytes are locked, the mapped ones as the page cache's pages (a private
    writable map would have copied every page it locked)."""
    done = subprocess.run([sys.executable, "-c", _MLOCK, str(released)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    _, locked, _, held, _, anonymous = done.stdout.split()
    assert int(locked) == int(held) > 0 and "failed" not in done.stderr
    assert int(anonymous) == 0  # the locked pages are the page cache's: no private copy of a mapped page


def test_a_failed_mlock_says_which_limit_stopped_it_and_the_load_goes_on(released, monkeypatch, caplog):
    """``mlock`` refused (ENOMEM: over ``RLIMIT_MEMLOCK``, which binds a process without CAP_IPC_LOCK) is said
    with the limit and how to raise it, and the model loads unlocked."""
    import errno
    import logging
    import resource

    from flashserve.model import mapped

    class Refusing:
        def __init__(self):
            self.mlock = self

        def __call__(self, addr, size):
            ctypes.set_errno(errno.ENOMEM)
            return -1

    monkeypatch.setattr(mapped, "_libc", Refusing)
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    with caplog.at_level(logging.WARNING, logger="flashserve.model.loader"):
        model = load_model(released, dtype="bfloat16", with_mtp=False, mlock=True)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--mlock: mlock of " in said and f"failed: {os.strerror(errno.ENOMEM)} (RLIMIT_MEMLOCK " in said
    assert ("unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes") in said
    assert "ulimit -l unlimited" in said and model.load_report.locked == 0
    with torch.inference_mode():
        assert model(IDS).logits.isfinite().all()


def test_large_mxfp4_experts_are_used_where_they_lie_with_the_stacked_experts_products(released, monkeypatch):
    """Experts from ``MIN_EXPERT_BYTES`` an expert (lowered here to tiny-v41's) are held one matrix an expert, views
    of the files: the loader copies nothing of them, and the logits equal those of the stacked copy, to the bit at
    a decode step's and a short prompt's rows, within float rounding for a long prompt's (the stacked experts loop
    over decoded matrices there); a long prompt's pairs taken a few tokens a kernel call give the same bits."""
    from flashserve.model import mapped_experts

    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)
    stacked = load_model(released, with_mtp=False, mmap=False)
    model = load_model(released, with_mtp=False)
    experts = model.layers[0].ffn.experts
    assert isinstance(experts, mapped_experts.MappedExperts)
    ranges = _mapped_ranges(model)
    assert all(_in(ranges, q) and _in(ranges, s) for name in ("w1", "w2", "w3") for q, s in experts.matrices[name])
    assert "routed_expert" in model.load_report.mapped and "routed_expert" not in model.load_report.copied
    long = torch.randint(0, 500, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for ids in (IDS[:, :1], IDS):
            assert torch.equal(stacked(ids).logits, model(ids).logits)
        whole = model(long).logits
        torch.testing.assert_close(stacked(long).logits, whole, rtol=1e-4, atol=1e-4)
        monkeypatch.setattr(mapped_experts, "PREFILL_TOKENS", 16)
        assert torch.equal(model(long).logits, whole)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_the_weights_used_where_they_lie_are_paged_in_ahead_in_order_of_use_up_to_what_fits(released, monkeypatch,
                                                                                           caplog):
    """What a step would fault in page by page the first time it reads it (the mapped weights, the experts held a
    matrix each among them) is faulted in by PageIn, as llama.cpp's MAP_POPULATE does: the dense weights first,
    then the routed experts, then the engram tables, up to a share of the available memory; where that cannot be
    read, the dense weights; ``--mlock`` covers the experts too."""
    from flashserve.model import mapped, mapped_experts

    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)
    model = load_model(released, with_mtp=False)
    spans = mapped.mapped_spans(model)
    total = sum(n for _, n in spans)
    q, s = model.layers[0].ffn.experts.matrices["w2"][3]
    held = {a for a, _ in spans}
    assert q.untyped_storage().data_ptr() in held and s.untyped_storage().data_ptr() in held
    assert total >= sum(model.load_report.mapped.values())  # every part held where it lies
    before = _rss_file()
    pages = mapped.PageIn(spans)
    pages.run()  # the thread's work, here
    assert pages.error is None and pages.done >= total and pages.seconds is not None
    assert _rss_file() - before >= 0.9 * total

    parts = mapped.mapped_spans(model, parts=True)
    dense = sum(n for _, n, p in parts if p == mapped.DENSE)
    experts = sum(n for _, n, p in parts if p == mapped.EXPERTS)
    assert dense and experts and sum(n for _, n, p in parts if p == mapped.ENGRAM_ROWS)
    # less than every mapped byte available: the dense weights first, then half the experts, no engram rows
    monkeypatch.setattr(mapped, "available_memory", lambda: int((dense + experts // 2) / mapped.PAGE_IN_SHARE) + 4)
    monkeypatch.setattr(mapped.PageIn, "start", lambda self: self)  # its spans looked at, not faulted in
    with caplog.at_level("INFO", logger="flashserve.model.mapped"):
        partial = mapped.page_in(model)
    assert abs(partial.total - (dense + experts // 2)) <= 4
    kind = {a: p for a, _, p in parts}
    firsts = [kind[a] for a, _ in partial.spans]
    assert firsts == sorted(firsts, key=[mapped.DENSE, mapped.EXPERTS].index)  # dense, then experts, nothing else
    assert sum(n for a, n in partial.spans if kind[a] == mapped.DENSE) == dense
    assert "paged in ahead (dense" in caplog.text and "the rest is read as steps touch it" in caplog.text
    monkeypatch.setattr(mapped, "available_memory", lambda: None)  # not readable here (macOS, Windows)
    assert mapped.page_in(model).total == dense
    monkeypatch.undo()
    started = mapped.page_in(model)
    started.stop(timeout=30)
    assert not started._thread.is_alive() and started.total == total


def test_pages_of_weights_moved_out_of_the_maps_leave_the_process(released, monkeypatch):
    """A compiled step's weight arenas copy the mapped weights (engine.graphs.weight_arena): the maps' pages no
    weight lies in any more are released (the process holds each weight once), the ones still used are kept,
    and the logits stay the same."""
    from flashserve.engine.graphs.weight_arena import pack_weights
    from flashserve.model import mapped, mapped_experts

    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)  # experts held where they lie: not in arenas
    model = load_model(released, with_mtp=False)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.inference_mode():
        expected = model(ids).logits
    still = sum(n for _, n in mapped.mapped_spans(model))
    pack_weights(model, skip=tuple(m for m in model.modules() if isinstance(m, mapped_experts.MappedExperts)))
    kept = sum(n for _, n in mapped.mapped_spans(model))
    assert 0 < kept < still  # the experts' matrices stay mapped, the rest was copied
    before = _rss_file()
    released_bytes = mapped.release_unused(model)
    assert released_bytes >= 0.8 * (still - kept)
    assert before - _rss_file() >= 0.5 * (still - kept)  # those pages had been touched by the forward
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)
