"""Every figure the README and docs/ publish comes from a results file in the repo, named beside it.

Checked, in README.md and every docs/*.md: every block (paragraph, list item, table) of
docs/performance.md (and of any section titled Performance), and any block elsewhere that quotes
tok/s or a × ratio or cites `bench/results/`. A checked block that holds a number must cite at least
one results file as `bench/results/NAME` (NAME may end in .md, .json, .log or .diff, or carry a glob
such as `pipeline-ahead-*`); a table also counts the files cited by the paragraph just above it, and a
list item those cited by its list's lead-in text. Each number must appear in one of those files,
written with at least as many decimals and rounding (half up) to the document's digits: 0.18 matches
0.175, 144.2 matches 144.21875, 1.67x matches 1.67.
Not checked: inline code, link targets, ISO dates. A computed figure (a ratio of two table
entries, say) that no file prints fails: print it in the report, or quote its parts.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
ALL_FIGURES = {REPO / "docs" / "performance.md"}  # documents whose every block is a figure to check
RESULTS_EXTENSIONS = (".md", ".json", ".log", ".diff")

CITATION = re.compile(r"bench/results/[\w.*-]+")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?=x\b|(?![\w.])|\.(?!\w))")
FILE_NUMBER = re.compile(r"\d+(?:\.\d+)?")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
QUOTES_FIGURES = re.compile(r"tok/s|×|\d(?:\.\d+)?x\b|bench/results/")


def sections(text: str) -> dict[str, list[str]]:
    """'## Title' -> the section's lines."""
    found: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
        found.setdefault(current, []).append(line)
    return found


def blocks(lines: list[str]) -> list[tuple[str, str]]:
    """(text, inherited citation text) per paragraph, list item and table."""
    paragraphs: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    found: list[tuple[str, str]] = []
    previous = ""
    for paragraph in filter(None, paragraphs):
        if paragraph[0].startswith("#"):
            paragraph = paragraph[1:]
            if not paragraph:
                continue
        text = "\n".join(paragraph)
        if paragraph[0].startswith("|"):
            found.append((text, previous))
        else:
            first_item = next((i for i, line in enumerate(paragraph) if line.lstrip().startswith("- ")), None)
            lead = "\n".join(paragraph[:first_item]) if first_item is not None else text
            found.append((lead, ""))
            if first_item is not None:
                items: list[list[str]] = []
                for line in paragraph[first_item:]:
                    if line.lstrip().startswith("- "):
                        items.append([line])
                    else:
                        items[-1].append(line)
                found.extend(("\n".join(item), lead) for item in items)
        previous = text
    return found


def cited_files(text: str) -> list[Path]:
    files: list[Path] = []
    for citation in CITATION.findall(text):
        citation = citation.rstrip(".")
        if "*" in citation:
            files.extend(p for p in sorted(REPO.glob(citation)) if p.suffix in RESULTS_EXTENSIONS)
        elif (REPO / citation).suffix in RESULTS_EXTENSIONS:
            files.append(REPO / citation)
        else:
            files.extend(REPO / (citation + ext) for ext in RESULTS_EXTENSIONS if (REPO / (citation + ext)).exists())
    return files


def numbers_in_prose(text: str) -> list[str]:
    text = LINK_TARGET.sub("]", INLINE_CODE.sub(" ", DATE.sub(" ", text)))
    return NUMBER.findall(text)


def appears_in(number: str, file_numbers: set[str]) -> bool:
    """Shown with d decimals: some file number with >= d decimals rounds (half up) to it."""
    shown = Decimal(number)
    decimals = -shown.as_tuple().exponent
    for candidate in file_numbers:
        value = Decimal(candidate)
        if -value.as_tuple().exponent >= decimals and value.quantize(shown, rounding=ROUND_HALF_UP) == shown:
            return True
    return False


