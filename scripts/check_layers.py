#!/usr/bin/env python3
"""scripts/check_layers.py: checks that dependencies between chatgate's layers go one way.

The sources live in src/<layer>/x.c with their headers in include/chatgate/<layer>/x.h
(docs/architecture.md, "Layers"). Layers are ranked, lowest first:

    core -> config -> proto, dialog -> store, upstream -> server -> main

A file may include headers of its own layer and of lower-ranked layers, never of a higher
one nor of a sibling of the same rank (proto and dialog know nothing of each other, nor do
store and upstream). The script reads every `#include "chatgate/..."` line of src/ and
include/ and prints each one that breaks the rule, as file:line: the line; it exits 1 when
there is one, 0 otherwise. It also refuses a header outside a layer folder, and a cycle of
includes between modules (x.c and x.h are one module, and a header x_internal.h, which only
x's own files include, is x's too): two modules that include each other are one job split
in two, or a function in the wrong file.

    scripts/check_layers.py            check (CI runs this through ctest: lint_layers)
    scripts/check_layers.py --graph    also print the include graph's cycles between modules
                                       and lines per file
"""
import os
import re
import sys

RANK = {"core": 0, "config": 1, "proto": 2, "dialog": 2, "store": 3, "upstream": 3, "server": 4, "main": 5}
INCLUDE = re.compile(r'^\s*#\s*include\s+"chatgate/([^"]+)"')


def layer_of(path):
    """The layer of a source or header path relative to the repo, or None."""
    parts = path.split("/")
    if parts[0] == "src" and len(parts) == 2:
        return "main"
    if parts[0] == "src" and len(parts) == 3:
        return parts[1]
    if parts[:2] == ["include", "chatgate"] and len(parts) == 4:
        return parts[2]
    return None


def module_of(path):
    """src/store/lock.c and include/chatgate/store/lock.h are one module: store/lock (and
    include/chatgate/dialog/rules_internal.h is dialog/rules')."""
    base = os.path.splitext(path)[0]
    if base.endswith("_internal") and path.endswith(".h"):
        base = base[: -len("_internal")]
    for prefix in ("src/", "include/chatgate/"):
        if base.startswith(prefix):
            return base[len(prefix):]
    return base


def sources(root):
    for top in ("src", "include"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if name.endswith((".c", ".h")):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def check(root):
    problems, edges = [], {}
    for path in sources(root):
        layer = layer_of(path)
        if layer not in RANK:
            problems.append(f"{path}:1: not in a layer folder ({', '.join(RANK)})")
        with open(os.path.join(root, path), encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = m.group(1)
                tlayer = target.split("/")[0] if "/" in target else None
                edges.setdefault(module_of(path), set()).add(module_of("include/chatgate/" + target))
                if layer not in RANK:
                    continue
                if tlayer not in RANK:
                    problems.append(f"{path}:{lineno}: {line.strip()}  <- not a header of a layer")
                elif tlayer != layer and RANK[tlayer] >= RANK[layer]:
                    problems.append(f"{path}:{lineno}: {line.strip()}  <- {layer} may not include {tlayer}")
    return problems, edges


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems, edges = check(root)
    found = cycles({k: {t for t in v if t != k} for k, v in edges.items()})
    problems += [f"include cycle between modules: {' <-> '.join(comp)}" for comp in found]
    if "--graph" in sys.argv[1:]:
        print(f"include cycles between modules: {len(found)}")
        for path in sources(root):
            with open(os.path.join(root, path), encoding="utf-8") as f:
                print(f"{sum(1 for _ in f):6d} {path}")
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) against the layering or cycles (docs/architecture.md, Layers)")
        return 1
    print("check_layers: every include goes to its own layer or a lower one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
