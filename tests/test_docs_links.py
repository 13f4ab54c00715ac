"""Every relative link in README.md and docs/*.md leads to a file, and a heading, that exist.

The documentation is split across pages that link to each other's sections; a
section renamed or moved must not leave a reader at a dead link. Links are read
as GitHub renders them: code (fenced blocks, inline spans) holds no links, and a
heading's anchor is its text lower-cased, punctuation dropped, spaces as hyphens.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def without_code(text: str) -> str:
    """The page as prose: fenced blocks and code spans removed (GitHub renders no link or heading in them)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation gone, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor a page offers: its headings' (repeats suffixed -1, -2..., as on GitHub), explicit ones."""
    text = FENCE.sub("", page.read_text())
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def relative_links(page: Path) -> list[str]:
    prose = without_code(page.read_text())
    targets = INLINE_LINK.findall(prose) + REFERENCE.findall(prose)
    return [t for t in targets if not EXTERNAL.match(t)]


def broken(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, leads nowhere; None when it leads somewhere."""
    path_part, _, fragment = target.partition("#")
    destination = (page.parent / path_part).resolve() if path_part else page
    if not destination.exists():
        shown = destination.relative_to(REPO) if destination.is_relative_to(REPO) else destination
        return f"{target}: no such file {shown}"
    if fragment and destination.suffix == ".md" and fragment not in anchors(destination):
        return f"{target}: {destination.name} has no heading with the anchor #{fragment}"
    return None


def test_the_pages_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/cli.md", "docs/format.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    problems = [why for target in relative_links(page) if (why := broken(page, target))]
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_links_are_read_as_github_renders_them() -> None:
    """The parsing itself, on a sample: code holds no links, anchors follow GitHub's rules."""
    sample = (
        "See [the CLI](docs/cli.md#exit-codes) and [`serve`](serve.md).\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[nor this](nowhere.md)\n# nor a heading\n```\n"
        "[ref]: docs/format.md\n"
        "[out](https://example.com/x.md)\n"
    )
    prose = without_code(sample)
    assert INLINE_LINK.findall(prose) == ["docs/cli.md#exit-codes", "serve.md", "https://example.com/x.md"]
    assert REFERENCE.findall(prose) == ["docs/format.md"]
    assert (
        slug("CUDA graphs and compiled code: `hibernate.pool()`")
        == "cuda-graphs-and-compiled-code-hibernatepool"
    )
    assert slug("Time-sharing: `--gpu-budget`") == "time-sharing---gpu-budget"
    assert slug("vLLM's development endpoints") == "vllms-development-endpoints"
