"""bench/results/ holds what the docs cite, compactly: no orphans, no per-sample bulk.

A results file nobody cites is a superseded sweep (git keeps it) and must go; a benchmark that
writes every sample instead of a summary would grow the repo run after run. So every file in
bench/results/ must be cited as `bench/results/NAME` (exactly, by a glob, or without its extension)
by README.md, a docs/*.md, or bench/ or tests/ code, and the folder stays under MAX_TOTAL_BYTES.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MAX_TOTAL_BYTES = 5 * 1024 * 1024
CITATION = re.compile(r"bench/results/([\w.*-]+)")


def citing_texts(repo: Path) -> list[Path]:
    return [repo / "README.md", *(repo / "docs").glob("*.md"), *(repo / "bench").glob("*.py"),
            *(repo / "tests").glob("*.py")]


def cited_names(texts: list[Path], results: Path) -> set[str]:
    """Names of the files in results that some text cites."""
    names = {p.name for p in results.iterdir()}
    cited: set[str] = set()
    for path in texts:
        if not path.exists():
            continue
        for citation in CITATION.findall(path.read_text()):
            citation = citation.rstrip(".")
            if "*" in citation:
                cited.update(p.name for p in results.glob(citation))
            elif citation in names:
                cited.add(citation)
            else:
                cited.update(n for n in names if n.startswith(citation + "."))
    return cited


def orphans(repo: Path) -> list[str]:
    results = repo / "bench" / "results"
    return sorted({p.name for p in results.iterdir()} - cited_names(citing_texts(repo), results))


def test_every_results_file_is_cited_by_the_docs_or_the_code():
    assert orphans(REPO) == [], "cite these in docs/ (or delete them: git keeps them)"


def test_bench_results_stays_small():
    total = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert total < MAX_TOTAL_BYTES, f"bench/results holds {total / 1e6:.1f} MB: keep summaries, not every sample"


def test_an_uncited_file_is_an_orphan_and_a_glob_or_stem_citation_counts(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in ("a.md", "a.json", "run-1.md", "run-2.md", "old.json"):
        (results / name).write_text("{}")
    (tmp_path / "README.md").write_text("see `bench/results/a` and ![plot](bench/results/run-*.md).")
    assert orphans(tmp_path) == ["old.json"]
    (tmp_path / "docs" / "x.md").write_text("(`bench/results/old.json`)")
    assert orphans(tmp_path) == []


def out_defaults(source: str) -> list[str]:
    """The source text of every `--out` argument's default (an AST walk over add_argument calls)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
            found.extend(ast.unparse(k.value) for k in node.keywords if k.arg == "default")
    return found


def test_the_tools_users_run_write_to_a_git_ignored_folder_by_default():
    """bench/results/ holds cited figures only: a trial `specserve bench` must not add files there
    (the scripts in bench/figures/ reproduce a cited file, so they write into it on purpose)."""
    from specserve.bench import DEFAULT_OUT_DIR

    defaults = {str(p.relative_to(REPO)): out_defaults(p.read_text()) for p in (REPO / "bench").glob("*.py")}
    assert {path: found for path, found in defaults.items() if any("results" in d for d in found)} == {}
    assert all(found for path, found in defaults.items() if path.endswith(("run.py", "load_sweep.py", "soak.py")))
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT_DIR}/run.json"], cwd=REPO)
    assert ignored.returncode == 0, f"{DEFAULT_OUT_DIR}/ must be in .gitignore"


def test_an_out_default_is_read_from_the_source():
    assert out_defaults('p.add_argument("--out", default="bench/results")\np.add_argument("--n", default=3)') == [
        "'bench/results'"]
