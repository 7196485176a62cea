"""The router's chunk stream: rounds' chunks merged, at most one per stream interval after the first."""

import asyncio
import time

import pytest

from specserve.deployments.streaming import coalesced_chunks


def _chunk(text: str, last: bool = False) -> dict:
    chunk = {"text": text, "token_ids": [len(text)], "finish_reason": "length" if last else None}
    return {**chunk, "usage": {"completion_tokens": 1}} if last else chunk


async def _stream(interval_s: float, round_s: float, rounds: int) -> list[tuple[float, dict]]:
    """Rounds put a chunk every round_s; return (seconds since start, chunk) as the stream yields."""
    queue: asyncio.Queue = asyncio.Queue()

    async def produce() -> None:
        for i in range(rounds):
            queue.put_nowait(_chunk(f"t{i} ", last=i == rounds - 1))
            await asyncio.sleep(round_s)

    producer = asyncio.create_task(produce())
    started, seen = time.perf_counter(), []
    async for chunk in coalesced_chunks(queue, interval_s):
        seen.append((time.perf_counter() - started, chunk))
    await producer
    return seen


def test_without_an_interval_every_round_is_a_chunk():
    seen = asyncio.run(_stream(0.0, 0.01, 6))
    assert [c["text"] for _, c in seen] == [f"t{i} " for i in range(6)]


def test_an_interval_merges_rounds_and_keeps_every_token_in_order():
    seen = asyncio.run(_stream(0.05, 0.01, 20))
    assert 2 <= len(seen) <= 10, [c["text"] for _, c in seen]  # >= 0.2 s of rounds, a chunk per 50 ms
    assert "".join(c["text"] for _, c in seen) == "".join(f"t{i} " for i in range(20))
    assert [t for _, c in seen for t in c["token_ids"]] == [len(f"t{i} ") for i in range(20)]
    assert seen[0][0] < 0.04  # the first token is not held back
    assert "usage" in seen[-1][1] and all("usage" not in c for _, c in seen[:-1])
    gaps = [b - a for (a, _), (b, _) in zip(seen, seen[1:-1])]
    assert all(gap >= 0.045 for gap in gaps), gaps


def test_the_final_chunk_is_not_held_back():
    seen = asyncio.run(_stream(1.0, 0.0, 2))  # a second chunk that is the last: sent at once
    assert len(seen) == 2 and seen[-1][0] < 0.5
    # The last round ends inside an interval: it goes out when it arrives, not when the interval ends.
    seen = asyncio.run(_stream(1.0, 0.05, 4))
    assert seen[-1][0] < 0.5, [round(t, 3) for t, _ in seen]
    assert "".join(c["text"] for _, c in seen) == "t0 t1 t2 t3 "


def test_an_error_from_the_rounds_is_raised():
    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_chunk("a"))
        queue.put_nowait(RuntimeError("engine gone"))
        async for _ in coalesced_chunks(queue, 0.05):
            pass

    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(run())
