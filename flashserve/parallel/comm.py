"""Process groups of one sharded engine and the collectives its model runs, with the bytes each moves.

No global state: three process-group objects built over one ``TCPStore`` (gloo on the CPU, NCCL for the data
group on CUDA), held by a :class:`Comm` that is passed to the modules that use it. ``torch.distributed``'s
default group is never initialised, so several engines (or tests) can live in one process.

* ``data``: the model's collectives (TP all-reduce, vocab all-gather, MoE dispatch/combine); bounded timeout.
* ``ctl``: rank 0's commands to the workers; waits as long as the engine is idle (no timeout to speak of).
* ``reply``: the workers' answers to rank 0 (gloo, bounded timeout): a worker that dies or hangs is found
  within ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config.ranks import Layout

IDLE = -1  # layer id a rank sends in the DP MoE header when it has no forward to run


@dataclass
class Counter:
    calls: int = 0
    payload_bytes: int = 0  # bytes of the tensors handed to the collective, this rank
    link_bytes: float = 0.0  # bytes this rank sends over its links (ring algorithms)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "payload_bytes": self.payload_bytes, "link_bytes": self.link_bytes}


@dataclass
class Comm:
    layout: Layout
    rank: int
    data: object  # ProcessGroup
    ctl: object
    reply: object
    timeout: float
    device: torch.device
    counters: dict[str, Counter] = field(default_factory=dict)
    moe_layers: dict[int, object] = field(default_factory=dict)  # layer -> ParallelMoE (DP idle participation)
    tp_group: object = None  # the TP ranks of this rank's DP group (``data`` itself when DP = 1)
    store: object = None  # the TCPStore the groups were built over, kept alive with them

    # ------------------------------------------------------------------ start-up notes
    def note_startup(self, doing: str) -> None:
        """A worker: what it is doing while it starts, kept in the store, so that rank 0 can say it when the
        worker is not ready in time (:func:`startup_note`)."""
        note_startup(self.store, self.rank, doing)

    @property
    def world(self) -> int:
        return self.layout.world

    def _group(self, group: str) -> tuple[object, int]:
        """(process group, size): ``tp`` (this DP group's TP ranks) or ``world`` (every rank)."""
        if group == "tp" and self.layout.dp > 1:
            return self.tp_group, self.layout.tp
        return self.data, self.world

    # ------------------------------------------------------------------ accounting
    def _count(self, name: str, payload: int, link: float) -> None:
        c = self.counters.setdefault(name, Counter())
        c.calls += 1
        c.payload_bytes += payload
        c.link_bytes += link

    def reset_counters(self) -> dict[str, dict]:
        out = {k: v.as_dict() for k, v in self.counters.items()}
        self.counters.clear()
        return out

    def _wait(self, work) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout))

    # ------------------------------------------------------------------ model collectives (data group)
    def all_reduce(self, t: torch.Tensor, name: str, group: str = "tp") -> torch.Tensor:
        """Sum ``t`` over the group's ranks, in place; ring link bytes 2·(w−1)/w · size."""
        pg, w = self._group(group)
        n = t.numel() * t.element_size()
        self._count(name, n, 2 * (w - 1) / w * n)
        t = t.contiguous()
        self._wait(pg.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor, name: str, group: str = "tp") -> list[torch.Tensor]:
        """Every group rank's ``t`` (equal shapes), in rank order; link bytes (w−1) · size."""
        pg, w = self._group(group)
        t = t.contiguous()
        n = t.numel() * t.element_size()
        self._count(name, n, (w - 1) * n)
        outs = [torch.empty_like(t) for _ in range(w)]
        self._wait(pg.allgather([outs], [t]))
        return outs

    def all_to_all(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Chunk ``j`` of ``t`` (split on dim 0 in ``world`` equal parts) goes to rank ``j``; link bytes
        (w−1)/w · size."""
        t = t.contiguous()
        n = t.numel() * t.element_size()
        self._count(name, n, (self.world - 1) / self.world * n)
        out = torch.empty_like(t)
        self._wait(self.data.alltoall_base(out, t, [], []))
        return out

    def all_to_all_v(self, t: torch.Tensor, send: list[int], recv: list[int], name: str) -> torch.Tensor:
        """Rows ``send[j]`` of ``t`` (in rank order) go to rank ``j``; ``recv[j]`` rows come from rank ``j``.
        Link bytes: the rows sent to other ranks."""
        t = t.contiguous()
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        self._count(name, t.numel() * t.element_size(), (sum(send) - send[self.rank]) * row)
        out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
        self._wait(self.data.alltoall_base(out, t, list(recv), list(send)))
        return out

    # ------------------------------------------------------------------ DP: MoE in lock step
    def moe_header(self, layer: int, counts: list[int]) -> list[tuple[int, list[int]]]:
        """Every rank's (layer, tokens it sends to each rank) for the next MoE collective (layer ``IDLE``:
        nothing to run)."""
        h = torch.tensor([layer] + list(counts), dtype=torch.long, device=self.device)
        return [(int(x[0]), [int(v) for v in x[1:].tolist()]) for x in self.all_gather(h, "moe_dp_header", "world")]

    def sync_idle(self) -> int:
        """After a rank's forwards of one step: serve the MoE of the ranks still running theirs, until every
        rank is idle. Returns the MoE collectives served."""
        served = 0
        while True:
            header = self.moe_header(IDLE, [0] * self.world)
            if all(layer == IDLE for layer, _ in header):
                return served
            any_moe = next(iter(self.moe_layers.values()))
            any_moe.dp_exchange(None, None, None, header)
            served += 1

    # ------------------------------------------------------------------ control (objects)
    def send_command(self, obj) -> None:
        """Rank 0: one pickled object to every worker (``ctl`` group)."""
        self._broadcast_object(self.ctl, obj, wait=True)

    def recv_command(self):
        """A worker: the next command from rank 0 (waits however long the engine is idle)."""
        return self._broadcast_object(self.ctl, None, wait=False)

    def _broadcast_object(self, pg, obj, wait: bool):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        w = pg.broadcast([size], opts)
        self._wait(w) if wait else w.wait()
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        w = pg.broadcast([data], opts)
        self._wait(w) if wait else w.wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def send_reply(self, obj) -> None:
        """A worker: its answer to the last command, to rank 0."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._wait(self.reply.send([torch.tensor([data.numel()], dtype=torch.long)], 0, 1))
        self._wait(self.reply.send([data], 0, 2))

    def recv_reply(self, src: int):
        size = torch.zeros(1, dtype=torch.long)
        self._wait(self.reply.recv([size], src, 1))
        data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.reply.recv([data], src, 2))
        return pickle.loads(data.numpy().tobytes())


