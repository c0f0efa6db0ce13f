"""README.md and docs/: links that resolve, and benchmark tables that equal the results they quote.

The README is a front page that links into docs/; a renamed page or heading would leave a dead link that
no other test notices. The tables docs/ quotes from bench/results/ are copied by bench/docs_tables.py;
a hand edit or a bench run whose quote was not refreshed shows up here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import docs_tables

REPOSITORY = Path(__file__).resolve().parent.parent

PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(page: Path) -> list[str]:
    text = FENCED.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPOSITORY)}: {broken}"


def test_every_docs_page_is_linked_from_readme() -> None:
    linked = {Path(target.partition("#")[0]).name for target in relative_links(REPOSITORY / "README.md")}
    assert {page.name for page in PAGES[1:]} <= linked


def test_readme_keeps_the_setup_commands() -> None:
    """.ci/run runs the README's test command; `make demo` is the other set-up command."""
    readme = (REPOSITORY / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    assert "make test" in (REPOSITORY / ".ci" / "run").read_text()


def test_quoted_tables_equal_the_bench_results() -> None:
    assert docs_tables.stale_quotes() == []


QUOTE = docs_tables.Quote("example", "docs/example.md", "bench/results/example.md", "| model | peak |")
RESULTS = "# run\n\n| model | peak |\n|---|---|\n| a | 2 |\n\n| model | time |\n|---|---|\n| a | 1 |\n"


def test_splice_replaces_only_the_quoted_table() -> None:
    quoted = "| model | peak |\n|---|---|\n| a | 1 |\n"
    page = f"intro\n\n{QUOTE.start_marker}\n\n{quoted}\n{QUOTE.end_marker}\n\nafter\n"
    table = docs_tables.find_table(RESULTS, QUOTE.header, QUOTE.results)
    assert table == "| model | peak |\n|---|---|\n| a | 2 |\n"
    spliced = docs_tables.splice(page, QUOTE, table)
    assert spliced == page.replace("| a | 1 |", "| a | 2 |")
    assert docs_tables.splice(spliced, QUOTE, table) == spliced


def test_missing_markers_or_tables_are_named() -> None:
    with pytest.raises(ValueError, match=r"docs/example.md: expected one <!-- bench:example:start -->"):
        docs_tables.splice("no markers\n", QUOTE, "| x |\n")
    with pytest.raises(ValueError, match=r"example.md: 2 tables whose header starts '\| model \|'"):
        docs_tables.find_table(RESULTS, "| model |", QUOTE.results)
