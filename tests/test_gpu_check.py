"""The prepared GPU check (bench/gpu_check.py, docs/testing.md "The GPU check") runs its CPU smoke here,
so the one command a rare, brief GPU machine gets never rots: every section runs on tiny configs
in a fresh interpreter where Ray and llguidance cannot be imported (the GPU machine has neither),
the report is written where it is told, and a time limit already spent skips every section (and
one spent inside a section, the checks left) with a line saying so."""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Not on the GPU machine, and not carried there (docs/testing.md). pydantic is not there either, but
# SamplingParams is a pydantic model, so it travels in .whl/ and is not blocked here.
NOT_ON_THE_GPU_MACHINE = ("ray", "llguidance")
SECTIONS = ("1. Environment", "2. Correctness", "3. Host syncs and kernel launches", "4. Timings", "5. Memory",
            "6. Other device paths")

RUN = """
import importlib.abc, runpy, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, NotInstalled())
check = runpy.run_path({script!r}, run_name="gpu_check")
ran = check["main"](["--smoke", "--out", {out!r}])
skipped = check["main"](["--smoke", "--out", {skipped!r}, "--time-limit", "0"])
imported = sorted(name for name in sys.modules if name.partition(".")[0] in {blocked!r})
assert not imported, imported
sys.exit(ran or skipped)
"""


def test_the_gpu_checks_smoke_runs_every_section_without_ray_or_llguidance_and_writes_its_report(tmp_path):
    out, skipped = tmp_path / "report", tmp_path / "skipped"
    code = RUN.format(blocked=NOT_ON_THE_GPU_MACHINE, script=str(REPO / "bench" / "gpu_check.py"), out=str(out),
                      skipped=str(skipped))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    report = (out / "gpu-cpu-smoke-check.md").read_text()
    for header in ("- command: `", "- commit: ", "- date: "):
        assert header in report
    for title in SECTIONS:
        assert f"## {title}" in report
        assert f"| {title} | ok |" in report, report
    assert "PASS: greedy speculative" in report and "FAIL" not in report

    cut_short = (skipped / "gpu-cpu-smoke-check.md").read_text()
    assert cut_short.count("Skipped: the check's time limit (0 s) ran out before it started.") == len(SECTIONS)
    assert all(f"| {title} | skipped (time) |" in cut_short for title in SECTIONS)


def test_a_time_limit_spent_inside_a_section_skips_its_remaining_checks_by_name():
    """A compile can take minutes on a cold GPU machine, so the limit is also checked before each
    check, not only before each section; what it leaves out is named in the report."""
    check = runpy.run_path(str(REPO / "bench" / "gpu_check.py"), run_name="gpu_check")
    ran = []

    def check_slow_compile(section, models):
        ran.append("slow")
        time.sleep(0.2)

    def check_next(section, models):
        ran.append("next")

    section = check["Section"]("2. Correctness")
    check["run_checks"](section, None, check["Clock"](0.1), (check_slow_compile, check_next))
    assert ran == ["slow"]
    assert "- skipped (the check's time limit ran out): next" in section.lines
