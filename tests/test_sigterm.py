"""`specserve serve` from outside, one start and stop of the real CLI: nothing on its port answers
200 until every engine pool answers (one readiness truth, polled from the moment the command
starts); it stops on SIGTERM (docker stop, systemd, Kubernetes) as it does on Ctrl-C: a request in
flight finishes, a second SIGTERM during the drain changes nothing, the process exits 0 without
Ray's crash dump or a traceback, and nothing it started survives;
and what it prints is what specserve did, none of Ray's own lines. Runs the CLI in its own session
so every process it spawns can be found after."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.local_server import READY_LINE, free_port, session_processes, start_cli_server, wait_until_serving

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # make reliability: a whole CLI start costs a minute


def _stream(url: str, result: dict, started: threading.Event) -> None:
    body = {"model": "specserve-default", "prompt": "def parse(text):", "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
                    started.set()
                elif line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    result["chunks"] = chunks
    started.set()


POLL_S = 0.2


def _poll_until_ready(url: str, log_path: Path, polls: list, stop: threading.Event) -> None:
    """GET /v1/models then /health, again and again, until the command prints that it serves:
    (route, status or None for no answer, JSON body) in order."""
    while not stop.is_set() and READY_LINE not in log_path.read_text():
        for route in ("/v1/models", "/health"):
            try:
                response = httpx.get(url + route, timeout=10)
                polls.append((route, response.status_code, response.json() if response.content else None))
            except (httpx.HTTPError, ValueError):
                polls.append((route, None, None))
        time.sleep(POLL_S)


@pytest.fixture(scope="module")
def served_and_stopped(tmp_path_factory) -> dict:
    """One `specserve serve` (the default pair), polled from its first moment until ready, one
    streamed request, SIGTERM mid-stream and again mid-drain; what was seen."""
    tmp_path = tmp_path_factory.mktemp("serve")
    port = free_port()
    log_path = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    polls: list = []
    stop_polling = threading.Event()
    poller = threading.Thread(target=_poll_until_ready, args=(url, log_path, polls, stop_polling))
    server = start_cli_server(port, log_path)
    poller.start()
    seen: dict = {"polls": polls}
    try:
        wait_until_serving(server, log_path)
        poller.join(timeout=30)
        seen["after_ready"] = {route: httpx.get(url + route, timeout=10).status_code
                               for route in ("/v1/models", "/health")}
        result: dict = {}
        started = threading.Event()
        client = threading.Thread(target=_stream, args=(url, result, started))
        client.start()
        assert started.wait(timeout=120)
        server.send_signal(signal.SIGTERM)  # mid-stream: 200 tokens take seconds here
        # A second SIGTERM mid-drain (an impatient supervisor) must change nothing.
        deadline = time.monotonic() + 30
        while "specserve: stopping" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        seen["exit_code"] = server.wait(timeout=90)
        client.join(timeout=30)
        seen["result"] = result
    finally:
        stop_polling.set()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    seen["output"] = log_path.read_text()
    deadline = time.monotonic() + 30
    while (left := session_processes(server.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    seen["left"] = [process.cmdline()[:1] for process in left]
    return seen


def test_nothing_answers_200_until_every_engine_pool_answers(served_and_stopped):
    """Polled from the moment the command starts: every 200 before the serving line came with
    /health saying every pool answers ("ok", not "degraded"), so none came while an engine was
    loading; after the line, both routes answer 200."""
    polls = served_and_stopped["polls"]
    for i in range(0, len(polls) - 1, 2):
        (_, models, _), (_, health, body) = polls[i], polls[i + 1]
        if models == 200 or health == 200:
            assert health == 200 and body["status"] == "ok", (polls[i], polls[i + 1])
            assert set(body["pools"].values()) == {"ok"}, body
    assert served_and_stopped["after_ready"] == {"/v1/models": 200, "/health": 200}


def test_sigterm_drains_the_request_in_flight_and_stops_everything(served_and_stopped):
    output, result = served_and_stopped["output"], served_and_stopped["result"]
    assert served_and_stopped["exit_code"] == 0, output
    assert "SIGTERM received" not in output, output
    assert result.get("done"), result
    text = "".join(chunk["choices"][0]["text"] for chunk in result["chunks"] if chunk.get("choices"))
    assert result["chunks"][-1]["usage"]["completion_tokens"] == 200 and text
    assert not served_and_stopped["left"], served_and_stopped["left"]


def test_start_and_stop_print_what_specserve_did_and_none_of_rays_lines(served_and_stopped):
    """Ray's notices (token authentication, the Serve controller's tasks killed at shutdown, Serve's
    INFO lines) go to the log file the first line names; the terminal reads as a story."""
    lines = served_and_stopped["output"].splitlines()
    for expected in ("specserve: Ray's own output goes to", "specserve: starting Ray", "specserve: deploying",
                     "specserve is serving", "specserve: stopping", "specserve: stopped"):
        assert any(line.startswith(expected) for line in lines), (expected, lines)
    assert all(line.startswith(("specserve", "metrics: ", "drafting: ", READY_LINE)) for line in lines), lines
    log_path = lines[0].split(" goes to ")[1].split(" ")[0]
    # Ray's own lines landed in the log instead (which notices Ray prints varies: its token notice
    # only comes with a token it has just made, so the check names a line every start has).
    assert 'Started Serve in namespace "serve"' in Path(log_path).read_text()
