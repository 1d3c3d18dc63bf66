"""The sharded engine: one process per rank, rank 0 driving.

Every rank holds a whole :class:`~flashserve.engine.llm_engine.LLMEngine` over its shard of the model, so the
lead's engine code (scheduler, cache, sampler, speculative decoding) runs unchanged on every rank:

* TP / EP (one DP group): the engines are replicas. Rank 0 validates each API call (``add_request``,
  ``abort_request``, ``step``, an attribute the server sets) on its own engine and sends it, with its
  arguments, to every worker, which applies it to its replica: the same inputs in the same order give the same
  schedule, the same cache writes and (with the same seeds and all-reduced logits) the same sampled tokens.
  This is the step's metadata: the requests that arrived and the order to step, not the derived schedule.
  Each step the workers answer with a digest of the tokens they produced; a digest that differs from rank
  0's ends the engine ("rank r diverged").
* Attention DP (with EP): each rank's engine holds its own requests and cache. Rank 0 balances new requests
  over the ranks (fewest unfinished), sends each step to every rank, and merges the outputs; the ranks meet
  only in the MoE, kept in lock step by :meth:`~.comm.Comm.sync_idle`.

Processes: on one node rank 0 spawns ``world - 1`` workers, each a fresh interpreter (:class:`WorkerProcess`,
as multiprocessing's ``spawn``, which vLLM's multiprocessing executor uses once threads or CUDA are initialised)
that inherits nothing of rank 0's process state: not the running OpenMP thread pool of an engine that already ran
(a process forked while that pool runs can hang in its first parallel op), not a CUDA context, not the caller's
``__main__`` (which is never re-run). Each worker imports torch and flashserve itself, the price of a fresh
interpreter at start-up. Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
every process is started by torchrun and ranks other than 0 serve as workers.

Failure: a worker that dies is seen at once (its sockets close); one that hangs, after ``worker_timeout``
seconds (once the engine is up, every wait of rank 0 on a worker and every model collective is bounded by it).
Start-up is bounded by ``startup_timeout`` instead, since loading a large checkpoint's shard takes minutes: the
rendezvous of the ranks, then, from there, every worker building its engine and answering "ready". A worker that
is not ready in time is named with what it last noted it was doing (:meth:`~.comm.Comm.note_startup`). Either way
the engine raises :class:`WorkerFailure` naming the rank, kills the workers it spawned and refuses further calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref

import torch

from ..config import ConfigError
from .comm import JOINING, Comm, connect, startup_note
from ..config.ranks import Layout, layout_of
from ..model.engram_host import host_engram_tables
from .shard import keep_rank_experts, shard_model

log = logging.getLogger("flashserve.parallel")


class WorkerFailure(RuntimeError):
    """A worker died, hung or diverged: the sharded engine cannot go on."""

    fatal = True  # the server's engine loop stops (and /health turns unhealthy) instead of serving on


def torchrun_env() -> dict | None:
    """Rank, world size, local rank and rendezvous of a process started by ``torchrun``; None otherwise."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "addr": os.environ["MASTER_ADDR"],
            "port": int(os.environ["MASTER_PORT"]),
            "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"}


def _listening_socket() -> socket.socket:
    """The store's socket, bound to a port the system picks and listening before any worker starts: rank 0's
    store is built on it (``master_listen_fd``), so no other process can take the port between choosing it and
    binding it, as happened with a port found free, closed, then bound again."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def _ranks_here(layout: Layout) -> int:
    """Ranks on this machine: torchrun's local world, else every rank (spawned here)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if torchrun_env() is not None and local.isdigit() else layout.world


