#!/usr/bin/env python3
"""scripts/check_doc_links.py: fails on a dead link between the repository's Markdown pages.

Reads every .md file git knows of (`git ls-files`, and new files git does not ignore; the
whole tree but build*/ and node_modules/ outside a git checkout) and checks each relative
link in it, `[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, `![alt](path)` and the
reference form `[name]: path`, outside code blocks and code spans:
- the path must name a file or folder of the repository (nothing outside it, such as a sibling folder of the checkout);
- an anchor into a Markdown page must be one of its headings as GitHub writes its id
  (lower case, spaces to '-', punctuation but '-' and '_' dropped, a repeated heading
  getting -1, -2, ...), or an explicit `<a name="...">` / `id="..."` in it.
Links with a scheme (https:, mailto:, ...) are not followed. Each broken link is printed as
FILE:LINE: the link and why; the exit status is 1 when there is one, 0 otherwise.

    scripts/check_doc_links.py          check (ctest: lint_doc_links)
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FENCE = re.compile(r"^\s{0,3}(```+|~~~+)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title"), text holding one level of brackets; target bare or in <...>
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
                    r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+[^>]*\b(?:name|id)\s*=\s*\"([^\"]+)\"|\bid\s*=\s*\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files():
    """Repository-relative paths of the .md files to check."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                              "--", "*.md"], capture_output=True, check=True).stdout
        return sorted({p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))})
    except (OSError, subprocess.CalledProcessError):
        found = []
        for base, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(("build", ".")) and d != "node_modules"]
            found += [os.path.relpath(os.path.join(base, f), ROOT) for f in files if f.endswith(".md")]
        return sorted(found)


def outside_fences(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
        elif m:
            fence = m.group(1)
        else:
            yield number, line


def prose_lines(text):
    """outside_fences, with code spans blanked out (kept as long, so that a link whose text
    is code still reads as a link)."""
    for number, line in outside_fences(text):
        yield number, CODE_SPAN.sub(lambda s: s.group(1) + "x" * len(s.group(2)) + s.group(1), line)


def slug(heading):
    """GitHub's id for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


_anchors = {}


def anchors_of(path):
    """The anchors a Markdown file offers: its headings' ids and explicit HTML ids."""
    if path not in _anchors:
        seen, found = {}, set()
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for _, line in outside_fences(text):
            h = HEADING.match(line)
            if h:
                base = slug(h.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            for a, b in HTML_ID.findall(line):
                found.add(a or b)
        _anchors[path] = found
    return _anchors[path]


def check_link(source, target):
    """None when the link from repository file source to target is good, else why not."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    if not target or SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    if path:
        if path.startswith("/"):
            full = os.path.normpath(os.path.join(ROOT, path.lstrip("/")))
        else:
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(source), path))
        if os.path.relpath(full, ROOT).startswith(".."):
            return "points outside the repository"
        if not os.path.exists(full):
            return f"no such file: {os.path.relpath(full, ROOT)}"
    else:
        full = os.path.join(ROOT, source)
    if anchor and full.endswith(".md") and os.path.isfile(full):
        if anchor not in anchors_of(full):
            return f"no heading '#{anchor}' in {os.path.relpath(full, ROOT)}"
    return None


def main():
    broken = checked = 0
    files = markdown_files()
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for number, line in prose_lines(text):
            targets = [m.group(1) for m in INLINE.finditer(line)]
            ref = REFDEF.match(line)
            if ref:
                targets.append(ref.group(1))
            for target in targets:
                checked += 1
                why = check_link(rel, target)
                if why:
                    broken += 1
                    print(f"{rel}:{number}: ({target}): {why}")
    if broken:
        print(f"{broken} broken link(s) of {checked} in {len(files)} Markdown files")
        return 1
    print(f"{checked} links in {len(files)} Markdown files: all good")
    return 0


if __name__ == "__main__":
    sys.exit(main())
