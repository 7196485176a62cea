"""Run the suite as two pytest processes side by side: `python tests/run_two_lanes.py -q`.

Why: the box CI runs on has two cores and the suite used one at a time. The in-process tests run
torch on one thread and the served modules (marker `ray`) spend much of their time waiting on
their cluster (replicas loading, health polls, requests in flight), so the two kinds overlap well,
and each lane keeps what it needs from being alone in its process: the served modules share one
Ray cluster in collection order (tests/conftest.py), the in-process ones start none (a test
that starts a cluster must be marked `ray`). The in-process lane runs at the lowest CPU priority,
below Ray's own workers (which Ray starts at niceness 15): the served modules are the ones with
timeouts.

The arguments are pytest options for both lanes (no paths, no -m: the lanes are the selection).
The served lane's output is streamed as it runs, the in-process lane's printed whole when it ends;
the exit status is 0 only when both lanes' are, and the last line is pytest's closing line over
both (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_each_module import COUNTED, closing_line, counts_from_junit

NOT_IN_MAKE_TEST = "not slow and not stat_full"
LANES = (("served", f"ray and {NOT_IN_MAKE_TEST}"), ("in-process", f"not ray and {NOT_IN_MAKE_TEST}"))
IN_PROCESS_NICENESS = 19


def main(options: list[str]) -> int:
    if any(option in ("-m", "-k") or not option.startswith("-") and Path(option).exists() for option in options):
        raise SystemExit("pass pytest options only, without -m, -k or paths: the lanes are the selection")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="two-lanes-") as scratch:
        served_report, in_process_report = (Path(scratch) / f"{name}.xml" for name, _ in LANES)
        in_process_log = Path(scratch) / "in-process.log"
        with in_process_log.open("w") as log:
            in_process = subprocess.Popen(
                [sys.executable, "-m", "pytest", *options, "-m", LANES[1][1], f"--junitxml={in_process_report}"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(IN_PROCESS_NICENESS))
            print(f"---- {LANES[0][0]} lane ({LANES[0][1]}), streamed; the {LANES[1][0]} lane "
                  f"({LANES[1][1]}) runs beside it and prints when it ends", flush=True)
            served = subprocess.run([sys.executable, "-m", "pytest", *options, "-m", LANES[0][1],
                                     f"--junitxml={served_report}"])
            in_process.wait()
        print(f"\n---- {LANES[1][0]} lane", flush=True)
        sys.stdout.write(in_process_log.read_text())
        totals = dict.fromkeys(COUNTED, 0)
        for report in (served_report, in_process_report):
            for name, count in counts_from_junit(report).items():
                totals[name] += count
    red = [f"{name} lane (exit status {code})" for (name, _), code in zip(LANES, (served.returncode,
                                                                                   in_process.returncode)) if code]
    print()
    for line in red:
        print(f"RED {line}")
    print(closing_line(totals, time.monotonic() - started), flush=True)
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
