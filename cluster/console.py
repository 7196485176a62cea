"""What a `specserve` command that runs Ray prints: specserve's own lines on the terminal, Ray's in
a log file (or, with --verbose, on the terminal as well).

Why at the file-descriptor level: Ray writes to its driver's stdout and stderr from loggers that
have no handler (the token-authentication notice at every start), from its error-listening thread
(a task of an actor it killed, which every Serve shutdown has) and from C++, and the processes it
starts inherit the descriptors. Pointing descriptors 1 and 2 at a file while Ray runs catches all of
them; specserve's lines go to copies of the descriptors taken before. A newcomer reads Ray's lines
as errors; they are in the log for whoever needs them.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PREFIX = "specserve: "


@dataclass
class Console:
    """Where specserve's own lines go: out for progress and results, err for warnings."""

    out: TextIO
    err: TextIO

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def default_log_path(command: str) -> Path:
    """This command's log of Ray's output (one per process: servers on other ports run beside it)."""
    return Path(tempfile.gettempdir()) / "specserve" / f"{command}-{os.getpid()}.log"


class _ToConsole(logging.Handler):
    """specserve's log records as terminal lines: INFO to out, WARNING and above to err, without
    tracebacks (those go to the log file)."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.console.err if record.levelno >= logging.WARNING else self.console.out
        print(PREFIX + record.getMessage(), file=stream, flush=True)


@contextmanager
def specserve_console(log_path: Path | None) -> Iterator[Console]:
    """While the block runs: descriptors 1 and 2 (Ray's output, and its processes') go to log_path,
    appended, and the yielded Console writes to the terminal; the `specserve` loggers' records
    (start_local's progress) go to the Console, and in full to the log. log_path None (--verbose):
    nothing is redirected. On the way out, an exception included, the descriptors are restored
    before anything (a SystemExit's message) is printed."""
    package_logger = logging.getLogger("specserve")
    if log_path is None:
        console = Console(sys.stdout, sys.stderr)
        handlers: list[logging.Handler] = [_ToConsole(console)]
        with _logging_to(package_logger, handlers):
            yield console
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_out, terminal_err = os.dup(1), os.dup(2)
    console = Console(open(terminal_out, "w", buffering=1, encoding="utf-8", errors="replace"),
                      open(terminal_err, "w", buffering=1, encoding="utf-8", errors="replace"))
    in_full = logging.StreamHandler(sys.stderr)   # fd 2: the log file while the block runs
    in_full.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
    try:
        with open(log_path, "a") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                with _logging_to(package_logger, [_ToConsole(console), in_full]):
                    yield console
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(terminal_out, 1)
                os.dup2(terminal_err, 2)
    finally:
        console.out.close()
        console.err.close()


@contextmanager
def _logging_to(logger: logging.Logger, handlers: list[logging.Handler]) -> Iterator[None]:
    saved = (logger.level, logger.propagate)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in handlers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
