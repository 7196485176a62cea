"""A local Ray Serve app on a tiny random pair, for end-to-end test modules (free port, no downloads).

Each start (Ray cluster, Serve, four deployments loading their models) costs tens of seconds on a
2-core box, so the modules that can share one server use the `tiny_pair_server` fixture
(tests/conftest.py), served once here; modules needing other settings start their own with
serve_tiny_pair. A test's cluster ends with stop_test_cluster."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import ray

from specserve.common.config import SpecServeConfig
from specserve.cluster.local import start_local, wait_healthy
from tests.tiny_pair import make_tiny_pair, tiny_pair_config

SHARED_MODEL = "tiny-pair"
# What the shared server's users need: max_tokens capped (test_serving's 400 matrix), metrics
# pushed often enough for a test to read its own requests' counters (port 0: any free port), and
# the speculation cache on for every request, as its tests of hits assume: whether it pays is
# measured per box (speculation.fan_out_measured), which tests/test_depth_chooser.py covers. And
# target-only rounds of one token: the tiny pair's forwards cost next to nothing beside a round's
# orchestration, so against target-only rounds of several tokens the goodput model rightly chooses
# K = 0 (policies/goodput.py) and a test of speculative rounds would see none; target-only rounds
# of several tokens are tested in tests/test_round_history.py and tests/test_engines.py.
SHARED_OVERRIDES = {"limits": {"max_tokens": 200},
                    "observability": {"metrics_export_port": 0, "metrics_report_interval_ms": 500},
                    "speculation": {"fan_out_measured": False, "target_only_steps": 1}}
HEALTHY_WITHIN_S = 120.0  # the last user may have killed an engine; Serve replaces it


def greedy_reference(target_path: str):
    """greedy_text(prompt, max_tokens): the target's own greedy text, in-process and target-only:
    the oracle a served request must equal, whatever was lost on the way."""
    from transformers import AutoTokenizer

    from specserve.decoding.generate import generate
    from specserve.decoding.batched_runner import BatchedModelRunner
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.scheduler import Scheduler
    from specserve.decoding.sequence import RequestState

    engine = Scheduler(BatchedModelRunner(target_path))
    tokenizer = AutoTokenizer.from_pretrained(target_path)

    def greedy_text(prompt: str, max_tokens: int) -> str:
        state = RequestState(request_id="ref", prompt_ids=tokenizer.encode(prompt, add_special_tokens=False),
                             params=SamplingParams(temperature=0, max_tokens=max_tokens),
                             eos_token_id=tokenizer.eos_token_id, max_context=engine.max_context,
                             detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        for _ in generate(engine, state):
            pass
        return state.output_text

    return greedy_text


def free_port() -> int:
    """One free port below the kernel's ephemeral range, for one server that binds it next.

    Why below it: a server binds its port seconds after this draw (Ray's metrics agent, Serve's
    HTTP proxy), and meanwhile the kernel may hand a port from its ephemeral range to anyone's
    bind(0) or outgoing connection (a Ray worker, another process on the machine). A port below
    that range goes only to whoever asks for it by number. Not for several ports of one
    cluster: the socket is closed before the next draw, so two draws can return the same port
    (PortReservation holds them instead)."""
    low, high = NAMED_PORTS
    for _ in range(1000):
        port = _port_draws.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high - 1}")


def _below_ephemeral_ports() -> tuple[int, int]:
    """[low, high): ports under the kernel's ephemeral range (Linux's ip_local_port_range)."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    return max(1024, first_ephemeral - 12000), first_ephemeral


NAMED_PORTS = _below_ephemeral_ports()
_port_draws = random.Random()   # its own stream: a test seeding `random` must not make draws repeat


