"""Every relative Markdown link of the documentation resolves: the file or folder it names exists
and, for ``file.md#anchor`` or ``#anchor``, the target file has a heading (or an HTML ``id`` /
``name``) with that anchor, spelled as GitHub spells heading anchors. Links with a scheme
(``https:``, ``mailto:``) are not checked; nor are links inside code blocks or code spans."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "benchmarks" / "results").glob("*.md"),
        *(ROOT / "examples").glob("**/*.md"),
    }
)

# Written by another tool (the flags reference, generated from the parser): links to it are
# accepted while it does not exist yet, and checked like any other once it does.
GENERATED = {ROOT / "docs" / "flags.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<[^>]+\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (fenced lines are blanked, so line numbers hold)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation other than ``-`` and
    ``_`` removed, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of ``path``'s headings (repeats numbered ``-1``, ``-2`` as GitHub does) and of
    its HTML ``id``/``name`` attributes."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    lines = prose_lines(path.read_text(encoding="utf-8"))
    for line in lines:
        if match := HEADING.match(line):
            slug = github_slug(match.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(HTML_ANCHOR.findall(line))
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``path``'s prose."""
    text = "\n".join(prose_lines(path.read_text(encoding="utf-8")))
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # keep line numbers
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def broken(path: Path) -> list[str]:
    """One line per link of ``path`` that does not resolve."""
    problems = []
    for line, target in links(path):
        if SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if dest in GENERATED and not dest.exists():
            continue
        name = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
        if not dest.exists():
            problems.append(f"{where}: no such file {name}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {name}")
    return problems


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists(), path
    assert not broken(path), "\n".join(broken(path))


def test_the_checker_sees_broken_links_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    other = "# Other page\n\n## Some `code`: here\n\n## Some `code`: here\n"
    (tmp_path / "other.md").write_text(other)
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Top\n\n[ok](other.md) [ok](other.md#some-code-here) [ok](other.md#some-code-here-1)\n"
        "[ok](#top) [ok](https://example.com/x) `[skipped](missing.md)`\n\n"
        "```\n[skipped](missing.md)\n```\n\n"
        "[bad](missing.md) [bad](other.md#nowhere) [bad](#nowhere)\n"
    )
    problems = broken(doc)
    assert [p.split(": ")[1] for p in problems] == ["missing.md", "other.md#nowhere", "#nowhere"]
    assert all(p.startswith("doc.md:10:") for p in problems)


# A document named from the repository root in any committed text file (code, docs, scripts):
# the path alone, with ``#anchor``, or followed (after a comma or a space) by a quoted section
# title, as in ``docs/<page>.md, "Section"`` (quotes of either kind).
REFERENCE = re.compile(
    r"(?<![\w/.-])((?:docs|benchmarks|examples)/[\w/.-]*?\w\.md|README\.md)"
    r"(?:#([\w-]+)|(?:,\s*|\s+)[\"'“‘]([^\"'”’\n]{3,80})[\"'”’])?"
)
REFERENCING = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cfg", ""}


def referencing_files() -> list[Path]:
    """The committed text files that may name a document (git's list; the tree's outside git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        paths = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in paths if p.suffix in REFERENCING and p.is_file()]


def broken_references(path: Path) -> list[str]:
    """One line per reference of ``path`` to a document, anchor or section that does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    problems = []
    for m in REFERENCE.finditer(text):
        name, anchor, section = m.groups()
        dest = ROOT / name
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        if dest in GENERATED and not dest.exists():
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor}")
        elif section and github_slug(section) not in anchors(dest):
            problems.append(f"{where}: no section {section!r}")
    return problems


def test_every_document_and_section_named_in_the_tree_exists():
    problems = [line for path in referencing_files() for line in broken_references(path)]
    assert not problems, "\n".join(problems)


def test_the_reference_checker_sees_missing_documents_and_sections(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Policy-loss variants\n")
    guide, missing = "docs" + "/guide.md", "docs" + "/missing.md"  # not references here
    code = tmp_path / "code.py"
    code.write_text(
        f'"""See {guide}, "Policy-loss variants", {guide}#guide and {guide} \'Guide\'.\n'
        f'Not: {guide}, "Add a term"; {guide}#nowhere; {missing}."""\n'
    )
    problems = broken_references(code)
    assert [p.split(": ", 2)[2] for p in problems] == [
        "no section 'Add a term'",
        "no heading with anchor #nowhere",
        "no such file",
    ]
    assert all(p.startswith("code.py:2:") for p in problems)
