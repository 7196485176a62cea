"""A request's stream: the chunks its rounds produce, shaped, carried to the ingress and merged.

Serve routes a request once (the ingress's `Router.generate` call, which stays open while the
request runs: cancelling it cancels the request); the chunks do not ride that call as Serve
streaming items, each of which costs an object and Ray's transport on both ends every round.
The router pushes each round's chunk over its channel to the ingress replica (common.channel,
opened once per pair of processes, every request's chunks of an event-loop turn in one frame),
never waiting for the client; the ingress queues them per stream (`StreamInbox`) and
`coalesced_chunks` merges whatever piled up meanwhile. The last chunk (or the error that ended
the request) is a call the router awaits before its `generate` returns, so the ingress holds it
before the call's end is seen.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from specserve.common.channel import Channel, ChannelServer, portable_error
from specserve.common.messages import StreamSink
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import LogprobEntries


def step_chunk(state: RequestState, committed: list[int], logprobs: LogprobEntries | None = None) -> dict:
    """The chunk for tokens one step committed: their text delta and, if asked, their logprobs
    (the verify's entries for them, computed on the target engine)."""
    chunk = {"text": state.take_text_delta(), "token_ids": committed, "finish_reason": state.finish_reason}
    if logprobs is not None:
        chunk["logprobs"] = logprobs.entries(committed)
    return chunk


def final_chunk(state: RequestState, speculation: dict[str, Any]) -> dict:
    """The last chunk: any text left, usage and the `speculation` object."""
    usage = {"prompt_tokens": len(state.prompt_ids), "completion_tokens": len(state.output_ids),
             "total_tokens": len(state.prompt_ids) + len(state.output_ids),
             "prompt_tokens_details": {"cached_tokens": state.num_cached_tokens}}
    return {"text": state.take_text_delta(), "token_ids": [], "finish_reason": state.finish_reason,
            "usage": usage, "speculation": speculation}


async def coalesced_chunks(chunks: asyncio.Queue, interval_s: float = 0.0) -> AsyncIterator[dict]:
    """The chunks put on the queue, merged: whatever piled up since the last one went out, and with
    interval_s > 0 at most one per interval after the first (the first token and the final chunk
    never wait). Ends after the chunk with "usage"; raises an exception put on the queue."""
    last_sent = None
    while True:
        pending = [await chunks.get()]
        if interval_s and last_sent is not None:  # let rounds pile up, but never hold the last one
            deadline = last_sent + interval_s
            while not _is_last(pending[-1]) and (wait_s := deadline - time.perf_counter()) > 0:
                try:
                    pending.append(await asyncio.wait_for(chunks.get(), wait_s))
                except asyncio.TimeoutError:
                    break
        while not _is_last(pending[-1]) and not chunks.empty():
            pending.append(chunks.get_nowait())
        if isinstance(pending[-1], Exception):
            raise pending[-1]
        merged = _merge_chunks(pending)
        yield merged
        last_sent = time.perf_counter()
        if "usage" in merged:
            return


def _is_last(chunk: dict | Exception) -> bool:
    """The final chunk (usage) or an error: never held back by the stream interval."""
    return isinstance(chunk, Exception) or "usage" in chunk


def _merge_chunks(chunks: list[dict]) -> dict:
    """One chunk carrying several steps' text and tokens (the last one's finish reason and stats)."""
    if len(chunks) == 1:
        return chunks[0]
    merged = dict(chunks[-1])
    merged["text"] = "".join(chunk["text"] for chunk in chunks)
    merged["token_ids"] = [token for chunk in chunks for token in chunk["token_ids"]]
    if any("logprobs" in chunk for chunk in chunks):
        merged["logprobs"] = [entry for chunk in chunks for entry in chunk.get("logprobs", [])]
    for chunk in chunks:  # only the first chunk of a request has them
        if "prompt_logprobs" in chunk:
            merged["prompt_logprobs"] = chunk["prompt_logprobs"]
    return merged


class StreamEndedError(RuntimeError):
    """The router's call ended without the request's last chunk."""


class ChunkSender:
    """The router's end of one request's stream: chunks pushed to the ingress's StreamInbox."""

    def __init__(self, channel: Channel, sink: StreamSink) -> None:
        self.channel = channel
        self.stream_id = sink.stream_id

    def put(self, chunk: dict) -> None:
        """Send a chunk without waiting; raises ChannelLostError once the ingress is gone."""
        self.channel.send("chunk", self.stream_id, chunk)

    async def finish(self, last: dict | Exception) -> None:
        """Deliver the last chunk, or the error that ended the request, and wait until it is queued."""
        await self.channel.call("last", self.stream_id, last if isinstance(last, dict) else portable_error(last))


class StreamInbox:
    """An ingress replica's end of the routers' chunk channels: one ChannelServer (listening on
    host at a port the OS picks, opened at the first stream) and a queue per open stream."""

    def __init__(self, host: Callable[[], str], interval_s: float = 0.0) -> None:
        self.host = host
        self.interval_s = interval_s
        self.server = ChannelServer(self._answer, receive=self._receive)
        self.queues: dict[int, asyncio.Queue] = {}
        self.watching: set[asyncio.Future] = set()   # every stream's watch on its router call, kept referenced until it ends
        self._ids = itertools.count()
        self._started: asyncio.Future | None = None

    async def open(self, start: Callable[[StreamSink], Any]) -> ChunkStream:
        """A new stream; start(sink) makes the router call that fills it (a Serve response)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.server.start(self.host()))
        address = await asyncio.shield(self._started)
        stream_id = next(self._ids)
        queue = self.queues[stream_id] = asyncio.Queue()
        return ChunkStream(self, stream_id, queue, start(StreamSink(address, stream_id)))

    def _receive(self, method: str, args: tuple) -> None:
        stream_id, chunk = args
        queue = self.queues.get(stream_id)
        if queue is not None:   # else the stream was closed (client gone): drop it
            queue.put_nowait(chunk)

    async def _answer(self, method: str, args: tuple) -> None:
        if method != "last":
            raise ValueError(f"an ingress answers no {method!r} over a channel")
        self._receive(method, args)


class ChunkStream:
    """One request's merged chunks as the ingress reads them (`async for`); `cancel()` ends the
    request on the router (which releases its engines) and closes the stream."""

    def __init__(self, inbox: StreamInbox, stream_id: int, queue: asyncio.Queue, response: Any) -> None:
        self.inbox = inbox
        self.stream_id = stream_id
        self.response = response
        self.ended = False   # the last chunk or the request's error has been read: nothing to cancel
        self._chunks = coalesced_chunks(queue, inbox.interval_s)
        self._watch = asyncio.ensure_future(self._watch_call(queue))
        inbox.watching.add(self._watch)
        self._watch.add_done_callback(inbox.watching.discard)

    async def _watch_call(self, queue: asyncio.Queue) -> None:
        """The router call's end: an error (the router failed or died) ends the stream with it; a
        plain end after the last chunk is nothing, one without it is StreamEndedError."""
        try:
            await self.response
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(StreamEndedError("the router ended the request without its last chunk"))

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict:
        try:
            return await self._chunks.__anext__()
        except asyncio.CancelledError:   # the reader gave up (client gone)
            self.cancel()
            raise
        except BaseException:   # past the last chunk, or the error that ended the request
            self.ended = True
            self._close()
            raise

    def cancel(self) -> None:
        """End the request on the router, unless it has ended, and close the stream."""
        if not self.ended:
            self.ended = True
            self.response.cancel()
            self._watch.cancel()
        self._close()

    def _close(self) -> None:
        self.inbox.queues.pop(self.stream_id, None)
