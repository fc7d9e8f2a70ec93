"""The import graph of our own packages (specdec, target_service, draft_service, orchestrator),
read from the source with `ast` (nothing is imported, so it runs in well under a second):

- no import cycles (a strongly connected component of more than one module);
- nothing outside the measurement lab (specdec/lab/) imports it: the services and the core must
  run without it. (The `specdec` command line finds the lab's subcommands through the
  `specdec.commands` entry point, not by importing it.)

Every import counts, module-level or inside a function (relative imports are resolved). An
import names the most specific module of ours it reaches: `from specdec.lab import bench` is an
edge to specdec.lab.bench, `from specdec.stats import position_counts` one to specdec.stats.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "target_service", "draft_service", "orchestrator")
LAB = "specdec.lab"


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    in_function: bool  # the import statement sits inside a function (runs when it is called)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py file of our packages (namespace subpackages included)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ours(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def module_imports(source: str, module: str, is_package: bool, modules: set[str]) -> list[Edge]:
    """The edges from `module` to our modules, one per imported name, from its source."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)] if child.level > 1 else anchor
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if base else alias.name for alias in child.names]
            for target in targets:
                hit = _ours(target, modules)
                if hit is not None and hit != module:
                    edges.append(Edge(module, hit, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return edges


def import_edges(root: Path = ROOT) -> list[Edge]:
    files = module_files(root)
    names = set(files)
    edges = []
    for name, path in files.items():
        edges += module_imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", names)
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; every node appears once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    nodes = sorted(set(graph) | {m for targets in graph.values() for m in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                out.append(sorted(comp))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a, as a node list closed on its first node) per strongly connected
    component of more than one module, or per module that imports itself."""
    cycles = []
    for comp in strongly_connected(graph):
        members = set(comp)
        start = comp[0]
        if len(comp) == 1 and start not in graph.get(start, ()):
            continue
        # the shortest way back to `start` inside the component (breadth first)
        prev: dict[str, str] = {}
        frontier, seen, end = [start], {start}, None
        while frontier and end is None:
            nxt_frontier = []
            for node in frontier:
                for m in sorted(graph.get(node, ())):
                    if m == start:
                        end = node
                        break
                    if m in members and m not in seen:
                        seen.add(m)
                        prev[m] = node
                        nxt_frontier.append(m)
                if end is not None:
                    break
            frontier = nxt_frontier
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append(list(reversed(path)) + [start])
    return cycles


def lab_violations(edges: list[Edge]) -> list[Edge]:
    """Imports of the lab from outside it."""
    def in_lab(name: str) -> bool:
        return name == LAB or name.startswith(LAB + ".")

    return [e for e in edges if in_lab(e.imported) and not in_lab(e.importer)]


def graph_of(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    return graph


def _describe_cycle(cycle: list[str], edges: list[Edge]) -> str:
    where = {(e.importer, e.imported): e.line for e in edges}
    return " -> ".join(f"{a} (line {where.get((a, b), '?')})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


# -- the checks, on this repository ---------------------------------------------------------------
@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_walk_sees_every_package_and_function_level_imports(edges):
    files = module_files()
    assert {"specdec.cli", "specdec.lab.bench", "specdec.lab.cli", "orchestrator.engine", "target_service.server",
            "draft_service.engine"} <= set(files)
    assert any(e.importer == "specdec.lab.bench" and e.imported == "specdec.lab.peers" and e.in_function
               for e in edges)  # function-level imports are seen


def test_no_import_cycles(edges):
    cycles = find_cycles(graph_of(edges))
    assert not cycles, "import cycles:\n" + "\n".join(_describe_cycle(c, edges) for c in cycles)


def test_nothing_outside_the_lab_imports_it(edges):
    bad = lab_violations(edges)
    assert not bad, "the lab is imported from outside specdec/lab/:\n" + "\n".join(
        f"{e.importer} line {e.line}: {e.imported}" + (" (inside a function)" if e.in_function else "") for e in bad)


# -- the checker itself, on hand-made examples ----------------------------------------------------
def test_find_cycles_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "e"}, "f": {"g"}, "g": {"f"}}
    cycles = find_cycles(graph)
    assert sorted(cycles) == [["a", "b", "c", "a"], ["e", "e"], ["f", "g", "f"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond is no cycle
    comps = strongly_connected(graph)
    assert sorted(map(tuple, comps)) == [("a", "b", "c"), ("d",), ("e",), ("f", "g")]


def test_module_imports_reads_every_kind_of_import():
    modules = {"specdec", "specdec.cli", "specdec.stats", "specdec.lab", "specdec.lab.bench", "specdec.lab.analysis",
               "specdec.lab.cli"}
    source = '''
import json
import specdec.stats
from specdec.lab import bench, not_a_module
from . import analysis
from ..stats import position_counts

def build_parser():
    from specdec.lab.cli import add_parsers
    return add_parsers
'''
    got = {(e.imported, e.in_function) for e in module_imports(source, "specdec.lab.report", False, modules)}
    assert got == {("specdec.stats", False), ("specdec.lab.bench", False), ("specdec.lab", False),
                   ("specdec.lab.analysis", False), ("specdec.lab.cli", True)}


def test_lab_violations_on_hand_made_edges():
    edges = [Edge("specdec.lab.bench", "specdec.stats", 1, False),  # the lab uses the core: fine
             Edge("specdec.lab.tune", "specdec.lab.analysis", 2, False),  # inside the lab: fine
             Edge("specdec.cli", "specdec.lab.cli", 3, True),  # even inside a function
             Edge("specdec.cli", "specdec.lab.cli", 4, False),
             Edge("specdec.cli", "specdec.lab.bench", 5, True),
             Edge("orchestrator.engine", "specdec.lab", 6, True),
             Edge("specdec.stats", "specdec.lab.analysis", 7, False)]
    assert [e.line for e in lab_violations(edges)] == [3, 4, 5, 6, 7]


def test_the_checks_fail_on_a_bad_tree(tmp_path):
    """A tiny tree with a cycle and a service importing the lab: both checks report them."""
    for rel, text in {"specdec/__init__.py": "", "specdec/lab/__init__.py": "",
                      "specdec/a.py": "from specdec import b\n",
                      "specdec/b.py": "def f():\n    import specdec.a\n",
                      "specdec/lab/bench.py": "from specdec import a\n",
                      "orchestrator/__init__.py": "", "orchestrator/engine.py": "from specdec.lab.bench import x\n",
                      "target_service/__init__.py": "", "draft_service/__init__.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = import_edges(tmp_path)
    assert find_cycles(graph_of(edges)) == [["specdec.a", "specdec.b", "specdec.a"]]
    assert [(e.importer, e.imported) for e in lab_violations(edges)] == [("orchestrator.engine", "specdec.lab.bench")]


def test_the_sdk_cli_and_orchestrator_run_without_torch():
    """The client SDK, the command line and the orchestrator (with its tokenizer and chat
    template) never import torch: a second and a few hundred MB they do not use."""
    import subprocess
    import sys

    code = ("import sys; import specdec, specdec.cli, orchestrator.server; from specdec import Client; "
            "from specdec import hf_compat, models; "
            "tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL)); "
            "assert hf_compat.chat_token_ids(tok, [{'role': 'user', 'content': 'hi'}]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split()[-1] == "False", out.stdout
