"""A request's chunk stream (deployments/streaming.py), without Ray: rounds' chunks merged, at most
one per stream interval after the first; chunks pushed by a router's ChunkSender over a real
channel to an ingress's StreamInbox, ended by the last chunk, by the error that ended the request,
or by the router's call; a reader that gives up cancels the call. The router's call is stood in
for by a future (what the ingress awaits and cancels); tests/test_serving.py runs the real one."""

import asyncio
import time

import pytest

from specserve.common.channel import Channel
from specserve.deployments.streaming import ChunkSender, StreamEndedError, StreamInbox, coalesced_chunks


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


def test_nothing_after_the_last_chunk_is_read():
    async def run() -> list[dict]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in (_chunk("a"), _chunk("b", last=True), StreamEndedError("the call ended")):
            queue.put_nowait(item)
        return [chunk async for chunk in coalesced_chunks(queue)]

    assert [c["text"] for c in asyncio.run(run())] == ["ab"]


async def _open(inbox: StreamInbox) -> tuple:
    """A stream, its router call (a future) and the router's sender over a real channel."""
    call = asyncio.get_running_loop().create_future()
    sinks = []
    stream = await inbox.open(lambda sink: sinks.append(sink) or call)
    return stream, call, ChunkSender(Channel(sinks[0].address), sinks[0])


def test_chunks_pushed_by_the_router_arrive_in_order_and_the_last_ends_the_stream():
    async def run() -> tuple[list[dict], dict]:
        inbox = StreamInbox(lambda: "127.0.0.1")
        stream, call, sender = await _open(inbox)
        for i in range(5):
            sender.put(_chunk(f"t{i} "))
        await sender.finish(_chunk("end", last=True))
        call.set_result(None)   # the router's call returns once the last chunk is held here
        await asyncio.sleep(0.05)
        seen = [chunk async for chunk in stream]
        return seen, inbox.queues, inbox.watching

    seen, open_streams, watching = asyncio.run(run())
    assert "".join(c["text"] for c in seen) == "t0 t1 t2 t3 t4 end"
    assert "usage" in seen[-1] and open_streams == {} and watching == set()


def test_the_error_that_ended_the_request_and_a_call_that_ended_without_its_last_chunk_are_raised():
    async def run(end) -> None:
        inbox = StreamInbox(lambda: "127.0.0.1")
        stream, call, sender = await _open(inbox)
        sender.put(_chunk("a"))
        await end(sender, call)
        async for _ in stream:
            pass

    async def router_error(sender, call):
        await sender.finish(ValueError("engine gone"))
        call.set_result(None)

    async def call_failed(sender, call):
        call.set_exception(RuntimeError("the router died"))

    async def no_last_chunk(sender, call):
        call.set_result(None)

    with pytest.raises(ValueError, match="engine gone"):
        asyncio.run(run(router_error))
    with pytest.raises(RuntimeError, match="the router died"):
        asyncio.run(run(call_failed))
    with pytest.raises(StreamEndedError):
        asyncio.run(run(no_last_chunk))


def test_a_reader_that_gives_up_cancels_the_router_call_and_later_chunks_are_dropped():
    async def run() -> tuple[bool, dict]:
        inbox = StreamInbox(lambda: "127.0.0.1")
        stream, call, sender = await _open(inbox)
        sender.put(_chunk("a"))

        async def read() -> None:
            async for _ in stream:
                pass

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        reader.cancel()
        await asyncio.sleep(0.01)
        sender.put(_chunk("b"))   # still in flight when the client left
        await asyncio.sleep(0.05)
        return call.cancelled(), inbox.queues

    cancelled, open_streams = asyncio.run(run())
    assert cancelled and open_streams == {}
