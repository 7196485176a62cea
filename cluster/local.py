"""Local bring-up: a Ray cluster on this machine plus the specserve application on it."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import ray
from ray import serve
from ray.serve.schema import ApplicationStatus, DeploymentStatus

from specserve.cluster.builder import APP_NAME, build_app, checked_head, custom_resources_needed, logical_cpus_needed
from specserve.cluster.serve_data_plane import added_to_environment, local_cluster_env
from specserve.decoding.host_memory import malloc_env
from specserve.common.config import SpecServeConfig
from specserve.decoding.token_map import load_token_map

logger = logging.getLogger(__name__)

# Full-vocabulary probability rows (sampled requests) are ~160 KB; keep them inline in the
# RPC reply rather than in the object store, which costs an extra round trip per round.
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 4 * 1024 * 1024}
DRAIN_FLUSH_S = 0.5  # after the routers are empty, time for the ingress to send the last chunks
RAY_START_ATTEMPTS = 3
RAY_STOP_WAIT_S = 10.0  # for the processes of a failed start to exit after a kill
STATUS_POLL_S = 0.25  # how often a start-up looks at the application's status
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class StartupError(RuntimeError):
    """A deployment could not start: the message is its replica's own exception (the CLI prints it)."""


def metrics_system_config(config: SpecServeConfig) -> dict[str, int]:
    return {"metrics_report_interval_ms": config.observability.metrics_report_interval_ms}


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def metrics_export_port(config: SpecServeConfig, is_free=_port_is_free) -> int | None:
    """The configured metrics port, or None (Ray picks a free one) when it is 0 or already taken.

    Why not fail on a taken port: Ray does not say so, its node just times out at start-up, and
    on a shared machine a second local cluster (another user, a test run) is the usual cause.
    The `metrics:` line `specserve serve` prints always shows the port actually bound."""
    port = config.observability.metrics_export_port
    if port == 0:
        return None
    if not is_free(port):
        logger.warning("metrics port %d is in use; Ray picks a free one (set observability.metrics_export_port "
                       "or SPECSERVE__OBSERVABILITY__METRICS_EXPORT_PORT to choose)", port)
        return None
    return port


def metrics_url() -> str:
    """This node's Prometheus endpoint, as Ray actually bound it (the connected cluster's view)."""
    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def check_model_paths(config: SpecServeConfig) -> None:
    """Fail before starting anything if a configured model directory is missing, or a configured
    EAGLE-3 head does not fit the target."""
    specs = [("target", config.target)] + ([("draft", config.draft)] if config.draft is not None else [])
    for role, spec in specs:
        if not (Path(spec.path) / "config.json").is_file():
            raise FileNotFoundError(f"{role} model not found at {spec.path} (no config.json): set {role}.path "
                                    "in your config, or train the default pair with `specserve train-default`")
    if config.speculation.proposer == "eagle3":   # a head that does not fit the target is refused here, named
        checked_head(config)
    if config.draft_token_map is not None:   # one the draft cannot serve, named
        from transformers import AutoConfig

        draft_config = AutoConfig.from_pretrained(config.draft.path, local_files_only=True)
        load_token_map(config.draft_token_map, draft_config.get_text_config(decoder=True).vocab_size)


class PortInUseError(ValueError):
    """The configured HTTP port is taken: a config this machine cannot honour (the CLI prints it)."""