def _device(config, local_rank: int) -> torch.device:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} asked but CUDA is not available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_rank_engine(config, layout: Layout, rank: int, comm: Comm):
    """One rank's engine: the model built whole on the host (a preset's seeded weights are equal on every
    rank), this rank's slices kept, then moved to its device. A worker notes each stage (rank 0 names the stage
    of a worker that is not ready in time)."""
    from ..engine.llm_engine import LLMEngine
    from ..engine.threads import set_threads
    from ..model.loader import load_model, resolve_dtype

    threads = set_threads(config.threads, ranks=_ranks_here(layout))  # the default: this rank's share of the cores
    device = comm.device
    dtype = torch.float64 if config.dtype in ("float64", "fp64") else resolve_dtype(config.dtype)
    from ..engine.spec_config import SpeculativeConfig

    spec = SpeculativeConfig.parse(config.speculative_config, config.model)  # drafters as LLMEngine builds them
    # a checkpoint: an EP rank reads only its experts' tensors (presets draw every weight, the same on each rank)

    def prepare(m) -> None:
        keep_rank_experts(m, layout, rank)

    comm.note_startup("loading its shard of the model")
    model = load_model(config.model, dtype=dtype, device="cpu", fake_quant=config.fake_quant,
                       with_mtp=spec is not None and spec.method in ("mtp", "dspark"), quantization=config.quantization,
                       prepare=prepare, mmap=config.mmap, mlock=config.mlock)
    comm.note_startup("sharding the model")
    shard_model(model, layout, rank, comm)
    host_engram_tables(model)  # engram tables stay in host memory (memory-mapped from a checkpoint: --mmap)
    comm.note_startup(f"moving its shard to {device}")
    model.to(device)
    comm.note_startup("building its LLMEngine (KV cache, decode step)")
    # collectives run eagerly: the compiled decode step does not trace this module's process-group calls; the
    # threads as set above (LLMEngine sets them again, and its default is every core, not this rank's share)
    cfg = dataclasses.replace(config, device=str(device), enforce_eager=True, threads=threads)
    return LLMEngine(cfg, model=model, warm_up=False)  # once every rank is ready: ShardedEngine.__init__


