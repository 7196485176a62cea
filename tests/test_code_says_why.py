"""Code says why, not when: no issue numbers in comments or docstrings. An issue number sends the
reader to a tracker they may not have, for a story the code should tell itself (or cite docs/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+\b", re.I)
# Files another change is editing: their lines go with that change, and this test then asks for the entry's removal.


def code_files(repo: Path) -> list[Path]:
    """Every module of the top-level packages, and the tests."""
    folders = [p.parent for p in repo.glob("*/__init__.py") if p.parent.name != "specserve"] + [repo / "tests"]
    return sorted(path for folder in folders if folder.is_dir() for path in folder.rglob("*.py"))


def issue_numbers(repo: Path) -> dict[str, list[str]]:
    found = {}
    for path in code_files(repo):
        hits = [f"{number}: {line.strip()}" for number, line in enumerate(path.read_text().splitlines(), 1)
                if ISSUE_NUMBER.search(line)]
        if hits:
            found[str(path.relative_to(repo))] = hits
    return found


def test_no_code_cites_an_issue_number():
    found = issue_numbers(REPO)
    assert found == {}


def test_the_check_sees_an_issue_number_and_passes_a_plain_word(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    cited = "(issue" + " 31)"   # spelled apart, so this file passes its own check
    (tmp_path / "pkg" / "a.py").write_text(f'"""Capture {cited}."""\nissue_target_ratio = 1.1  # no issue here\n')
    assert issue_numbers(tmp_path) == {"pkg/a.py": [f'1: """Capture {cited}."""']}
