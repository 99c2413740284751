"""The package boundaries, checked: no import cycles, and the daemon never imports torch.

The import graph is read from the source with :mod:`ast`, so an import under ``TYPE_CHECKING`` or
inside a function counts like any other: a cycle hidden behind ``TYPE_CHECKING`` is still a cycle
in the design. An import of a package counts as an edge to its ``__init__``; the parent packages
that Python imports on the way are not counted.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name, as pyproject.toml maps them
PACKAGES = {
    "chaos": "chaos",
    "daemon": "chaos.daemon",
    "scheduling": "chaos.scheduling",
    "native": "chaos._native",
}


def _module_of(path: Path, root: Path) -> tuple[str, str]:
    """Return (module name, the package that relative imports start from) of a source file."""
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, name.rsplit(".", 1)[0]


def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    """Every project module under ``root`` and the project modules it imports, anywhere."""
    files = [p for top in PACKAGES for p in (root / top).rglob("*.py")]
    names = {name for name, _pkg in (_module_of(p, root) for p in files)}
    graph = nx.DiGraph()
    for path in files:
        me, package = _module_of(path, root)
        graph.add_node(me)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node, package)
                # `from pkg import sub` imports the submodule when there is one
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in names]
                targets = subs or [mod]
            for target in targets:
                if target in names and target != me:
                    graph.add_edge(me, target)
    return graph


def test_the_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    shown = ["  " + " -> ".join([*c, c[0]]) for c in sorted(cycles, key=len)[:20]]
    if cycles:
        raise AssertionError(f"{len(cycles)} import cycles, e.g.:\n" + "\n".join(shown))


def test_the_graph_reader_sees_type_checking_imports(tmp_path: Path) -> None:
    """The check above must not be blind to the imports it is meant to catch."""
    pkg = tmp_path / "chaos" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "chaos" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from chaos.sub.a import A\n")
    (pkg / "a.py").write_text("from .b import B\nclass A: ...\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from chaos.sub import a\n"
    )
    graph = import_graph(tmp_path)
    assert graph.has_edge("chaos.sub.a", "chaos.sub.b")
    assert graph.has_edge("chaos.sub.b", "chaos.sub.a")  # under TYPE_CHECKING, via the package
    assert graph.has_edge("chaos.sub", "chaos.sub.a")
    assert ["chaos.sub.a", "chaos.sub.b"] in [sorted(c) for c in nx.simple_cycles(graph)]
    # and on the real tree it sees the daemon's module-level imports
    assert import_graph().has_edge("chaos.daemon.node", "chaos.daemon.config")


def test_the_daemon_and_the_planner_never_import_torch() -> None:
    """A daemon starts fast on a weak device: neither it nor the shard planner loads torch."""
    code = (
        "import sys\n"
        "import chaos.daemon.node, chaos.daemon.cli, chaos.daemon.client, chaos.scheduling\n"
        "import chaos.protocol\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "torch was imported by the daemon's modules"


def layers(root: Path = ROOT) -> tuple[str, ...]:
    """The layers of the design, read from the source tree, ``chaos`` (its ``__init__``) first.

    The rule, kept explicit here: every package (a folder with an ``__init__.py``, at any depth,
    under the import names of :data:`PACKAGES`) is a layer, and so is every top-level module of
    ``chaos`` (``chaos/wire.py``, ``chaos/sockets.py``, ...). A module belongs to the longest
    layer that prefixes it, so a module added anywhere lands in a layer without a hand-kept list.
    The top-level modules come first, then the packages, each group sorted by name.
    """
    modules: list[str] = []
    packages: list[str] = []
    for top in PACKAGES:
        for init in sorted((root / top).rglob("__init__.py")):
            name, _pkg = _module_of(init, root)
            if name != "chaos":
                packages.append(name)
    for path in sorted((root / "chaos").glob("*.py")):
        if path.name != "__init__.py":
            modules.append(_module_of(path, root)[0])
    return ("chaos", *sorted(modules), *sorted(packages))


LAYERS = layers()


def _layer(module: str, known: tuple[str, ...] = LAYERS) -> str:
    best = ""
    for layer in known:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


def test_every_module_is_in_a_layer() -> None:
    """No module falls through to the root: each lies in a package or is a top-level module.

    A module only ``chaos`` prefixes (one in a folder without an ``__init__.py``, say) would
    have its imports merged into the root's and vanish from the table below.
    """
    stray = sorted(m for m in import_graph().nodes if _layer(m) in {"", "chaos"} and m != "chaos")
    if stray:
        raise AssertionError(f"modules in no layer: {stray}")
    assert "chaos.sockets" in LAYERS and "chaos.daemon.scheduler" in LAYERS


def test_the_layers_follow_the_tree(tmp_path: Path) -> None:
    """A new top-level module and a new nested package each become a layer, unasked."""
    for top in PACKAGES:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "chaos" / "fresh.py").write_text("")
    (tmp_path / "daemon" / "inner").mkdir()
    (tmp_path / "daemon" / "inner" / "__init__.py").write_text("")
    (tmp_path / "daemon" / "inner" / "x.py").write_text("")
    (tmp_path / "chaos" / "loose").mkdir()  # no __init__.py: its module is in no layer
    (tmp_path / "chaos" / "loose" / "y.py").write_text("")
    found = layers(tmp_path)
    assert found == (
        "chaos", "chaos.fresh", "chaos._native", "chaos.daemon", "chaos.daemon.inner",
        "chaos.scheduling",
    )
    assert _layer("chaos.daemon.inner.x", found) == "chaos.daemon.inner"
    assert _layer("chaos.loose.y", found) == "chaos"


def _bottom_up(deps: dict[str, set[str]]) -> list[str]:
    """The layers ordered so that each comes after those it imports; layers that import each
    other (``chaos.daemon`` and ``chaos.daemon.scheduler``) sit together; ties by name."""
    graph = nx.DiGraph()
    graph.add_nodes_from(deps)
    graph.add_edges_from((d, layer) for layer, ds in deps.items() for d in ds)
    dag = nx.condensation(graph)
    members = dag.graph["mapping"]
    first = {c: min(m for m, cc in members.items() if cc == c) for c in dag.nodes}
    order: list[str] = []
    for c in nx.lexicographical_topological_sort(dag, key=lambda c: first[c]):
        order += sorted(m for m, cc in members.items() if cc == c)
    return order


def package_table() -> str:
    """The markdown rows of docs/architecture.md's import table, computed from the source."""
    graph = import_graph()
    deps: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for a, b in graph.edges:
        la, lb = _layer(a), _layer(b)
        if la != lb and lb != "chaos":
            deps[la].add(lb)
    rows = ["| package | imports (project packages only) |", "|---|---|"]
    for layer in _bottom_up(deps):
        if layer == "chaos":
            continue
        names = ", ".join(f"`{d}`" for d in sorted(deps[layer])) or "nothing"
        rows.append(f"| `{layer}` | {names} |")
    return "\n".join(rows)


