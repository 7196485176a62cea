"""Where specserve keeps what it makes once per machine and reuses (compiled forwards, launchers):
one folder, $SPECSERVE_CACHE_DIR where the user chose it, else $XDG_CACHE_HOME/specserve
(~/.cache/specserve)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "SPECSERVE_CACHE_DIR"


def specserve_cache_dir() -> Path:
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"
