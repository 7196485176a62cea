"""Run the selected tests one pytest process per module: `python tests/run_each_module.py -m slow`.

Why: a Ray driver reads some settings once per process (the token authentication mode among
them), so a module whose cluster needs other settings (tests/test_multinode.py's `ray start`
nodes without authentication) leaves its process unable to reach the next module's own cluster.
In a process of its own each module starts from a fresh interpreter, whatever ran before it.
`make reliability` runs the slow tests this way (docs/testing.md).

The arguments are pytest options (no paths): the modules are those a collection with the same
options selects, from the configured test paths. Each module's output is streamed as it runs;
the exit status is 0 only when every module's is, and the last line is pytest's closing line
over all of them, with the modules that were red listed above it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

COUNTED = ("failed", "passed", "skipped", "errors")


def selected_modules(options: list[str]) -> list[str]:
    """The test modules a collection with these options selects, in collection order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *options],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout + done.stderr)
        raise SystemExit(done.returncode)
    # "path.py::test" per test, or "path.py: count" per module where the options are quiet too.
    modules = [found.group(1) for line in done.stdout.splitlines()
               if (found := re.match(r"(\S+\.py)(::|: \d+$)", line))]
    return list(dict.fromkeys(modules))


def counts_from_junit(path: Path) -> dict[str, int]:
    """failed / passed / skipped / errors of one run, from its JUnit XML report."""
    totals = dict.fromkeys(COUNTED, 0)
    if not path.exists():
        return totals
    for suite in ElementTree.parse(path).getroot().iter("testsuite"):
        tests, failures, errors, skipped = (int(suite.get(name, 0)) for name in ("tests", "failures", "errors",
                                                                                  "skipped"))
        totals["failed"] += failures
        totals["errors"] += errors
        totals["skipped"] += skipped
        totals["passed"] += tests - failures - errors - skipped
    return totals


def closing_line(totals: dict[str, int], seconds: float, width: int = 80) -> str:
    """pytest's last line over all modules: '==== 2 failed, 20 passed, 5 errors in 612.30s ===='."""
    parts = [f"{totals[name]} {'error' if name == 'errors' and totals[name] == 1 else name}"
             for name in COUNTED if totals[name]]
    text = f" {', '.join(parts) or 'no tests ran'} in {seconds:.2f}s "
    return text.center(width, "=")


def main(options: list[str]) -> int:
    if any(not option.startswith("-") and Path(option).exists() for option in options):
        raise SystemExit("pass pytest options only: the modules come from the collection (module docstring)")
    started = time.monotonic()
    modules = selected_modules(options)
    totals, red = dict.fromkeys(COUNTED, 0), []
    with tempfile.TemporaryDirectory(prefix="each-module-") as reports:
        for index, module in enumerate(modules):
            print(f"\n---- {module} ({index + 1}/{len(modules)}), in a process of its own", flush=True)
            report = Path(reports) / f"{index}.xml"
            returncode = subprocess.run([sys.executable, "-m", "pytest", *options, f"--junitxml={report}",
                                         module]).returncode
            counts = counts_from_junit(report)
            for name in COUNTED:
                totals[name] += counts[name]
            if returncode != 0:
                red.append(f"{module} (exit status {returncode})")
    print()
    for line in red:
        print(f"RED {line}")
    print(closing_line(totals, time.monotonic() - started), flush=True)
    return 1 if red or not modules else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