def check_port_free(host: str, port: int) -> None:
    """Fail before starting Ray if host:port is taken. Serve would otherwise come up without its
    HTTP proxy while requests to that port reach whoever holds it (e.g. another specserve)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # Like uvicorn: TIME_WAIT leftovers of a stopped server do not count, a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUseError(f"cannot serve on http://{host}:{port}: port {port} is already in use "
                                 f"({exc.strerror}); stop what holds it or set http.port "
                                 "(e.g. SPECSERVE__HTTP__PORT=8001)") from None


def init_local_ray(**ray_init_kwargs) -> None:
    """Start a Ray cluster on this machine (ray.init with these arguments, quiet logging), trying
    up to three times: on a busy machine a node now and then misses Ray's own start-up limits (its
    GCS never writes its port file, its raylet never registers, or one of the processes it forks
    aborts at start, as seen from a driver that had run earlier sessions), and a later start
    succeeds where one did not. What a failed attempt started is ended before the next.
    StartupError if every attempt fails.
    The cluster's processes start with Serve's high-throughput data plane (cluster/serve_data_plane.py)
    and the engines' malloc settings (decoding/host_memory.py)."""
    for attempt in range(RAY_START_ATTEMPTS):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            with added_to_environment({**local_cluster_env(), **malloc_env()}):
                ray.init(configure_logging=False, log_to_driver=False, **ray_init_kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception when its node does not come up
            seen = "; ".join(started_processes(before)) or "no process of it left"
            ray.shutdown()
            started = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
            for child in started:
                child.kill()
            psutil.wait_procs(started, timeout=RAY_STOP_WAIT_S)
            if attempt + 1 == RAY_START_ATTEMPTS:
                raise StartupError(f"Ray did not start on this machine: {exc} ({seen})") from exc
            logger.warning("Ray did not start (%s; %s); starting it once more", exc, seen)


def started_processes(before: set[int]) -> list[str]:
    """What became of the processes this one started since `before` (pids): each one's name and
    state, and for one that has already ended, how (reaped here). Why: a node that misses Ray's
    start-up limits says only which file it waited for, not whether its process hung or died."""
    seen = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            name, state = child.name(), child.status()
        except psutil.Error:
            continue
        if state == psutil.STATUS_ZOMBIE:
            try:
                _, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:   # a grandchild: its own parent reaps it
                status = None
            if status is not None and os.WIFSIGNALED(status):
                state = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            elif status is not None:
                state = f"exited with {os.WEXITSTATUS(status)}"
        seen.append(f"{name} (pid {child.pid}): {state}")
    return seen


def start_local(config: SpecServeConfig, dashboard: bool = False, timeout_s: float = 300.0) -> str:
    """Start Ray + Serve + the app; block until /health answers 200 (every engine pool has
    answered: deployments/ingress.py); return the base URL. Progress goes to this module's
    logger (the CLI prints it).

    If anything after Ray starts fails (a deployment that cannot start, no health in time), what
    this call started is stopped before the error propagates: a failed start-up leaves no cluster
    behind for the next `specserve serve` (or test) to trip over."""
    check_model_paths(config)
    check_port_free(config.http.host, config.http.port)
    started_ray = not ray.is_initialized()
    if started_ray:
        logger.info("starting Ray on this machine")
        init_local_ray(num_cpus=logical_cpus_needed(config), resources=custom_resources_needed(config),
                       include_dashboard=dashboard, _metrics_export_port=metrics_export_port(config),
                       _system_config={**RAY_SYSTEM_CONFIG, **metrics_system_config(config)})
    try:
        serve.start(http_options={"host": config.http.host, "port": config.http.port})
        deadline = time.monotonic() + timeout_s
        logger.info("deploying '%s'; its engines are loading", config.model_name)
        deploy_and_wait(config, timeout_s)
        url = f"http://{config.http.host}:{config.http.port}"
        wait_healthy(url, max(deadline - time.monotonic(), 1.0))
    except BaseException:
        if started_ray:
            stop_local()
        raise
    return url


def deploy_and_wait(config: SpecServeConfig, timeout_s: float) -> None:
    """Deploy the application and wait until it runs. StartupError, with the replica's own
    exception, as soon as a replica fails to start: a local replica fails again the same way (a
    KV budget too small, a missing file, a wrong dtype), so Serve's retries, each loading the
    model, would only delay the message, and Serve's own error names only the deployments.
    TimeoutError, with what Serve says of each deployment, if it does not run within timeout_s
    (e.g. replicas that cannot be placed)."""
    serve.run_many([serve.RunTarget(target=build_app(config), name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is not None:
            if app.status == ApplicationStatus.RUNNING:
                return
            for name, deployment in app.deployments.items():
                if deployment.status == DeploymentStatus.DEPLOY_FAILED or "failed to start" in deployment.message:
                    raise StartupError(f"{name} failed to start: {replica_cause(deployment.message)}")
            if app.status == ApplicationStatus.DEPLOY_FAILED:
                raise StartupError(f"the application failed to deploy: {replica_cause(app.message)}")
        if time.monotonic() > deadline:
            waiting = "" if app is None else "".join(f"\n  {name}: {d.message or d.status}"
                                                     for name, d in app.deployments.items())
            raise TimeoutError(f"specserve did not start within {timeout_s:.0f} s{waiting}")
        time.sleep(STATUS_POLL_S)


def replica_cause(message: str) -> str:
    """The innermost exception of a Serve status message, which nests the replica's traceback, the
    engine actor's and the exception the engine raised: the lines from the last exception line
    (one at column 0 right after a traceback frame) to the end; the whole message if it holds none."""
    lines = _ANSI_ESCAPE.sub("", message).strip().splitlines()
    starts = [index for index in range(1, len(lines))
              if lines[index][:1].strip() and lines[index - 1].startswith(" ")]
    return "\n".join(lines[starts[-1]:]) if starts else "\n".join(lines)


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"specserve at {url} did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.25)


def drain_local(grace_s: float) -> int:
    """Stop admitting requests and wait up to grace_s for those in flight to finish; -> how many
    were still running when the grace ran out (0: a clean drain). New requests meanwhile get 503
    and /health answers 503, so a load balancer moves traffic elsewhere."""
    try:
        routers = serve.get_deployment_handle("Router", APP_NAME)
        deadline = time.monotonic() + grace_s
        while True:
            held = sum(routers.broadcast("drain").results(timeout_s=max(1.0, deadline - time.monotonic())))
            if held == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    except Exception:  # nothing to drain (start-up failed half-way) or the app is already gone
        logger.warning("could not drain the routers; stopping at once", exc_info=True)
        return 0
    time.sleep(DRAIN_FLUSH_S)  # the ingress streams a finished request's last chunks out
    return held


def stop_local() -> None:
    """Stop the app and Ray; Ray is shut down even when Serve's shutdown fails half-way."""
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
