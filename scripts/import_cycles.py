"""Report import cycles between modules (grimp's graph, imports inside functions included).

Usage: python scripts/import_cycles.py PACKAGE [PACKAGE ...]   (run where the packages import
from; `scripts/lint_imports.sh` runs it in the installed layout it builds). Prints one cycle per
strongly connected group of modules and exits 1 when there is any, 0 when there is none.

Why beside import-linter: its `layers` contract checks imports between layers, not within one
(two API modules may import each other), and its `acyclic_siblings` contract squashes each package
into one node, so it reports package cycles that no two modules form. A cycle between modules is
what makes an import order matter and a module impossible to read alone.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable

import grimp


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of two or more modules that all reach one another (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def one_cycle(graph: grimp.ImportGraph, group: list[str]) -> list[str]:
    """A shortest cycle through the group's first module, as a path that ends where it starts."""
    start = group[0]
    for importer in sorted(graph.find_modules_that_directly_import(start)):
        if importer in group:
            path = graph.find_shortest_chain(importer=start, imported=importer)
            if path:
                return [*path, start]
    return group


def report(packages: Iterable[str]) -> int:
    """Print the cycles found in `packages`; return how many groups there are."""
    found = 0
    for package in packages:
        graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
        groups = strongly_connected(graph)
        print(f"{package}: {len(graph.modules)} modules, {len(groups)} import cycles")
        for group in groups:
            cycle = one_cycle(graph, group)
            print(f"  {' -> '.join(cycle)}  ({len(group)} modules in the cycle's group)")
            for importer, imported in itertools.pairwise(cycle):
                for line in graph.get_import_details(importer=importer, imported=imported)[:1]:
                    print(f"      {importer}:{line['line_number']}  {line['line_contents']}")
        found += len(groups)
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    sys.path.insert(0, ".")
    return 1 if report(argv) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
