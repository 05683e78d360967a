"""The project's import graph (grimp; imports in functions and under TYPE_CHECKING count):
no module of engine, serve_app, cluster or loadtests reaches itself through its imports. A
cycle, even of type-only imports, says two files share one concept; each is named with the
imports that tie it."""

from __future__ import annotations

import grimp

PACKAGES = ("engine", "serve_app", "cluster", "loadtests")


def import_graph():
    return grimp.build_graph(
        *PACKAGES,
        include_external_packages=False,
        exclude_type_checking_imports=False,
        cache_dir=None,
    )


def cycles(graph) -> list[list[str]]:
    """Every strongly connected set of two or more modules (or a module importing itself),
    each sorted, by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def targets(module: str):
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    def visit(root: str) -> None:  # iterative: chains may be deeper than the recursion limit
        work = [(root, targets(root))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, pending = work[-1]
            target = next(pending, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append(
                        (target, iter(sorted(graph.find_modules_directly_imported_by(target))))
                    )
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == module:
                        break
                if len(members) > 1 or graph.direct_import_exists(importer=module, imported=module):
                    found.append(sorted(members))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(found)


def described(graph, members: list[str]) -> str:
    inside = set(members)
    lines = [" <-> ".join(members)]
    for importer in members:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & inside):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{detail['line_number']} imports {imported}")
    return "\n".join(lines)


def test_no_module_imports_itself_back():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(described(graph, c) for c in found)


def test_a_cycle_is_found_and_named():
    graph = import_graph()
    graph.add_import(importer="engine.core.request", imported="engine.llm_engine", line_number=1,
                     line_contents="import engine.llm_engine")  # fmt: skip
    (cycle,) = [c for c in cycles(graph) if "engine.core.request" in c]
    assert "engine.llm_engine" in cycle
    text = described(graph, cycle)
    assert "engine.core.request:1 imports engine.llm_engine" in text
