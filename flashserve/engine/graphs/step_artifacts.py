"""A compiled step's graphs kept on disk as artifacts another process loads and calls without dynamo.

A child process (:mod:`.compile_child`) compiles each region kind's graph for a step key with
``torch._inductor.standalone_compile`` and saves it here with its plan: where each argument comes from (an input
of the region, a size of one, a tensor of the instance by name, a tensor no layer owns by its name in the step,
a number). The serving process loads the artifact (a few milliseconds when inductor's cache holds its compiled
code, which the child left there) and installs the plan (:meth:`.regions.RegionCall.install`): no tracing, no
guards, so its interpreter stays with the serving thread. The same files make a later start compiled from its
first steps.

Files are named by a hash of the kind (its fingerprint, layout and relations: what a graph may have taken as
constant) and of everything else the code depends on: the whole model's fingerprint and the cache's layout (the
prologue and epilogue read the model's embedding and head; every region may take a size of the cache as a constant:
its slots, its pages, the window rows kept for drafts, which the engine's options set), torch's version, the CPU's
vector instruction set, the compile options and flashserve's own model and step sources. A kind whose files are
missing or do not load is compiled again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .regions import PLAIN, RegionalStep, RegionPlan, Slot, fingerprint, named_tensors

log = logging.getLogger("flashserve.engine")

_PACKAGE = Path(__file__).resolve().parents[2]  # flashserve/


@functools.cache
def _sources_hash() -> str:
    """A hash of the sources a step's graph is traced from: the model, the engine's step and the C++ kernels."""
    h = hashlib.sha256()
    for folder in ("model", "engine"):
        for f in sorted((_PACKAGE / folder).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h"):
                h.update(str(f.relative_to(_PACKAGE)).encode() + f.read_bytes())
    return h.hexdigest()


def geometry(regions: RegionalStep) -> tuple:
    """What every region's graph may have taken as a constant beyond its kind: the model's fingerprint, and the
    shape, dtype and strides of each cache storage tensor with the cache's sizes (the page table, which grows, is
    an input of every step instead)."""
    cache = regions.cache
    tensors = tuple((name, tuple(t.shape), t.dtype, t.stride())
                    for name, t in named_tensors(cache.storage, "storage").items())
    sizes = tuple(sorted((k, v) for k, v in vars(cache).items() if isinstance(v, PLAIN)))
    return fingerprint(regions.model), tensors, sizes


def _version(options: dict) -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    def stable(v):  # a graph pass by what it does (its uuid, as inductor's cache names it), not its address
        return repr(v.uuid()) if hasattr(v, "uuid") else repr(v)

    return repr((torch.__version__, str(pick_vec_isa()), sorted((k, stable(v)) for k, v in options.items()),
                 _sources_hash()))


class StepArtifacts:
    """The artifacts of one compiled step's regions, under ``root``."""

    def __init__(self, regions: RegionalStep, root: str | os.PathLike):
        self.regions, self.root = regions, Path(root)
        version = (_version(regions.recorder.options), geometry(regions))
        self._kinds = [(hashlib.sha256(repr((kind, version)).encode()).hexdigest()[:24], call)
                       for kind, call in regions.kinds.items()]
        self._shared: dict[str, torch.Tensor] | None = None
        self._graphs: dict[str, object] = {}  # loaded graphs by their files' hash

    def _path(self, kind: str, key: tuple) -> Path:
        """The plan of a kind's graph for ``key`` (bucket, rows, table width)."""
        return self.root / kind / ("x".join(map(str, key)) + ".json")

    def _shared_tensors(self) -> dict[str, torch.Tensor]:
        if self._shared is None:
            self._shared = self.regions.shared_tensors()
        return self._shared

    def has(self, key: tuple) -> bool:
        """Whether every kind's plan for ``key`` is there (not whether its graph loads)."""
        return all(self._path(kind, key).is_file() for kind, _ in self._kinds)

    def save(self, key: tuple) -> int:
        """Save each kind's graph for ``key`` (compiled in this process as artifacts); the number saved (a kind
        whose plan names a tensor no name reaches is left out: the loading process compiles the key). A graph is
        kept once, named by a hash of its bytes: the keys of one graph (the widths a growing context asks for, where
        dynamo made the width a size) share its file."""
        import tempfile

        names = {id(t): n for n, t in self._shared_tensors().items()}
        saved = 0
        for kind, call in self._kinds:
            plan = call.plan(key)
            if plan is None or not hasattr(plan.compiled, "save"):
                continue
            slots = []
            for s in plan.slots:
                if isinstance(s.value, torch.Tensor):
                    if id(s.value) not in names:
                        break
                    slots.append({"shared": names[id(s.value)]})
                else:
                    slots.append({"input": s.input, "dim": s.dim, "name": s.name, "value": s.value})
            else:
                graphs = self.root / "graphs"
                graphs.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=graphs) as tmp:
                    plan.compiled.save(path=f"{tmp}/graph", format="binary")
                    data = Path(f"{tmp}/graph").read_bytes()
                    digest = hashlib.sha256(data).hexdigest()[:32]
                    if not (graphs / f"{digest}.bin").is_file():
                        Path(f"{tmp}/graph").replace(graphs / f"{digest}.bin")
                path = self._path(kind, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp_plan = path.with_suffix(f".{os.getpid()}.tmp")
                tmp_plan.write_text(json.dumps({"graph": digest, "slots": slots, "outputs": plan.outputs}))
                tmp_plan.replace(path)
                saved += 1
        return saved

    def load(self, key: tuple) -> bool:
        """Install every kind's graph for ``key`` from its files (each graph loaded once a process); whether all
        were there and loaded (if not, none is installed)."""
        plans = []
        for kind, call in self._kinds:
            plan = self._load_plan(self._path(kind, key))
            if plan is None:
                return False
            plans.append((call, plan))
        for call, plan in plans:
            call.install(key, plan)
        return True

    def _load_plan(self, path: Path) -> RegionPlan | None:
        from torch._inductor import CompiledArtifact

        if not path.is_file():
            return None
        try:
            desc = json.loads(path.read_text())
            shared = self._shared_tensors()
            slots = [Slot(value=shared[d["shared"]]) if "shared" in d else
                     Slot(input=d["input"], dim=d["dim"], name=d["name"], value=d["value"]) for d in desc["slots"]]
            compiled = self._graphs.get(desc["graph"])
            if compiled is None:
                compiled = CompiledArtifact.load(path=str(self.root / "graphs" / f"{desc['graph']}.bin"),
                                                 format="binary")
                self._graphs[desc["graph"]] = compiled
        except Exception as e:  # a file from elsewhere, half written, or of another build: compiled again
            log.warning("the compiled graph of %s does not load (%s: %s); compiling it again", path,
                        type(e).__name__, e)
            return None
        return RegionPlan(compiled, slots, desc["outputs"])
