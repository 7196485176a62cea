"""`specserve serve` stops on SIGTERM (docker stop, systemd, Kubernetes) as it does on Ctrl-C: a
request in flight finishes, the process exits 0 without Ray's crash dump, and nothing it started
survives. Runs the real CLI in its own session so every process it spawns can be found after."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.local_server import free_port

pytestmark = pytest.mark.ray


def _session_processes(session_id: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


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


def test_sigterm_drains_the_request_in_flight_and_stops_everything(tmp_path: Path):
    port = free_port()
    env = {**os.environ, "SPECSERVE__HTTP__PORT": str(port), "SPECSERVE__OBSERVABILITY__METRICS_EXPORT_PORT": "0"}
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "specserve.cluster.cli", "serve"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C to stop" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        result: dict = {}
        started = threading.Event()
        client = threading.Thread(target=_stream, args=(url, result, started))
        client.start()
        assert started.wait(timeout=120)
        server.send_signal(signal.SIGTERM)  # mid-stream: 200 tokens take seconds here
        assert server.wait(timeout=90) == 0
        client.join(timeout=30)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    output = (tmp_path / "serve.log").read_text()
    assert "SIGTERM received" not in output, output
    assert result.get("done"), result
    text = "".join(chunk["choices"][0]["text"] for chunk in result["chunks"] if chunk.get("choices"))
    assert result["chunks"][-1]["usage"]["completion_tokens"] == 200 and text
    deadline = time.monotonic() + 30
    while (left := _session_processes(server.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [process.cmdline()[:1] for process in left]
