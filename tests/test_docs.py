"""The docs stay true to the tree: every command they quote names a module that exists, every link
points at a file that exists, no path from one developer's machine, and architecture.md's map of
the house names every module, under its own package."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = sorted((REPO / "bench" / "results").glob("*.md"))
PYTHON_M = re.compile(r"python3? -m ([\w.]+)")
RELATIVE_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)")
DOC_MENTION = re.compile(r"(?<![\w/.])(docs/[\w.-]+\.md)")
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|Users)/[\w.-]+")
MAP_ENTRY = re.compile(r"^    [├└]── ([\w]+)/", re.M)


def module_exists(name: str, repo: Path = REPO) -> bool:
    """specserve.x.y is x/y.py (or a package x/y/) in the checkout; anything else must be importable."""
    if name == "specserve" or name.startswith("specserve."):
        path = repo.joinpath(*name.split(".")[1:])
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or path == repo
    return importlib.util.find_spec(name) is not None


def missing_modules(texts: dict[str, str], repo: Path = REPO) -> list[str]:
    return sorted({f"{where}: python -m {name}" for where, text in texts.items()
                   for name in PYTHON_M.findall(text) if not module_exists(name.rstrip("."), repo)})


def test_every_quoted_python_m_command_names_a_module_that_exists():
    texts = {str(p.relative_to(REPO)): p.read_text() for p in [*DOCUMENTS, *RESULTS]}
    assert missing_modules(texts) == []


def test_every_link_and_docs_mention_points_at_a_file():
    broken = []
    for document in DOCUMENTS:
        text = document.read_text()
        broken += [f"{document.relative_to(REPO)}: {target}" for target in RELATIVE_LINK.findall(text)
                   if not (document.parent / target).exists()]
        broken += [f"{document.relative_to(REPO)}: {target}" for target in DOC_MENTION.findall(text)
                   if not (REPO / target).exists()]
    assert broken == []


def test_no_document_shows_a_path_from_one_developers_machine():
    """What a reader copies must run on their machine (results files keep the paths a run recorded)."""
    found = [f"{p.relative_to(REPO)}: {m}" for p in DOCUMENTS for m in MACHINE_PATH.findall(p.read_text())]
    assert found == []


def house_map(architecture: str) -> dict[str, str]:
    """Package -> its part of the map under "## The house" (the lines from its entry to the next one)."""
    house = architecture.split("## The house", 1)[1].split("\n## ", 1)[0]
    starts = list(MAP_ENTRY.finditer(house))
    return {m.group(1): house[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(house))]
            for i, m in enumerate(starts)}


def unmapped_modules(repo: Path, architecture: str) -> list[str]:
    parts = house_map(architecture)
    packages = sorted(p.parent.name for p in repo.glob("*/__init__.py") if p.parent.name not in ("tests", "specserve"))
    return [str(path.relative_to(repo)) for package in packages for path in sorted((repo / package).rglob("*.py"))
            if path.name != "__init__.py" and not re.search(rf"(?<![\w/]){re.escape(path.name)}", parts.get(package, ""))]


def test_the_architecture_map_names_every_module_under_its_package():
    assert unmapped_modules(REPO, (REPO / "docs" / "architecture.md").read_text()) == []


def test_the_checks_see_a_missing_module_an_unmapped_one_and_a_machine_path(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "run.py").write_text("")
    (tmp_path / "bench" / "gone_soon.py").write_text("")
    assert missing_modules({"x.md": "`python -m specserve.bench.run` and `python -m bench.old`"}, tmp_path) == [
        "x.md: python -m bench.old"]
    architecture = "## The house\n\n    ├── bench/   run.py\n    ├── k8s/\n\n## Next\n gone_soon.py\n"
    assert unmapped_modules(tmp_path, architecture) == ["bench/gone_soon.py"]
    assert MACHINE_PATH.findall("`flock /work/wt/bench.lock` and bench/results/x.md") == ["/work/wt"]


def test_the_readme_is_a_front_door_of_at_most_300_lines_whose_two_commands_exist():
    """Depth goes to docs/; `make serve` and `make test` are the two commands a fresh machine needs."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    quoted = re.findall(r"^make ([\w-]+)", readme.split("## Two commands on a fresh machine", 1)[1], re.M)
    assert quoted[:2] == ["serve", "test"] and set(quoted) <= targets


EQUALITY_TEST = re.compile(
    r"^def (test_\w*(?:greedy|rows|logits|steps|drafts|completion|generation)\w*(?:equal|identical|bitwise)\w*"
    r"|test_\w*(?:equal|identical|bitwise)\w*(?:target_only|hf|generate|alone|model_runner|models_own|transformers)\w*)",
    re.M)
# Equalities of pure functions over rows they are given: they hold on any device.
DEVICE_FREE = {"test_rejection.py", "test_top_p_candidates.py"}


def modules_claiming_equality_without_saying_where(tests: Path) -> list[str]:
    """Test modules with a model-output equality test whose docstring does not say it holds on CPU in float32."""
    unsaid = []
    for path in sorted(tests.glob("test_*.py")):
        source = path.read_text()
        if path.name in DEVICE_FREE or not EQUALITY_TEST.search(source):
            continue
        docstring = " ".join((ast.get_docstring(ast.parse(source)) or "").split())
        if "on CPU in float32" not in docstring or "docs/gpu.md" not in docstring:
            unsaid.append(path.name)
    return unsaid


def test_tests_that_claim_equality_say_they_hold_on_cpu_in_float32():
    """The GPU contract (docs/gpu.md) promises less than these tests check: they say where they hold."""
    assert modules_claiming_equality_without_saying_where(REPO / "tests") == []


def test_the_equality_check_sees_an_unqualified_module(tmp_path):
    (tmp_path / "test_a.py").write_text('"""Greedy equals target-only."""\ndef test_greedy_equals_target_only():\n    pass\n')
    (tmp_path / "test_b.py").write_text('"""Holds on CPU in float32 (docs/gpu.md)."""\ndef test_rows_equal_alone():\n    pass\n')
    assert modules_claiming_equality_without_saying_where(tmp_path) == ["test_a.py"]
