"""No import circles among cyformer's modules, and the core never imports
the tools built on it (cyformer.tl, the CLI, the server, jobs).

Every import statement counts, the ones inside functions too: a lazy import
hides a circle from the interpreter, not from the design.  An edge goes to
the module an import names (``from .x import y`` -> ``x``, or ``x.y`` when
``y`` is a submodule).  Importing a submodule runs its package's
``__init__`` first; that implicit edge is left out, since every module would
otherwise sit in one circle through ``cyformer/__init__.py``, whose only job
is to re-export ``load``, ``Model``, ``Config`` and the errors.
"""

import ast
import os

import cyformer

ROOT = os.path.dirname(os.path.abspath(cyformer.__file__))
# Layers above the model: the core must not import them
TOOLS = ("cyformer.tl", "cyformer.cli", "cyformer.serve", "cyformer.jobs", "cyformer.__main__")


def modules():
    """module name -> path of every .py file in the package."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3]
                name = rel.replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(dirpath, f)
    return out


def compiled(name):
    """True for a compiled submodule (an extension or a folder of them): no
    Python source, and it imports nothing of cyformer."""
    folder = os.path.join(os.path.dirname(ROOT), *name.split(".")[:-1])
    leaf = name.rsplit(".", 1)[-1]
    return os.path.isdir(folder) and any(f == leaf or f.startswith(leaf + ".") for f in os.listdir(folder))


def edges(mods):
    """module -> set of cyformer modules it imports."""
    graph = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        deps.add(full)
                    elif not compiled(full):  # a name defined in (or re-exported by) base
                        deps.add(base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert cycles(edges(modules())) == []


def test_the_core_imports_no_tool_built_on_it():
    graph = edges(modules())
    core = [m for m in graph if not m.startswith(TOOLS) and m != "cyformer"]
    upward = {m: sorted(d for d in graph[m] if d.startswith(TOOLS)) for m in core}
    assert {m: d for m, d in upward.items() if d} == {}