class PortReservation:
    """`count` distinct free ports for the processes of one multi-process cluster, held by bound
    sockets until `take` hands some of them to the process about to bind them.

    Why: ports drawn one at a time (free_port) are free when drawn, but nothing stops the kernel
    from handing the same one out again, or to a Ray node started meanwhile, so two components
    of a cluster can be given one port (`ray start` then refuses to start). Held together, the
    ports are distinct by construction and no other process is given them until they are taken.
    Bound on all interfaces, so a bind on any address conflicts with the hold."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"reserve at least one port, not {count}")
        self._held: list[socket.socket] = []
        try:
            for _ in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._held.append(sock)
                sock.bind(("", 0))
        except OSError:
            self.close()
            raise

    @property
    def held(self) -> tuple[int, ...]:
        """The ports still held, in the order `take` hands them out."""
        return tuple(sock.getsockname()[1] for sock in self._held)

    def take(self, count: int) -> list[int]:
        """Release `count` of the held ports and return them, for a process to bind at once."""
        if count > len(self._held):
            raise ValueError(f"{count} ports wanted, {len(self._held)} left of the reservation")
        taken, self._held = self._held[:count], self._held[count:]
        ports = [sock.getsockname()[1] for sock in taken]
        for sock in taken:
            sock.close()
        return ports

    def close(self) -> None:
        """Release whatever is still held."""
        for sock in self._held:
            sock.close()
        self._held = []

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def stop_test_cluster() -> None:
    """End the test's local Ray cluster, and every process on it, at once.

    Why not stop_local: Serve's own shutdown deletes each application and waits out every
    replica's graceful drain (docs/testing.md has what that costs a module), where a test's
    cluster has nothing left to drain and ray.shutdown ends its processes anyway (Serve forgets a
    client of a stopped cluster, so the next module starts afresh). The real stop is tested where
    it matters: `specserve serve` under SIGTERM (tests/test_sigterm.py). It waits for the
    cluster's own processes (GCS, raylet) to exit, so the next module's cluster does not start
    beside one still going down."""
    ray.shutdown(wait_for_processes=True)


def serve_tiny_pair(root: Path, model_name: str, **overrides) -> Iterator[tuple[str, SpecServeConfig]]:
    """Start the app on a fresh tiny pair under root; yield (base URL, config); stop it after."""
    target_path, draft_path = make_tiny_pair(root)
    config = SpecServeConfig.model_validate({
        "model_name": model_name,
        "target": {"path": str(target_path)},
        "draft": {"path": str(draft_path)},
        "http": {"port": free_port()},
        **overrides,
    })
    url = start_local(config)
    try:
        yield url, config
    finally:
        stop_test_cluster()


_shared: dict = {}  # "server": the running (url, config), while up


def shared_server(tmp_path_factory) -> tuple[str, SpecServeConfig]:
    """(url, config) of the shared default tiny pair: started on first use, reused while it runs."""
    if "server" not in _shared:
        config = tiny_pair_config(tmp_path_factory.mktemp("shared-pair"), SHARED_MODEL, free_port(),
                                  **SHARED_OVERRIDES)
        _shared["server"] = start_local(config), config
    else:
        wait_healthy(_shared["server"][0], HEALTHY_WITHIN_S)
    return _shared["server"]


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    """predicate()'s first true value, asked every 0.2 s (an actor restarting or slow to answer
    counts as not yet); TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def wait_until_a_lone_greedy_request_drafts(timeout_s: float = 30.0) -> None:
    """Until the shared server's router would give a greedy request arriving alone a depth above 0.

    Why: under the load an earlier test left (hundreds of concurrent sampled requests), the policy
    actor's goodput model may choose target-only for both classes, and that decision stands until
    the routers next read one made after the load has gone (policies/depth_chooser.py). A short
    request sent at once runs every round target-only, so a test asserting that it drafted would
    fail on timing alone. The router's status answers with the depth a fresh lone greedy request
    gets from the decision it holds."""
    from ray import serve

    from specserve.cluster.builder import APP_NAME

    router = serve.get_deployment_handle("Router", APP_NAME)
    wait_for(lambda: router.status.remote().result()["num_draft_tokens"] > 0, timeout_s,
             what="the router to give a lone greedy request a depth above 0")


def shared_server_running() -> bool:
    return "server" in _shared


def forget_shared_server() -> None:
    """The caller is about to stop Ray (and with it the shared server): the next use starts one."""
    _shared.pop("server", None)


# The real CLI (`specserve serve`), for the modules that test it from outside.
READY_LINE = "Ctrl-C to stop"
STARTED_WITHIN_S = 480  # a loaded 2-core box has taken minutes to load the engines


def start_cli_server(port: int, log_path: Path) -> subprocess.Popen:
    """`specserve serve` (the default pair) on port, its output to log_path, in its own session so
    every process it spawns can be found after (`session_processes`)."""
    env = {**os.environ, "SPECSERVE__HTTP__PORT": str(port), "SPECSERVE__OBSERVABILITY__METRICS_EXPORT_PORT": "0"}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "specserve.cluster.cli", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_until_serving(server: subprocess.Popen, log_path: Path) -> None:
    """Until the CLI prints that it serves; fails with its output if it exits or takes too long."""
    deadline = time.monotonic() + STARTED_WITHIN_S
    while READY_LINE not in log_path.read_text():
        assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.5)


def session_processes(session_id: int) -> list[psutil.Process]:
    """Every process of the session session_id (a `start_cli_server` server's pid)."""
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found
