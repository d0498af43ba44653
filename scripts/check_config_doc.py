#!/usr/bin/env python3
"""scripts/check_config_doc.py: holds docs/configuration.md to the flags and keys the code takes.

Reads, from the source (not from a binary, so it runs without a build):
- src/config/config.c: the table of settings (`settings[]`: each key, and whether it is also
  a flag, `--` + the key with '_' as '-'), an upstream's keys (`upstream_settings[]` and
  `upstream_keys[]`, as `upstreams.NAME.KEY`), the structured keys (`structured_keys[]`:
  services, limits, dropin), and the flags that are no setting (the `--FLAG` lines of
  cg_config_usage: --upstream, --config, --help, ...);
- src/main.c: the `rules` subcommands (`rules check`, ...) and their `--FLAG`s;
and fails, naming each one, when the tables of docs/configuration.md lack it: a key must
start a code span in a "config key" or "key" column (`redis.lease_ms`), a flag one in a
"flag" column (`--listen HOST:PORT`), and a subcommand and its flags must stand in a code
span of a "command" column (`chatgate rules explain DIR TEXT [--state FILE]`); a mention in
the prose does not count. The other way round, every such code span must name a flag, key or
subcommand the code takes (a key column may also name a section of keys, `upstreams.NAME`,
or a drop-in key src/config/dropin_config.c checks that --help-config does not list), so the
page cannot keep one that is gone. Exit status 1 on any mismatch, else 0.

    scripts/check_config_doc.py          check (ctest: lint_config_doc)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_C = os.path.join(ROOT, "src", "config", "config.c")
DROPIN_C = os.path.join(ROOT, "src", "config", "dropin_config.c")
MAIN_C = os.path.join(ROOT, "src", "main.c")
DOC = os.path.join(ROOT, "docs", "configuration.md")

CODE_SPAN = re.compile(r"`([^`]+)`")


def table(source, name):
    """The text of the C array `name[] = { ... };` in source."""
    m = re.search(r"\b" + re.escape(name) + r"\[\]\s*=\s*\{(.*?)\n\};", source, re.S)
    if not m:
        sys.exit(f"check_config_doc.py: no table {name}[] in {os.path.relpath(CONFIG_C, ROOT)}: has it moved?")
    return m.group(1)


def first_strings(body):
    """The first string of each row of a table body: rows start a line with {"..."."""
    return re.findall(r'^\s*\{"([^"]+)"', body, re.M)


def code_keys_and_flags():
    """({key}, {flag}, {subcommand}, {subcommand flag}, {other}) as the source defines them;
    other: what a key cell may name besides a key, the sections keys stand in
    (`upstreams.NAME`, `limits`) and the drop-in keys dropin_config.c checks that
    --help-config does not list."""
    with open(CONFIG_C, encoding="utf-8") as f:
        config = f.read()
    with open(MAIN_C, encoding="utf-8") as f:
        main_c = f.read()
    keys, flags = set(), set()
    # {"name", T_TYPE, OFF(field), min, max, choices, flag, help}
    for name, flag in re.findall(r'^\s*\{"([^"]+)",\s*T_\w+,\s*OFF\([^)]*\),\s*[^,]+,\s*[^,]+,\s*\w+,\s*([01]),',
                                 table(config, "settings"), re.M):
        keys.add(name)
        if flag == "1":
            flags.add("--" + name.replace("_", "-"))
    keys |= {"upstreams.NAME." + k for k in first_strings(table(config, "upstream_settings"))}
    keys |= {"upstreams.NAME." + k for k in first_strings(table(config, "upstream_keys"))}
    keys |= set(first_strings(table(config, "structured_keys")))
    usage = re.search(r"void cg_config_usage\(.*?\n\}", config, re.S)
    if not usage:
        sys.exit("check_config_doc.py: no cg_config_usage() in src/config/config.c: has it moved?")
    flags |= {"--" + f for f in re.findall(r'"  --%-\d+s %s\\n",\s*"([\w-]+)', usage.group(0))}
    subcommands = {"rules " + s for s in re.findall(r'strcmp\(argv\[2\], "(\w+)"\)', main_c)}
    sub_flags = set(re.findall(r'"(--[a-z][\w-]*)"', main_c))
    if not {"listen", "upstreams.NAME.url"} <= keys or not {"--listen", "--config"} <= flags or not subcommands:
        sys.exit("check_config_doc.py: src/config/config.c or src/main.c no longer reads as expected: "
                 "update the script with them")
    other = {k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)}
    with open(DROPIN_C, encoding="utf-8") as f:
        other |= set(re.findall(r"(dropin(?:\.\w+)+):", f.read()))
    return keys, flags, subcommands, sub_flags, other


def table_cells(text):
    """[(line, column header, code span)] of the code spans in the page's table cells."""
    cells, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in row]
            continue
        if set(line) <= set("|-: "):
            continue
        for col, cell in zip(header, row):
            cells += [(number, col, s) for s in CODE_SPAN.findall(cell)]
    return cells


def main():
    keys, flags, subcommands, sub_flags, other = code_keys_and_flags()
    with open(DOC, encoding="utf-8") as f:
        cells = table_cells(f.read())
    doc = os.path.relpath(DOC, ROOT)
    problems = []
    listed = {"flag": set(), "key": set(), "command": set()}
    for number, col, span in cells:
        words = span.split() or [span]
        if col == "flag":
            listed["flag"].add(words[0])
            if words[0] not in flags:
                problems.append(f"{doc}:{number}: `{span}`: no such flag in src/config/config.c")
        elif col in ("config key", "key"):
            listed["key"].add(words[0])
            if words[0] not in keys | other:
                problems.append(f"{doc}:{number}: `{span}`: no such config key in src/config/config.c")
        elif col == "command":
            flags_here = {w.strip("[]") for w in words if w.strip("[]").startswith("--")}
            subs_here = {f"rules {b}" for a, b in zip(words, words[1:]) if a == "rules"}
            listed["command"] |= flags_here | subs_here
            for bad in sorted((flags_here - sub_flags) | (subs_here - subcommands)):
                problems.append(f"{doc}:{number}: `{span}`: no `{bad}` in src/main.c")
    for key in sorted(keys - listed["key"]):
        problems.append(f"{doc}: the config key `{key}` (src/config/config.c) is not in a table's key column")
    for flag in sorted(flags - listed["flag"]):
        problems.append(f"{doc}: the flag `{flag}` (src/config/config.c) is not in a table's flag column")
    for word in sorted((subcommands | sub_flags) - listed["command"]):
        problems.append(f"{doc}: `{word}` (src/main.c) is not in a table's command column")
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} mismatch(es) between {doc} and the code's {len(keys)} keys, "
              f"{len(flags)} flags and {len(subcommands)} commands")
        return 1
    print(f"{doc}: every one of the {len(keys)} config keys, {len(flags)} flags and "
          f"{len(subcommands)} commands is listed, and nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main())
