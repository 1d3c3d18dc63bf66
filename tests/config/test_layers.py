"""The package's layers import one way and its files import no circle: config, plan and gguf < model < engine <
parallel and entry points < server < bench, cli, train. Every import counts, also those inside functions and
under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import flashserve

PKG = Path(flashserve.__file__).parent
LAYERS = {"errors": 0, "interrupts": 0, "cli_help": 0, "config": 0, "plan": 0, "gguf": 0, "model": 1, "models": 1,
          "engine": 2, "parallel": 3, "entrypoints": 3, "server": 4, "bench": 5, "train": 5, "cli": 5,
          "__main__": 6, "__init__": 6}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the flashserve modules it imports (a name imported from a package counts as its submodule
    when there is one)."""
    edges = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name.startswith("flashserve") and name != mod:
                    found.add(name)
        edges[mod] = found
    return edges


def _layer(mod: str) -> int:
    parts = mod.split(".")
    return LAYERS["__init__" if len(parts) == 1 else parts[1]]


def test_every_module_has_a_layer():
    assert all(len(m.split(".")) == 1 or m.split(".")[1] in LAYERS for m in _modules())


def test_no_import_reaches_a_higher_layer():
    edges = _imports(_modules())
    up = sorted((m, d) for m, ds in edges.items() for d in ds if _layer(d) > _layer(m))
    assert not up, up


def test_no_import_cycle_between_files():
    edges = _imports(_modules())
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_scan_sees_imports():
    """The scan finds what a reader sees: the server's chat handler imports the protocol module, and a
    function-level import (the CLI's generate command importing LLM) counts."""
    edges = _imports(_modules())
    assert "flashserve.server.protocol" in edges["flashserve.server.chat"]
    assert "flashserve.entrypoints.llm" in edges["flashserve.entrypoints.generate"]