def checked_blocks(document: Path) -> list[tuple[str, str]]:
    checked = []
    for title, lines in sections(document.read_text()).items():
        for text, inherited in blocks(lines):
            if document in ALL_FIGURES or title == "Performance" or QUOTES_FIGURES.search(text):
                checked.append((text, inherited))
    return checked


def all_checked_blocks() -> list[tuple[str, str, str]]:
    return [(str(document.relative_to(REPO)), text, inherited)
            for document in DOCUMENTS for text, inherited in checked_blocks(document)]


def figure_problems(text: str, inherited: str) -> list[str]:
    numbers = numbers_in_prose(text)
    if not numbers:
        return []
    files = cited_files(text) + cited_files(inherited)
    missing_files = [str(f.relative_to(REPO)) for f in files if not f.exists()]
    if missing_files:
        return [f"cites missing file(s) {missing_files}"]
    if not files:
        return [f"quotes {numbers} but cites no bench/results/ file"]
    file_numbers: set[str] = set()
    for path in files:
        file_numbers.update(FILE_NUMBER.findall(path.read_text()))
    return [f"{n} not in {[f.name for f in files]}" for n in numbers if not appears_in(n, file_numbers)]


def test_the_readme_headline_and_the_performance_doc_are_checked_at_all():
    assert len(checked_blocks(REPO / "docs" / "performance.md")) >= 20
    assert any("**Headline.**" in text for text, _ in checked_blocks(README))


@pytest.mark.parametrize("document,text,inherited", all_checked_blocks(),
                         ids=lambda s: s[:40] if s else "-")
def test_every_published_figure_appears_in_the_results_file_it_cites(document, text, inherited):
    assert figure_problems(text, inherited) == [], f"in {document}"


# -- the checker itself --------------------------------------------------------------------------------

def test_rounding_to_the_shown_decimals_matches():
    assert appears_in("0.18", {"0.175"})
    assert appears_in("144.2", {"144.21875"})
    assert appears_in("193", {"192.9"})
    assert not appears_in("0.17", {"0.175"})
    assert not appears_in("135.5", {"135.4", "141.3"})
    assert not appears_in("1.933", {"1.93"})  # more digits than the file has


def test_numbers_in_code_dates_and_link_targets_are_not_figures():
    assert numbers_in_prose("`--runs 3` on 2026-11-22 ![x](bench/results/v2.png) 1.67× and 1.5x") == ["1.67", "1.5"]


def test_a_figure_missing_from_the_cited_file_is_reported():
    problems = figure_problems("went from 120.0 to 135.5 tok/s (`bench/results/cpu-2core-distilled-draft.md`)", "")
    assert problems == ["135.5 not in ['cpu-2core-distilled-draft.md']"]


def test_a_figure_without_a_citation_is_reported():
    assert figure_problems("a lone stream ran at 97.3 tok/s", "") == ["quotes ['97.3'] but cites no bench/results/ file"]


def test_a_wrong_figure_in_the_readme_headline_is_caught():
    """The real headline block passes; the same block with one figure off by a tenth does not."""
    headline = next(text for text, _ in checked_blocks(README) if "**Headline.**" in text)
    figure = re.search(r"\d+\.\d\b", headline).group()   # its first figure: the greedy stream's tok/s
    wrong = f"{float(figure) + 0.1:.1f}"
    assert figure_problems(headline, "") == []
    assert figure_problems(headline.replace(figure, wrong), "") == [
        f"{wrong} not in ['cpu-2core-thirdparty-http.md']"]


def test_a_table_in_docs_inherits_the_citation_of_the_paragraph_above_it():
    """A table row's figure is checked against the file its lead-in paragraph cites: change one cell
    of the depth table in docs/performance.md and it fails."""
    blocks_ = checked_blocks(REPO / "docs" / "performance.md")
    table, inherited = next((t, i) for t, i in blocks_ if t.startswith("| streams | adaptive (mean K)"))
    assert "bench/results/" not in table and figure_problems(table, inherited) == []
    assert figure_problems(table.replace("127.4", "931.4"), inherited) != []
