"""Copies the benches' markdown tables into the docs pages that quote them.

Why it exists: docs/coverage.md, docs/results.md, docs/benchmark.md and docs/compiled.md quote tables
that bench scripts write under bench/results/; copied by hand, a page drifts from the run it cites. Each
quoted table sits in its page between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`, and
`QUOTES` names the results file and the table in it (by the start of its header row). A bench calls
`refresh_quotes` after writing a results file, which rewrites every quote of that file (a run with
`--out` elsewhere quotes nothing). Tables a page states in its own words (fidelity, per-block,
capacity, service load) are not quoted here; their bench's docstring names the page.

    .venv/bin/python bench/docs_tables.py           # refresh every quote from bench/results/
    .venv/bin/python bench/docs_tables.py --check   # exit 1, naming them, if a page differs
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Quote:
    """One table of a results file, quoted by one docs page between its markers."""

    name: str
    page: str  # relative to the repository root
    results: str  # relative to the repository root
    header: str  # how the table's header row starts

    @property
    def start_marker(self) -> str:
        return f"<!-- bench:{self.name}:start -->"

    @property
    def end_marker(self) -> str:
        return f"<!-- bench:{self.name}:end -->"


SOLVERS_RESULTS = "bench/results/solvers.md"
COMPILED_CHECK_RESULTS = "bench/results/compiled_check.md"
TENSOR_PARALLEL_RESULTS = "bench/results/tensor_parallel.md"
QUOTES = (
    Quote("coverage", "docs/coverage.md", "bench/results/coverage.md", "| model | precision |"),
    Quote("solvers", "docs/results.md", SOLVERS_RESULTS, "| graph | nodes | solver |"),
    Quote("cost-models", "docs/results.md", SOLVERS_RESULTS, "| model | nodes | distinct operators |"),
    Quote("compare-summary", "docs/benchmark.md", "bench/results/compare.md", "| model | mode | peer |"),
    Quote("compare-tally", "docs/benchmark.md", "bench/results/compare.md", "| mode | solver |"),
    Quote("compile-time", "docs/compiled.md", "bench/results/compile_time.md", "| model | torch.compile s |"),
    Quote("compiled-check", "docs/compiled.md", COMPILED_CHECK_RESULTS, "| model | fallback_random |"),
    Quote("tensor-parallel", "docs/usage.md", TENSOR_PARALLEL_RESULTS, "| ranks | split | unplanned |"),
    Quote("out-of-zoo", "docs/coverage.md", "bench/results/out_of_zoo.md", "| model | capture | model /"),
)


def find_table(markdown: str, header: str, source: str) -> str:
    """The one table of `markdown` whose header row starts with `header`, its lines ending in newlines."""
    found: list[list[str]] = []
    current: list[str] | None = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            current = None
        elif current is not None:
            current.append(line)
        elif line.startswith(header):
            current = [line]
            found.append(current)
    if len(found) != 1:
        raise ValueError(f"{source}: {len(found)} tables whose header starts {header!r}; expected one")
    return "".join(f"{line}\n" for line in found[0])


def splice(page: str, quote: Quote, table: str) -> str:
    """`page` with the text between `quote`'s markers replaced by `table` (blank lines around it)."""
    before, start, rest = page.partition(quote.start_marker + "\n")
    _, end, after = rest.partition(quote.end_marker)
    if not start or not end or quote.start_marker in after:
        raise ValueError(
            f"{quote.page}: expected one {quote.start_marker} ... {quote.end_marker} pair; "
            "put the markers around the table the page quotes"
        )
    return f"{before}{start}\n{table}\n{end}{after}"


def quoted_page(quote: Quote, page: str) -> str:
    """`page` (the text of `quote.page`) with the quote as its results file has it now."""
    table = find_table((REPOSITORY / quote.results).read_text(), quote.header, quote.results)
    return splice(page, quote, table)


def refresh(quotes: Sequence[Quote]) -> None:
    """Rewrite each of `quotes` in its page where the results file has changed it, saying so on stderr."""
    for quote in quotes:
        path = REPOSITORY / quote.page
        page = path.read_text()
        updated = quoted_page(quote, page)
        if updated != page:
            path.write_text(updated)
            sys.stderr.write(f"{quote.page}: table {quote.name!r} rewritten from {quote.results}\n")


def refresh_quotes(results_md: Path) -> None:
    """After a bench wrote `results_md`: rewrite every docs quote of it (none if it is not one we quote)."""
    refresh([quote for quote in QUOTES if (REPOSITORY / quote.results).resolve() == results_md.resolve()])


def stale_quotes() -> list[str]:
    """Quotes whose page differs from its results file, as `page (name)`."""
    stale = []
    for quote in QUOTES:
        page = (REPOSITORY / quote.page).read_text()
        if quoted_page(quote, page) != page:
            stale.append(f"{quote.page} ({quote.name})")
    return stale


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description="Copy the benches' tables into the docs pages quoting them.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    arguments = parser.parse_args(argv)
    if arguments.check:
        stale = stale_quotes()
        for entry in stale:
            sys.stderr.write(f"stale: {entry}; run `python bench/docs_tables.py`\n")
        return 1 if stale else 0
    refresh(QUOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
