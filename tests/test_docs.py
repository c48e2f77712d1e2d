"""The documentation's own checks: README.md and docs/*.md point only at things the repository has, README stays a
page one reads in a few minutes, and nothing cites a design file that users of the repository do not have.

- Every relative markdown link ``[text](path)`` resolves (against the page's folder) to a file or directory of the
  repository.
- Every repository path written in backticks resolves (against the repository root). A backticked token counts as a
  repository path when it has no space, contains a "/", and its first component is a top-level entry of the
  repository (``pipeline``, ``docs``, ``launchers``, ...). Skipped: globs (``*``, ``?``), URLs, placeholders in
  capitals (``launchers/configs/NAME.yaml``, when no such file exists) and paths git ignores (the outputs of a run,
  such as ``data/shards/rfam_demo/``). ``a/{b,c}.yaml`` is checked as ``a/b.yaml`` and ``a/c.yaml``; a pytest node id
  (``tests/x.py::test_y``) as its file. Fenced code blocks are commands, not references, and are not read.
- No text file of the repository (tracked, or new and not ignored) contains the design file's name, except this one.
- README.md has at most 200 lines.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
FORBIDDEN = "DESIGN" + ".md"  # spelled in two parts so that only the assertion below names it

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _git(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [line for line in out.stdout.split("\0" if "-z" in args else "\n") if line]


def repository_files() -> list[str]:
    """Tracked files plus new files git does not ignore (a page written but not yet committed counts)."""
    files = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if files is None:
        pytest.skip("not a git checkout: the repository's file list comes from git")
    return sorted({f for f in files if (ROOT / f).is_file()})


def top_level_entries() -> set[str]:
    return {f.split("/", 1)[0] for f in repository_files()}


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_blocks(page: Path):
    """(first line number, text) of every paragraph outside fenced code blocks: an inline code span or a link may wrap
    onto the next line of its paragraph, never across a blank line."""
    fence, start, block = None, 0, []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines() + [""], 1):
        marker = line.lstrip()[:3]
        if fence is None and marker not in ("```", "~~~") and line.strip():
            if not block:
                start = number
            block.append(line)
            continue
        if block:
            yield start, "\n".join(block)
            block = []
        if marker in ("```", "~~~"):
            fence = marker if fence is None else (None if marker == fence else fence)


def line_of(start: int, text: str, offset: int) -> int:
    return start + text.count("\n", 0, offset)


def expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand_braces(token[:m.start()] + alt + token[m.end():])]


def git_ignored(paths: list[str]) -> set[str]:
    if not paths:
        return set()
    out = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                         capture_output=True, text=True, timeout=60)
    return {line for line in out.stdout.splitlines() if line}


def backticked_paths(text: str, top: set[str]) -> list[tuple[int, str]]:
    """(offset, path) of the repository paths among the inline code spans of a paragraph (see the module docstring)."""
    found = []
    for m in CODE_SPAN.finditer(text):
        token = m.group(2).strip()
        if not token or any(c.isspace() for c in token) or "/" not in token or "://" in token \
                or any(c in token for c in "*?"):
            continue
        token = token.split("::", 1)[0]
        if token.split("/", 1)[0] not in top:
            continue
        found.extend((m.start(), path) for path in expand_braces(token))
    return found


def exists_in_repository(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return path.exists()


def is_placeholder(token: str) -> bool:
    return any(PLACEHOLDER.match(part.split(".", 1)[0]) for part in token.strip("/").split("/"))


def test_links_and_paths_in_the_docs_resolve():
    top = top_level_entries()
    broken, candidates = [], []
    for page in doc_pages():
        rel = page.relative_to(ROOT)
        for start, text in prose_blocks(page):
            for m in LINK.finditer(text):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, mailto: or an anchor on the same page
                path = target.split("#", 1)[0]
                if not exists_in_repository(page.parent / path):
                    broken.append(f"{rel}:{line_of(start, text, m.start())}: broken link [...]({target})")
            for offset, token in backticked_paths(text, top):
                candidates.append((rel, line_of(start, text, offset), token))
    missing = [(rel, number, token) for rel, number, token in candidates if not exists_in_repository(ROOT / token)]
    ignored = git_ignored([token.rstrip("/") for _, _, token in missing])
    for rel, number, token in missing:
        if token.rstrip("/") in ignored or is_placeholder(token):
            continue
        broken.append(f"{rel}:{number}: `{token}` is not a file or directory of the repository")
    assert not broken, "broken references in the docs:\n" + "\n".join(broken)


def test_no_file_cites_the_design_file():
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = []
    for name in repository_files():
        if name == this:
            continue
        data = (ROOT / name).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        if FORBIDDEN.encode() not in data:
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if FORBIDDEN in line:
                hits.append(f"{name}:{number}: cites {FORBIDDEN}: {line.strip()[:100]}")
    assert not hits, (f"{FORBIDDEN} is not part of the repository; write the fact into docs/ (docs/architecture.md "
                      "or the family page) and cite that page and heading instead:\n" + "\n".join(hits))


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md:{len(lines)}: README.md has {len(lines)} lines, at most {README_MAX_LINES}; move the detail into "
        "a page under docs/ and link it from README's table of docs pages")
