"""The actor an engine runs in, apart from the Serve replica that spawns it (deployments.engine_host).

Why a module of its own: the engine's actor imports this module to become one, and nothing else
of the serving layer: not Serve, whose replica machinery an engine has no use for, and which
would sit on every engine's start beside its own imports and model load.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any


class EngineProcess:
    """The actor an engine runs in: it imports the engine class named by `engine_path`
    ("module:Class") and builds it from the remaining arguments. Its methods are what is called on
    an engine through Ray (health, stats, the channel's address, a draft's new weights); the rounds
    go over the channel the engine serves itself. `engine` is the engine object, for a function
    sent with Ray's `__ray_call__`."""

    def __init__(self, engine_path: str, *args: Any) -> None:
        module, _, name = engine_path.partition(":")
        self.engine = getattr(importlib.import_module(module), name)(*args)

    async def _call(self, method: str, *args: Any) -> Any:
        answer = getattr(self.engine, method)(*args)
        return await answer if inspect.isawaitable(answer) else answer

    async def ping(self) -> bool:
        return await self._call("ping")

    async def stats(self) -> Any:
        return await self._call("stats")

    async def open_channel(self, host: str | None = None) -> str:
        return await self._call("open_channel", host)

    async def set_followers(self, followers: list[Any]) -> None:
        return await self._call("set_followers", followers)

    async def release(self, seq_id: str) -> None:
        return await self._call("release", seq_id)

    async def active_sequences(self) -> list[str]:
        return await self._call("active_sequences")

    async def call_times(self) -> list[tuple[str, str, float, float]]:
        return await self._call("call_times")

    async def load_draft(self, *args: Any) -> Any:
        return await self._call("load_draft", *args)

    async def version(self) -> dict[str, Any]:
        return await self._call("version")