def test_the_docs_import_table_matches_the_code() -> None:
    """docs/architecture.md's table of who imports whom is the one the source has."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- imports:begin -->\n", "\n<!-- imports:end -->"
    if begin not in text or end not in text:
        raise AssertionError("docs/architecture.md lacks the imports:begin/end markers")
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    expected = package_table()
    if documented != expected:
        raise AssertionError("docs/architecture.md's import table is stale; it should read:\n"
                             + expected)


def test_the_shard_planner_is_pure() -> None:
    """chaos.scheduling imports no other project package but the errors, and no I/O library."""
    graph = import_graph()
    outside = {
        b for a, b in graph.edges if _layer(a) == "chaos.scheduling" and _layer(b) != _layer(a)
    }
    assert outside <= {"chaos.errors"}, outside
    for path in (ROOT / "scheduling").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top not in {"zmq", "socket", "torch", "subprocess", "os"}, (path, name)


def _package_rows(text: str) -> dict[str, str]:
    """docs/architecture.md's "Packages" table: each package named in a row's first cell, and
    that row's last cell (the modules it lists)."""
    section = text.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([\w.]+)`", cells[0]):
            rows[name] = cells[-1]
    return rows


def undocumented_modules(root: Path = ROOT) -> list[str]:
    """The module files that docs/architecture.md's "Packages" table leaves out.

    A top-level module of ``chaos`` must be a package of a row; any other module file must be
    named (``name.py``, in backticks) in the row of the package that holds it.
    """
    rows = _package_rows((root / "docs" / "architecture.md").read_text())
    missing: list[str] = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            name, package = _module_of(path, root)
            if package == "chaos":
                if name not in rows:
                    missing.append(f"{path.relative_to(root)} (no row for `{name}`)")
            elif f"`{path.name}`" not in rows.get(package, ""):
                missing.append(f"{path.relative_to(root)} (not in the `{package}` row)")
    return missing


def test_the_docs_name_every_module() -> None:
    """docs/architecture.md's package table names every module file of the tree."""
    missing = undocumented_modules()
    if missing:
        raise AssertionError("docs/architecture.md's Packages table leaves out:\n  "
                             + "\n  ".join(missing))


def test_the_module_check_sees_a_missing_module(tmp_path: Path) -> None:
    """The check above fails for a module that no row names."""
    for top in PACKAGES:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "daemon" / "told.py").write_text("")
    (tmp_path / "daemon" / "untold.py").write_text("")
    (tmp_path / "chaos" / "alone.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "# Map\n\n## Packages\n\n| package | folder | job | modules |\n|---|---|---|---|\n"
        "| `chaos.daemon` | `daemon/` | the member side | `told.py` (told) |\n\n## Next\n"
    )
    assert undocumented_modules(tmp_path) == [
        "chaos/alone.py (no row for `chaos.alone`)",
        "daemon/untold.py (not in the `chaos.daemon` row)",
    ]


if __name__ == "__main__":  # print the table for docs/architecture.md
    print(package_table())