def _digest(outputs) -> str:
    h = hashlib.blake2b(digest_size=16)
    for o in outputs:
        h.update(repr((o.request_id, o.finished, [(c.index, list(c.token_ids), c.finish_reason)
                                                   for c in o.outputs])).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- workers
def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:  # the engine process is gone: no orphan worker
            os._exit(3)


def worker_main(config, rank: int, local_rank: int, addr: str, port: int, parent_pid: int | None,
                agent_store: bool = False) -> int:
    """A worker's life: join the groups, build its engine, then apply rank 0's commands until ``stop``."""
    layout = layout_of(config)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    comm = connect(layout, rank, addr, port, _device(config, local_rank), config.worker_timeout,
                   host_store=not agent_store, startup_timeout=config.startup_timeout)
    try:
        comm.note_startup("building its engine")
        engine = build_rank_engine(config, layout, rank, comm)
    except Exception as e:
        comm.send_reply(("error", f"rank {rank} failed to start: {type(e).__name__}: {e}"))
        return 1
    comm.send_reply(("ready", None))
    dp = layout.dp > 1
    while True:
        cmd = comm.recv_command()
        op = cmd[0]
        if op == "stop":
            comm.send_reply(("ok", None))
            return 0
        try:
            if op == "step":
                outs = engine.step()
                if dp:
                    comm.sync_idle()
                # a DP group's first TP rank answers with its outputs; its TP replicas with their digest
                leader = dp and layout.tp_rank(rank) == 0
                reply = (outs, engine.stats()) if leader else _digest(outs)
            elif op == "add":
                target, args = cmd[1], cmd[2:]
                if target is None or target == layout.dp_rank(rank):
                    engine.add_request(*args[:3], images=args[3])
                reply = None
            elif op == "abort":
                target, rid = cmd[1], cmd[2]
                if target is None or target == layout.dp_rank(rank):
                    engine.abort_request(rid)
                reply = None
            elif op == "setattr":
                setattr(engine, cmd[1], cmd[2])
                reply = None
            elif op == "warm_up":
                engine.runner.decode_step.warm_up()
                reply = None
            elif op == "ping":
                reply = None
            elif op == "counters":
                reply = comm.reset_counters()
            else:
                raise RuntimeError(f"unknown command {op!r}")
        except Exception as e:  # a request error (DP target) or a bug: rank 0 decides
            comm.send_reply(("error", e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
            continue
        comm.send_reply(("ok", reply))


def _picklable(e: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


def _spawned_worker(config, rank: int, addr: str, port: int, parent_pid: int) -> None:
    """The life of a worker that rank 0 spawned (:class:`WorkerProcess`): ends the process with its status."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        code = worker_main(config, rank, rank, addr, port, parent_pid)
    except Exception as e:  # rank 0 gone or the groups broken: nothing to answer to
        print(f"flashserve worker rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The spawned interpreter's program: rank 0's ``sys.path``, then the pickled target and its arguments, on stdin.
# Only the standard library is imported before ``sys.path`` is rank 0's.
# ``-P``: no cwd before the standard library while the program reads its input. A worker ignores SIGINT: a
# terminal's Ctrl-C reaches the whole process group, and rank 0 ends its workers itself.
_BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "import pickle, sys; path, blob = pickle.load(sys.stdin.buffer); sys.path[:] = path; "
         "from flashserve.parallel.executor import _run_spawned; _run_spawned(blob)")
_ORIGINAL_DIR = os.getcwd()  # what an empty sys.path entry meant when flashserve was imported (as multiprocessing)


def _run_spawned(blob: bytes) -> None:
    code = 1
    try:
        target, args = pickle.loads(blob)
        target(*args)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter shutdown: a worker's threads and groups end with the process


class WorkerProcess:
    """A worker in a fresh interpreter (``python -c``), started as multiprocessing's ``spawn`` would start it but
    without re-running the caller's ``__main__`` (a script that makes a sharded engine needs no
    ``if __name__ == "__main__"`` guard) and without multiprocessing's resource-tracker process: ``target(*args)``,
    both pickled here (an option that cannot be pickled fails here, before any process starts). The part of
    ``multiprocessing.Process`` the engine uses: ``pid``, ``name``, ``exitcode`` (negative: killed by that
    signal), ``kill``, ``join``."""

    def __init__(self, target, args: tuple, name: str):
        blob = pickle.dumps((target, args))
        self.name = name
        self._proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT], stdin=subprocess.PIPE)
        self.pid = self._proc.pid
        path = [p or _ORIGINAL_DIR for p in sys.path]  # "": the directory flashserve was imported from
        try:
            with self._proc.stdin:
                self._proc.stdin.write(pickle.dumps((path, blob)))
        except OSError:  # it ended before reading (its exit code says how)
            pass

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def kill(self) -> None:
        self._proc.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"


def _release_rendezvous(layout: Layout, addr: str, port: int) -> None:
    """Mark every rank arrived at the store at ``addr:port``, so that rank 0's rendezvous thread stops waiting
    there for workers that will not come (it then fails in the groups' own rendezvous, within the worker timeout,
    and ends with its store) instead of holding the store's port for the rest of the startup timeout."""
    import datetime

    import torch.distributed as dist

    from .comm import _arrived_key

    try:
        client = dist.TCPStore(addr, port, layout.world, False, timeout=datetime.timedelta(seconds=5),
                               wait_for_workers=False)
        for r in range(layout.world):
            client.set(_arrived_key(r), "1")
    except Exception:  # noqa: BLE001  (the store is gone already: nothing waits on it)
        pass


# ---------------------------------------------------------------------------------------------- rank 0
def _heartbeat(ref, interval: float) -> None:
    """While the engine is idle, ping the workers every ``min(timeout / 2, 5)`` seconds, so a worker that dies or
    hangs between requests is found (and the server's /health turns unhealthy) within ``timeout`` plus that
    interval; steps and requests find it themselves. Holds the engine only by a weak reference: the thread ends
    when the engine is collected or stopped."""
    while True:
        time.sleep(interval)
        engine = ref()
        if engine is None or engine.failure is not None:
            return
        engine._beat()
        del engine


def _stop_workers(comm, procs, world: int, wait: float, lock) -> None:
    """The finalizer of a :class:`ShardedEngine` that was not shut down (collected, or the interpreter exits): tell
    the workers to stop, kill those that do not answer."""
    if lock.acquire(timeout=wait):
        try:
            saved, comm.timeout = comm.timeout, wait
            comm.send_command(("stop",))
            for r in range(1, world):
                comm.recv_reply(r)
            comm.timeout = saved
            for p in procs:  # they answered: let them exit (status 0) before killing any that do not
                p.join(wait)
        except Exception:
            pass
        finally:
            lock.release()
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(10)


class ShardedEngine:
    """Rank 0's engine over ``world`` ranks: the :class:`~flashserve.engine.interface.Engine` interface, each
    call sent to every rank that takes part. ``local`` is rank 0's own :class:`LLMEngine` (its scheduler, cache
    and counters are rank 0's alone)."""

    def __init__(self, config):
        from ..engine import preflight

        layout = layout_of(config)
        preflight.check(config)  # every option and the layout's sizes, before any process starts
        self.layout = layout
        self.timeout = float(config.worker_timeout)
        self.failure = None
        self.procs = []
        self.startup_timeout = float(config.startup_timeout)
        self.owner = {}  # DP: request id -> DP group
        self.nseq = {}  # DP: request id -> its sequences (SamplingParams.n)
        self.load = [0] * layout.dp  # DP: unfinished sequences per DP group (the sum of nseq over its requests)
        self._stats = {}
        self.exit_on_failure = False
        env = torchrun_env()
        self._env = env
        listener = None
        device = _device(config, env["local_rank"] if env else 0)
        if env is not None:
            if env["world"] != layout.world:
                raise ConfigError(f"torchrun started {env['world']} processes but {layout.describe()} needs "
                                  f"{layout.world}")
            addr, port, agent = env["addr"], env["port"], env["agent_store"]
        else:
            listener = _listening_socket()
            addr, port, agent = "127.0.0.1", listener.getsockname()[1], False
        try:
            if env is None:
                for r in range(1, layout.world):
                    self.procs.append(WorkerProcess(_spawned_worker, (config, r, addr, port, os.getpid()),
                                                    name=f"flashserve-rank{r}"))
            comm = self._connect(layout, addr, port, device, agent, listener)
            self.comm = comm
            ready_by = time.monotonic() + self.startup_timeout  # every worker, from the rendezvous on
            self.local = build_rank_engine(config, layout, 0, comm)
            for r in range(1, layout.world):
                try:
                    status, msg = self._recv(r, max(ready_by - time.monotonic(), 0.1))
                except Exception as e:
                    raise WorkerFailure(f"{layout.describe()}: start-up failed: {self._not_ready(r, e)}") from e
                if status != "ready":
                    raise WorkerFailure(msg)
        except BaseException as e:
            self._kill_workers()
            if listener is not None and listener.fileno() != -1:  # no worker was started to meet at it
                listener.close()
            if isinstance(e, (WorkerFailure, ConfigError)):
                raise
            raise WorkerFailure(f"{layout.describe()}: start-up failed: {self._who(e)}") from e
        with self.local.lock:  # every rank's first steps together (their collectives), before serving
            _, replies = self._command(("warm_up",), self.local.runner.decode_step.warm_up)
            self._check(replies, "warming up")
        self.local.plan.finish()
        log.info(self.local.plan.describe())
        self._log_startup()
        # workers told to stop at exit or when this engine is collected (torchrun sees them exit 0), not left
        # waiting; a finalizer, not atexit.register(self.shutdown), so the engine is not kept alive until exit
        self._finalizer = weakref.finalize(self, _stop_workers, self.comm, self.procs, self.layout.world,
                                           min(self.timeout, 10.0), self.local.lock)
        threading.Thread(target=_heartbeat, args=(weakref.ref(self), max(0.2, min(self.timeout / 2, 5.0))),
                         name="flashserve-heartbeat", daemon=True).start()

    # ------------------------------------------------------------------ start-up
    def _connect(self, layout, addr, port, device, agent, listener: socket.socket | None) -> Comm:
        """Join the groups while watching the spawned workers: one that dies while starting ends the wait, and
        so does ``startup_timeout`` (the ranks' wait at the store, with a second's grace for it to answer first),
        naming the workers that did not join and what they last noted. ``listener``: the store's bound socket,
        handed over to the store (which closes it)."""
        box: dict = {}

        def run():
            try:
                box["comm"] = connect(layout, 0, addr, port, device, self.timeout, host_store=not agent,
                                      startup_timeout=self.startup_timeout,
                                      listen_fd=listener.detach() if listener is not None else None,
                                      on_store=lambda store: box.__setitem__("store", store))
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name="flashserve-rendezvous", daemon=True)
        t.start()
        give_up = time.monotonic() + self.startup_timeout + 1.0
        try:
            while t.is_alive() and time.monotonic() < give_up:
                t.join(0.2)
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise WorkerFailure(f"{layout.describe()}: worker rank {self.procs.index(dead[0]) + 1} "
                                        f"(pid {dead[0].pid}) exited with code {dead[0].exitcode} while starting")
        finally:
            if t.is_alive() and "comm" not in box:  # given up: end the thread's wait at the store
                _release_rendezvous(layout, addr, port)
        if "comm" in box:
            return box["comm"]
        if t.is_alive():  # rank 0 itself still joining the groups (its store's client busy: no note to read)
            raise WorkerFailure(f"{layout.describe()}: start-up failed: the ranks did not meet within the "
                                f"{self.startup_timeout:g} s startup timeout (--startup-timeout): rank 0 was still "
                                f"joining the process groups")
        error = box["error"]
        if "store" not in box:  # rank 0's own store did not start
            raise error
        # the workers that never reached the store (the others wait there for them), else those that reached it
        # but did not join the groups
        notes = {r: startup_note(box["store"], r) for r in range(1, layout.world)}
        lagging = [f"worker rank {r}{self._pid(r)} never reached rank 0's store" for r, n in notes.items() if n is None]
        lagging = lagging or [f"worker rank {r}{self._pid(r)} was {n}" for r, n in notes.items() if n == JOINING]
        if not lagging:  # every worker joined: rank 0's own failure
            raise error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WorkerFailure(f"{layout.describe()}: start-up failed: the ranks did not meet within the "
                            f"{self.startup_timeout:g} s startup timeout (--startup-timeout): {'; '.join(lagging)} "
                            f"({first})") from error

    def _pid(self, rank: int) -> str:
        """`` (pid N)`` of a worker spawned here; empty under torchrun."""
        return f" (pid {self.procs[rank - 1].pid})" if len(self.procs) >= rank else ""

    def _not_ready(self, rank: int, exc: BaseException) -> str:
        """Why worker ``rank`` sent no "ready": how it died, or, alive, that it was not ready in time and what it
        last noted it was doing (:meth:`~.comm.Comm.note_startup`)."""
        who = self._who(exc)
        if "died with exit code" in who:
            return who
        note = startup_note(self.comm.store, rank)
        return (f"worker rank {rank}{self._pid(rank)} was not ready within the {self.startup_timeout:g} s startup "
                f"timeout (--startup-timeout)" + (f"; it was {note}" if note else ""))

    def _log_startup(self) -> None:
        lay, cache = self.layout, self.local.cache
        log.info("sharded engine: %s; per rank: %s B of weights", lay.describe(),
                 f"{sum(p.numel() * p.element_size() for p in self.local.model.parameters()):,}")
        if lay.tp > 1:
            per_rank = cache.num_pages * cache.page_bytes
            log.info("tensor parallel: the KV cache is replicated on each of the %d TP ranks (V4.1's single shared "
                     "KV head cannot be split by head): %s B per rank (%.2f B/token), %s B over the TP group",
                     lay.tp, f"{per_rank:,}", cache.bytes_per_token, f"{per_rank * lay.tp:,}")

    def _beat(self) -> None:
        """One heartbeat (see :func:`_heartbeat`): ping the workers unless a call is running."""
        if self.failure is not None or not self.local.lock.acquire(blocking=False):
            return
        try:
            if self.failure is None:
                _, replies = self._command(("ping",))
                self._check(replies, "ping")
        except Exception:  # recorded in self.failure by _command / _check
            pass
        finally:
            self.local.lock.release()

    # ------------------------------------------------------------------ failure
    def _who(self, exc: BaseException) -> str:
        """Which worker failed and how, as best known: a spawned worker's exit code, else the error."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and self.procs and all(p.exitcode is None for p in self.procs):
            time.sleep(0.05)  # a killed worker's exit is seen a moment after its sockets close
        dead = [f"worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}"
                for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if dead:
            return "; ".join(dead) + f" ({text})"
        if "timed out" in text.lower() or "timeout" in text.lower():
            return f"a worker did not answer within the {self.timeout:g} s worker timeout ({text})"
        return text

    def _fail(self, exc: BaseException, what: str | None = None) -> WorkerFailure:
        msg = what or self._who(exc)
        failure = WorkerFailure(f"sharded engine ({self.layout.describe()}) stopped: {msg}")
        self.failure = failure
        log.error("%s", failure)
        self._kill_workers()
        self._detach()
        if self.exit_on_failure:
            self._exit_later()
        return failure

    def _exit_later(self) -> None:
        """Server mode: after a grace period (so /health can say why), stop the server with status 1."""
        import signal

        def later():
            time.sleep(2.0)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=later, daemon=True).start()

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join(10)

    def shutdown(self) -> None:
        """Stop the workers (a clean ``stop`` if they answer, else killed)."""
        with self.local.lock:
            if self.failure is None:
                try:
                    self.comm.send_command(("stop",))
                    for r in range(1, self.layout.world):
                        self._recv(r, min(self.timeout, 10.0))
                    for p in self.procs:  # they answered: let them exit (status 0) before any is killed
                        p.join(min(self.timeout, 10.0))
                except Exception:
                    pass
            self.failure = self.failure or WorkerFailure("the sharded engine was shut down")
            self._kill_workers()
            self._detach()

    def _detach(self) -> None:
        fin = self.__dict__.get("_finalizer")
        if fin is not None:
            fin.detach()  # the workers are stopped: nothing left for exit or collection to do

    # ------------------------------------------------------------------ commands
    def _recv(self, src: int, wait: float | None = None):
        saved = self.comm.timeout
        if wait is not None:
            self.comm.timeout = wait
        try:
            return self.comm.recv_reply(src)
        finally:
            self.comm.timeout = saved

    def _command(self, cmd: tuple, local=None):
        """Send ``cmd`` to every worker, run ``local`` (rank 0's part) meanwhile, collect every worker's reply.
        Returns (rank 0's result or the exception it raised, [worker replies])."""
        if self.failure is not None:
            raise self.failure
        try:
            self.comm.send_command(cmd)
            mine: object = None
            try:
                mine = local() if local is not None else None
            except Exception as e:
                if cmd[0] == "step":  # rank 0's forward failed mid-collective: the ranks are out of step
                    raise
                mine = e
            replies = [self._recv(r) for r in range(1, self.layout.world)]
        except WorkerFailure:
            raise
        except Exception as e:
            raise self._fail(e) from e
        return mine, replies

    # ------------------------------------------------------------------ the engine interface
    @property
    def tokenizer(self):
        return self.local.tokenizer

    @property
    def model_config(self):
        return self.local.model_config

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def reads_images(self) -> bool:
        return self.local.reads_images

    @property
    def image_limits(self):
        return self.local.image_limits

    @image_limits.setter
    def image_limits(self, limits) -> None:
        self._set_everywhere("image_limits", limits)

    def _set_everywhere(self, name: str, value) -> None:
        """Set an attribute of every rank's engine (rank 0's too)."""
        with self.local.lock:
            setattr(self.local, name, value)
            _, replies = self._command(("setattr", name, value))
            self._check(replies, f"setting {name}")

    def _check(self, replies, what: str) -> list:
        out = []
        for r, (status, value) in enumerate(replies, start=1):
            if status != "ok":
                raise self._fail(value if isinstance(value, BaseException) else RuntimeError(str(value)),
                                 f"rank {r} failed {what}: {type(value).__name__}: {value}")
            out.append(value)
        return out

    def add_request(self, request_id, prompt, params=None, images=None) -> None:
        images = images or []
        with self.local.lock:
            if self.layout.dp == 1:
                import copy

                args = (request_id, copy.deepcopy(prompt), copy.deepcopy(params), images)
                self.local.add_request(request_id, prompt, params, images=images)  # errors: the caller's, sent nowhere
                _, replies = self._command(("add", None) + args)
                self._check(replies, f"add_request({request_id!r})")
                return
            from ..engine.sampling_params import RequestError

            if request_id in self.owner:
                raise RequestError(f"request_id: {request_id!r} is already running")
            lay = self.layout
            target = min(range(lay.dp), key=lambda g: (self.load[g], g))  # a DP group, not a rank
            cmd = ("add", target, request_id, prompt, params, images)
            mine, replies = self._command(cmd, (lambda: self.local.add_request(request_id, prompt, params,
                                                                               images=images))
                                          if target == 0 else None)
            # every rank's answer (rank 0's own as a reply); the target group's ranks (target·TP ... +TP-1) apply
            # the request and may refuse it (RequestError, QueueFullError: the caller's error, the engine goes
            # on); its TP replicas must answer as its first rank did; every other rank must answer ok
            answers = [("error", mine) if isinstance(mine, BaseException) else ("ok", None)] + list(replies)
            group = range(target * lay.tp, (target + 1) * lay.tp)
            lead_status, err = answers[group.start]
            what = f"add_request({request_id!r}) (for DP group {target})"
            for r in group[1:]:
                if answers[r][0] != lead_status:
                    raise self._fail(RuntimeError("diverged"), f"rank {r} diverged from rank {group.start} on "
                                                              f"{what}: {answers[r][1]!r} against {err!r}")
            self._check([a for r, a in enumerate(answers) if r not in group], what)
            if lead_status == "error":
                raise err if isinstance(err, BaseException) else RuntimeError(str(err))
            self.owner[request_id] = target
            self.nseq[request_id] = params.n if params is not None else 1
            self.load[target] += self.nseq[request_id]

    def abort_request(self, request_id) -> None:
        with self.local.lock:
            if self.layout.dp == 1:
                self.local.abort_request(request_id)
                _, replies = self._command(("abort", None, request_id))
                self._check(replies, f"abort_request({request_id!r})")
                return
            target = self.owner.pop(request_id, None)
            self.nseq.pop(request_id, None)
            if target is None:
                return
            mine, replies = self._command(("abort", target, request_id),
                                          (lambda: self.local.abort_request(request_id)) if target == 0 else None)
            self._check(replies, f"abort_request({request_id!r})")
            self._recount()

    def has_unfinished_requests(self) -> bool:
        if self.layout.dp == 1:
            return self.local.has_unfinished_requests()
        return bool(self.owner)

    def step(self):
        with self.local.lock:
            if self.layout.dp == 1:
                mine, replies = self._command(("step",), self.local.step)
                digests = self._check(replies, "step")
                d0 = _digest(mine)
                for r, d in enumerate(digests, start=1):
                    if d != d0:
                        raise self._fail(RuntimeError("diverged"), f"rank {r} diverged from rank 0 at step "
                                                                  f"{self.local.num_steps} (different tokens)")
                return mine

            def local():
                outs = self.local.step()
                self.comm.sync_idle()
                return outs

            mine, replies = self._command(("step",), local)
            lay = self.layout
            answers = [(mine, self.local.stats())] + self._check(replies, "step")
            outs, stats = [], {}
            for r, answer in enumerate(answers):
                if lay.tp_rank(r) == 0:  # a DP group's outputs
                    outs.extend(answer[0])
                    stats[r] = answer[1]
                elif answer != _digest(answers[r - lay.tp_rank(r)][0]):  # a TP replica of that group
                    raise self._fail(RuntimeError("diverged"), f"rank {r} diverged from rank {r - lay.tp_rank(r)} "
                                                              f"at step {self.local.num_steps} (different tokens)")
            self._stats.update(stats)
            for o in outs:
                if o.finished:
                    self.owner.pop(o.request_id, None)
                    self.nseq.pop(o.request_id, None)
            self._recount()
            return outs

    def _recount(self) -> None:
        load = [0] * self.layout.dp  # sequences, as add_request counts them
        for rid, g in self.owner.items():
            load[g] += self.nseq.get(rid, 1)
        self.load = load

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """A sharded step runs eagerly (its collectives are not traced): nothing to wait for."""
        return False

    def stats(self) -> dict:
        mine = self.local.stats()
        if self.layout.dp == 1 or not self._stats:
            return mine
        out = dict(mine)
        summed = ("num_running", "num_waiting", "kv_pages_used", "kv_pages_total", "prompt_tokens_total",
                  "generation_tokens_total", "num_preemptions")
        for k in summed:
            out[k] = sum(s.get(k, 0) for s in self._stats.values())
        if mine.get("spec_decode") is not None:  # acceptance counts of every DP rank
            from ..engine.speculative import SpecStats

            total = SpecStats()
            for s in self._stats.values():
                d = s.get("spec_decode") or {}
                total.add(SpecStats(d.get("num_drafts", 0), d.get("num_draft_tokens", 0),
                                    d.get("num_accepted_tokens", 0), list(d.get("accepted_per_position", []))))
            out["spec_decode"] = total.as_dict()
        return out

    def collective_counters(self) -> list[dict]:
        """Every rank's collective counters since the last call (calls, payload and link bytes per collective),
        reset."""
        with self.local.lock:
            mine, replies = self._command(("counters",), self.comm.reset_counters)
            return [mine] + self._check(replies, "counters")


def run_torchrun_worker(config) -> int:
    """A torchrun process of rank > 0: serve rank 0's commands; returns its exit status."""
    env = torchrun_env()
    layout = layout_of(config)
    if env["world"] != layout.world:
        raise ConfigError(f"torchrun started {env['world']} processes but {layout.describe()} needs {layout.world}")
    try:
        return worker_main(config, env["rank"], env["local_rank"], env["addr"], env["port"], None,
                           agent_store=env["agent_store"])
    except Exception as e:
        log.error("worker rank %d: %s: %s", env["rank"], type(e).__name__, e)
        return 1
