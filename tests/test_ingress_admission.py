"""deployments/ingress.py's admission middleware, in process over ASGI: before every engine pool
has answered, every path but /health answers 503 with Retry-After (known and unknown paths alike,
before any body is read); with API keys, /v1/* without a valid key answers 401 first; once serving,
requests pass through to the routes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from specserve.common.config import SpecServeConfig
from specserve.deployments import ingress


class FakeIngress:
    """What the middleware reads from the replica's Ingress: serving, key digests, health."""

    def __init__(self, serving: bool, status: str, api_keys: list[str]) -> None:
        self.serving = serving
        self.status = status
        self.api_key_digests = SpecServeConfig.model_validate({"auth": {"api_keys": api_keys}}).auth.key_digests()

    async def health_report(self) -> dict:
        return {"status": self.status}


def answers(monkeypatch, fake: FakeIngress, method: str, path: str, **kwargs) -> httpx.Response:
    monkeypatch.setattr(ingress.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=fake))

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=ingress.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(call())


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/nowhere")])
def test_a_starting_server_answers_503_with_retry_after_before_reading_the_body(monkeypatch, method, path):
    response = answers(monkeypatch, FakeIngress(False, "starting", []), method, path, content=b"{not json")
    assert response.status_code == 503
    assert response.headers["retry-after"] == str(ingress.STARTING_RETRY_AFTER_S)
    assert response.json()["error"]["type"] == "service_unavailable"


def test_a_v1_path_without_a_valid_key_answers_401_before_readiness(monkeypatch):
    fake = FakeIngress(False, "starting", ["key-a"])
    assert answers(monkeypatch, fake, "GET", "/v1/models").status_code == 401
    wrong = answers(monkeypatch, fake, "GET", "/v1/models", headers={"Authorization": "Bearer key-b"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    keyed = answers(monkeypatch, fake, "GET", "/v1/models", headers={"Authorization": "Bearer key-a"})
    assert keyed.status_code == 503


def test_a_serving_server_lets_requests_through_to_the_routes(monkeypatch):
    response = answers(monkeypatch, FakeIngress(True, "ok", []), "GET", "/nowhere")
    assert response.status_code == 404          # the routes' own answer, not the middleware's
    assert response.json()["error"]["message"].startswith("Invalid URL")