LONG_WAIT = datetime.timedelta(days=365)

JOINING = "joining the process groups"  # a worker's first start-up note, once it reached rank 0's store


def _note_key(rank: int) -> str:
    return f"flashserve/startup/{rank}"


def _arrived_key(rank: int) -> str:
    return f"flashserve/arrived/{rank}"


def note_startup(store, rank: int, doing: str) -> None:
    """Record in ``store`` what worker ``rank`` is doing while it starts (rank 0 notes nothing)."""
    if rank != 0 and store is not None:
        store.set(_note_key(rank), doing)


def startup_note(store, rank: int) -> str | None:
    """What worker ``rank`` last noted it was doing while starting; None when it never reached ``store`` (or the
    store cannot answer)."""
    try:
        key = _note_key(rank)
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # the store is gone: nothing known
        return None


def connect(layout: Layout, rank: int, addr: str, port: int, device: torch.device, timeout: float,
            host_store: bool = True, startup_timeout: float = 3600.0, listen_fd: int | None = None,
            on_store=None) -> Comm:
    """Join the engine's process groups. Rank 0 hosts the store at ``addr:port`` unless torchrun's agent already
    does (``host_store`` False), on ``listen_fd`` where given (a socket already listening on ``port``, which the
    store then owns). Every rank waits at the store up to ``startup_timeout`` seconds for the others to arrive (a
    worker imports torch first), then builds the groups, whose own rendezvous and operations wait ``timeout``.
    ``on_store`` is called with the store as soon as it is up (rank 0 reads the workers' start-up notes from it,
    :func:`startup_note`, when they do not arrive in time); a worker notes :data:`JOINING` there."""
    t = datetime.timedelta(seconds=timeout)
    fd = {"master_listen_fd": listen_fd} if listen_fd is not None else {}
    store = dist.TCPStore(addr, port, layout.world, rank == 0 and host_store,
                          timeout=datetime.timedelta(seconds=startup_timeout), wait_for_workers=False, **fd)
    if on_store is not None:
        on_store(store)
    note_startup(store, rank, JOINING)
    store.set(_arrived_key(rank), "1")
    store.wait([_arrived_key(r) for r in range(layout.world)], datetime.timedelta(seconds=startup_timeout))

    def gloo(prefix: str, wait: datetime.timedelta):
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, layout.world, wait)

    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU (cuda:LOCAL_RANK) before NCCL picks one
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = t
        data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, layout.world, opts)
    else:
        data = gloo("data", t)
    comm = Comm(layout, rank, data, gloo("ctl", LONG_WAIT), gloo("reply", t), timeout, device, store=store)
    comm.tp_group = data
    if layout.dp > 1 and layout.tp > 1:  # this DP group's TP ranks: heads, vocabulary and shared expert
        d, r = layout.dp_rank(rank), layout.tp_rank(rank)
        prefix = dist.PrefixStore(f"tp{d}", store)
        if device.type == "cuda":
            comm.tp_group = dist.ProcessGroupNCCL(prefix, r, layout.tp, opts)
        else:
            comm.tp_group = dist.ProcessGroupGloo(prefix, r, layout.tp, t)
    return comm
