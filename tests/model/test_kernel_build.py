"""Building the C++ kernels (flashserve.model.cpu_kernels.build) when several processes start, or one was killed
while building: no start waits forever, a wait is said and bounded, a killed build leaves nothing a later start
loads, and starts at once on an empty extensions folder build once and all load that build. Each start runs in a
process of its own with its own extensions folder ($TORCH_EXTENSIONS_DIR)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("kernel_build")  # the builds share two cores: one worker

ENGINE = """
import logging, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from flashserve.engine import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=1, kv_memory="8MiB", enforce_eager=True, threads=1,
                                speculative_config="off"))
print("up", ",".join(engine.plan.kernels), flush=True)
"""


def _env(tmp_path: Path, **extra) -> dict:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1", **extra}


def _folder(tmp_path: Path) -> Path:
    return tmp_path / "ext" / "flashserve"


def _ready_s(stderr: str) -> float:
    found = re.findall(r"CPU kernels \(native\) ready in ([0-9.]+) s", stderr)
    assert len(found) == 1, stderr[-3000:]
    return float(found[0])


def test_a_killed_build_is_taken_over_and_two_starts_at_once_build_once(tmp_path):
    """A first start killed while it builds (SIGKILL to its process group, as a closed terminal or a CI timeout
    ends it) leaves no library; a library that does not load (here an empty file) is built again; two engines
    started at once both come up: one builds (saying that the killed build did not finish), the other says it waits
    for that one and loads its build, within its build time plus 30 s."""
    env = _env(tmp_path)
    first = subprocess.Popen([sys.executable, "-c", "from flashserve.model import cpu_kernels; cpu_kernels.build()"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    try:
        deadline = time.monotonic() + 120
        while not list(_folder(tmp_path).glob("*.build-*/*.ninja")):
            assert first.poll() is None and time.monotonic() < deadline, "the first build did not start"
            time.sleep(0.1)
        time.sleep(1.0)  # the compiler running
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert not list(_folder(tmp_path).glob("*.so"))  # nothing whole was left to load
    locks = list(_folder(tmp_path).glob("*.lock"))
    assert len(locks) == 1 and f"process {first.pid}" in locks[0].read_text()
    broken = locks[0].with_suffix(".so")  # and a library that does not load (a disk that lost its end)
    broken.write_bytes(b"")

    starts = [subprocess.Popen([sys.executable, "-c", ENGINE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=900) for p in starts]
    finally:
        for p in starts:
            p.kill()
            p.wait()
    for p, (out, err) in zip(starts, outs):
        assert p.returncode == 0 and out.startswith("up ") and "fp8_panels" in out, err[-3000:]
    errs = [err for _, err in outs]
    builders = [e for e in errs if "building them for this CPU" in e]
    assert len(builders) == 1, errs  # one build
    waiter = next(e for e in errs if e is not builders[0])
    assert f"the build by process {first.pid} on " in builders[0] and "did not finish (interrupted)" in builders[0]
    assert f"{broken} does not load" in builders[0]
    assert re.search(r"WARNING CPU kernels: waiting for process \d+ on .*, which is building them", waiter), waiter
    assert _ready_s(waiter) <= _ready_s(builders[0]) + 30
    assert len(list(_folder(tmp_path).glob("*.so"))) == 1 and not list(_folder(tmp_path).glob("*.build-*"))


def test_a_start_waits_for_a_live_builder_saying_so_and_gives_up_after_the_bound(tmp_path):
    """A process holding the build lock (alive: here one that only holds it) is waited for, with one log line
    naming it and the folder, for at most FLASHSERVE_KERNEL_BUILD_WAIT seconds; then the start runs torch's code
    and says so."""
    env = _env(tmp_path)
    name = subprocess.run([sys.executable, "-c", "from flashserve.model import cpu_kernels as c; "
                           "print(c._library_name('native'))"], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    lock = _folder(tmp_path) / f"{name}.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, socket, sys, time
f = open({str(lock)!r}, "a+")
fcntl.flock(f.fileno(), fcntl.LOCK_EX)
f.write(f"process {{os.getpid()}} on {{socket.gethostname()}}\\n"); f.flush()
print("held", flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        script = ("import logging, time; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
                  "from flashserve.model import cpu_kernels as c\n"
                  "t = time.monotonic(); assert c.build() is None and c.built() == []\n"
                  "print(round(time.monotonic() - t, 1))")
        done = subprocess.run([sys.executable, "-c", script], env={**env, "FLASHSERVE_KERNEL_BUILD_WAIT": "3"},
                              capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    waited = float(done.stdout.strip())
    assert 3 <= waited < 3 + 5, waited  # the bound, and a few polls past it
    lines = done.stderr.splitlines()
    said = [line for line in lines if line.startswith("WARNING CPU kernels: waiting for")]
    assert said == [f"WARNING CPU kernels: waiting for process {holder.pid} on {os.uname().nodename}, which is "
                    f"building them ({lock.parent})"], lines
    assert any(line.startswith("WARNING CPU kernels (native): waited 3 s for another process's build") and
               "running torch's code without them" in line for line in lines), lines


@pytest.mark.parametrize("value, seconds, warned", [("", 900.0, False), ("3", 3.0, False), ("0", 0.0, False),
                                                    ("15m", 900.0, True), ("nan", 900.0, True), ("-1", 900.0, True)])
def test_the_wait_bound_is_read_when_a_build_waits_and_a_bad_value_is_named(value, seconds, warned, monkeypatch,
                                                                            caplog):
    from flashserve.model import cpu_kernels

    monkeypatch.setenv("FLASHSERVE_KERNEL_BUILD_WAIT", value)
    with caplog.at_level(logging.WARNING, logger="flashserve"):
        assert cpu_kernels.build_wait_s() == seconds
    said = [r.getMessage() for r in caplog.records]
    assert said == ([f"FLASHSERVE_KERNEL_BUILD_WAIT={value!r} is not a number of seconds (0 or more); waiting at "
                     "most 900 s"] if warned else [])


def test_a_filesystem_that_cannot_lock_builds_without_a_lock(tmp_path, monkeypatch, caplog):
    """Some NFS and FUSE mounts refuse flock (ENOLCK): the build goes on unlocked, saying so, instead of failing."""
    import errno

    from flashserve.model import cpu_kernels

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cpu_kernels.fcntl, "flock", refuse)
    with caplog.at_level(logging.WARNING, logger="flashserve"):
        with cpu_kernels._BuildLock(tmp_path / "k.lock", 5) as held:
            assert held and not held.exclusive
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU kernels: {tmp_path / 'k.lock'} cannot be locked here ([Errno {errno.ENOLCK}] No locks available); "
        "building without a lock"]
