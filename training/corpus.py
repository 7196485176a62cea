"""The offline training corpus: the running interpreter's own standard-library sources.

Why the stdlib: it is on every machine this project runs on (no hub, no download), it is
license-clean, and it is real Python. Files are split into train / held-out by a stable
hash of their relative path, so benchmark prompts can come from code the models never saw.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 40  # one file in ~40 is held out
MAX_FILE_BYTES = 200_000  # a few generated tables dwarf everything else; skip them


@dataclass(frozen=True)
class SourceFile:
    relative_path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_EVERY == 0


def iter_stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """All stdlib .py files (no site-packages, no test suites), sorted for determinism."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if "site-packages" in parts or "test" in parts or "tests" in parts:
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(relative, text))
    return files


def split_corpus(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) by a stable hash of each file's path."""
    train = [f for f in files if not is_held_out(f.relative_path)]
    held_out = [f for f in files if is_held_out(f.relative_path)]
    return train, held_out
