"""A request's stream: the chunks its rounds produce, shaped and merged for the client.

Rounds run in their own task and put chunks on a queue, so a round never waits for the previous
chunk to be streamed out; `coalesced_chunks` merges whatever piled up meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

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
        while not chunks.empty():
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
