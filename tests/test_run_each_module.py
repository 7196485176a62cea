"""tests/run_each_module.py, the runner of `make reliability`: each selected module in a process of
its own (so one module's once-per-process state cannot reach the next), red if any module is red,
ending with pytest's closing line over all of them. Run here on a small suite of its own."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

# It runs pytest in subprocesses (seconds each): it belongs with the runner it checks, in `make reliability`.
pytestmark = pytest.mark.slow

RUNNER = Path(__file__).with_name("run_each_module.py")
MODULES = {
    # Process-wide state set by one module, as a Ray driver's auth mode is read once per process.
    "test_a_sets_state.py": "import os, pytest\n\n@pytest.mark.slow\ndef test_sets():\n"
                            "    os.environ['SET_BY_ANOTHER_MODULE'] = '1'\n",
    "test_b_needs_a_fresh_process.py": "import os, pytest\n\n@pytest.mark.slow\ndef test_fresh():\n"
                                       "    assert 'SET_BY_ANOTHER_MODULE' not in os.environ\n",
    "test_c_red.py": "import pytest\n\n@pytest.mark.slow\n@pytest.mark.red\ndef test_red():\n    assert False\n",
    "test_d_not_selected.py": "def test_fast():\n    assert False, 'a module the marker leaves out must not run'\n",
}


def _run(tmp_path: Path, marker: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    red: red\n")
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    return subprocess.run([sys.executable, str(RUNNER), "-q", "-p", "no:cacheprovider", "-m", marker],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_each_module_runs_in_its_own_process_and_one_red_module_makes_the_run_red(tmp_path):
    done = _run(tmp_path, "slow")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.fullmatch(r"=+ 1 failed, 2 passed in [\d.]+s =+", lines[-1]), lines[-5:]
    assert lines[-2] == "RED test_c_red.py (exit status 1)", lines[-5:]
    assert "test_d_not_selected" not in done.stdout


def test_a_run_whose_modules_all_pass_is_green(tmp_path):
    done = _run(tmp_path, "slow and not red")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.fullmatch(r"=+ 2 passed in [\d.]+s =+", lines[-1]) and "RED" not in done.stdout, lines[-5:]
