"""A CPU engine keeps the host memory it frees, so each step's tensors land on pages already mapped.

Why: a step on a CPU allocates tensors as wide as the vocabulary (logits, probabilities, residuals)
and a batch's activations, and frees them by the end of the step. glibc's malloc serves a block
above its mmap threshold (128 KiB at first, moving with what is freed) with a fresh mapping, and
hands a large free top of its heap back to the kernel; either way the next step's tensor lands on
pages the kernel must fault in and zero again, and at a large vocabulary that costs a sampled step
more than its arithmetic (docs/performance.md, "Host memory kept (CPU)"). With fixed thresholds blocks up to
MMAP_THRESHOLD come from the heap and up to TRIM_THRESHOLD of free heap stays mapped; one arena
keeps the engine's forward thread on the main heap, which is not capped as a thread's arena is
(64 MiB a heap, whole heaps unmapped once free). What a process holds is then its steps' peak, as
an accelerator's caching allocator holds it.

glibc reads these settings from the environment once, when a process starts, so they go where a
cluster's processes start: a cluster specserve starts on this machine (cluster/local.py) and its
KubeRay pods (cluster/kuberay.py) have them in every process's environment, as an allocator
preloaded for the whole container would be; `specserve serve-config` names them for a cluster
started by hand. Not per engine actor: Ray starts an actor with environment variables of its own
in a fresh worker process, not a prestarted one, a second or more of every engine's start. Every
CPU runner also calls keep_freed_memory, which sets the same from inside a running process (for an
engine whose process started without them: in-process generation, benches, tests); the arena count
set that late binds only where the process has not yet made many arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Mapping

MMAP_THRESHOLD = 32 * 1024 * 1024   # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 * 1024 * 1024
ARENA_MAX = 1

# Each setting's environment variable -> its mallopt parameter (glibc's malloc.h) and value.
SETTINGS = {"MALLOC_ARENA_MAX": (-8, ARENA_MAX), "MALLOC_MMAP_THRESHOLD_": (-3, MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": (-1, TRIM_THRESHOLD)}
ENGINE_ENV = {name: str(value) for name, (_, value) in SETTINGS.items()}


def malloc_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """ENGINE_ENV less what environ (default: this process's) already sets: the user's choice stands."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in ENGINE_ENV.items() if name not in environ}


@functools.cache
def keep_freed_memory() -> bool:
    """Set this process's malloc to ENGINE_ENV's values, each but where its environment variable is
    set (the user's choice stands, as in malloc_env); False where the C library is not glibc (no
    mallopt: nothing to set) or refuses a value. Once per process."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return all(mallopt(*SETTINGS[name]) == 1 for name in malloc_env())
