"""A router's channel to an engine (common/channel.py), without Ray: every call of one event-loop
turn leaves as one frame and one engine turn's answers come back as one; answers and errors reach
the call that asked; messages sent without a reply arrive in order with the calls; an engine whose process dies, or that hangs, fails every call waiting on it
with ChannelLostError; a channel is opened once per address and replaced only once lost. The
engines that die or hang here are real processes (tests/channel_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.common.channel import (LOCAL_SOCKETS, Channel, ChannelLostError, ChannelPool, ChannelServer,
                                      EngineGoneError, RemoteCallError, split_address)

HOST = "127.0.0.1"


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


async def answer(method: str, args: tuple):
    if method == "echo":
        return args
    if method == "delay":
        await asyncio.sleep(args[0])
        return args[1]
    if method == "fail":
        raise KeyError(args[0])
    if method == "unpicklable":
        raise Unpicklable("kept here")
    raise ValueError(method)


def test_calls_of_one_turn_go_as_one_frame_and_answers_of_one_turn_come_back_as_one():
    async def scenario():
        gate = asyncio.get_running_loop().create_future()

        async def gated(method, args):
            if method == "gated":
                await gate
                return args[0]
            return await answer(method, args)

        server = ChannelServer(gated)
        channel = Channel(await server.start(HOST))
        assert await channel.call("echo", 1) == (1,)   # connected
        received, sent = server.frames_received, server.outboxes[0].frames
        calls = [channel.call("gated", i) for i in range(10)]
        await asyncio.sleep(0.2)
        assert server.frames_received == received + 1
        gate.set_result(None)
        answers = await asyncio.gather(*calls)
        return answers, server.outboxes[0].frames - sent

    answers, frames_back = asyncio.run(scenario())
    assert answers == list(range(10))
    assert frames_back == 1


def test_sent_messages_are_received_in_order_with_the_calls_around_them_and_get_no_reply():
    async def scenario():
        seen = []

        async def answering(method, args):
            seen.append((method, args))
            return len(seen)

        server = ChannelServer(answering, receive=lambda method, args: seen.append((method, args)))
        channel = Channel(await server.start(HOST))
        assert await channel.call("call", 0) == 1   # connected
        replies = server.outboxes[0].frames
        for i in range(1, 4):
            channel.send("message", i)
        last = await channel.call("call", 4)
        assert server.outboxes[0].frames == replies + 1   # the messages were answered by nothing
        return seen, last

    seen, last = asyncio.run(scenario())
    assert seen == [("call", (0,)), ("message", (1,)), ("message", (2,)), ("message", (3,)), ("call", (4,))]
    assert last == 5


def test_each_answer_reaches_its_own_call_whatever_the_order_they_finish_in():
    async def scenario():
        server = ChannelServer(answer)
        channel = Channel(await server.start(HOST))
        return await asyncio.gather(*(channel.call("delay", 0.02 * (5 - i), i) for i in range(6)))

    assert asyncio.run(scenario()) == list(range(6))


def test_an_engine_error_is_raised_to_the_caller_as_itself_or_named_when_it_does_not_pickle():
    async def scenario():
        server = ChannelServer(answer)
        channel = Channel(await server.start(HOST))
        with pytest.raises(KeyError, match="seq"):
            await channel.call("fail", "seq")
        with pytest.raises(RemoteCallError, match="Unpicklable: kept here"):
            await channel.call("unpicklable")
        return await channel.call("echo", "still open")

    assert asyncio.run(scenario()) == ("still open",)


ENGINE = Path(__file__).with_name("channel_engine.py")


@contextlib.contextmanager
def engine_process():
    """(process, address) of an engine stand-in in a process of its own, killed on the way out."""
    process = subprocess.Popen([sys.executable, str(ENGINE)], stdout=subprocess.PIPE, text=True)
    try:
        yield process, process.stdout.readline().strip()
    finally:
        process.kill()
        process.wait()


def test_calls_waiting_on_an_engine_whose_process_dies_fail_with_channel_lost():
    async def scenario(process, address):
        channel = Channel(address)
        assert await channel.call("echo", 7) == (7,)
        waiting = channel.call("hang")
        await asyncio.sleep(0.1)
        started = time.monotonic()
        process.kill()
        with pytest.raises(ChannelLostError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(ChannelLostError):   # a lost channel stays lost
            await channel.call("echo", 1)
        with pytest.raises(ChannelLostError):   # and a message to it is refused at once
            channel.send("echo", 1)
        return time.monotonic() - started

    with engine_process() as (process, address):
        assert asyncio.run(scenario(process, address)) < 2.0


def test_a_hung_engine_is_lost_once_its_heartbeat_stops():
    async def scenario(process, address):
        channel = Channel(address, heartbeat_timeout_s=1.5)
        assert await channel.call("echo", 7) == (7,)
        await asyncio.sleep(2.0)   # heartbeats keep an idle channel open
        assert not channel.lost
        waiting = channel.call("hang")
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ChannelLostError, match="sent nothing"):
            await asyncio.wait_for(waiting, 10)
        return time.monotonic() - started

    with engine_process() as (process, address):
        assert asyncio.run(scenario(process, address)) < 4.0


def test_nothing_listening_at_the_address_is_engine_gone():
    with engine_process() as (process, address):
        pass

    async def scenario():
        with pytest.raises(EngineGoneError):
            await ChannelPool().to(address).call("echo", 1)

    asyncio.run(scenario())


def test_a_pool_keeps_one_channel_per_address_and_replaces_only_a_lost_one():
    async def scenario():
        servers = [ChannelServer(answer) for _ in range(2)]
        first, second = [await server.start(HOST) for server in servers]
        pool = ChannelPool()
        channel = pool.to(first)
        await channel.call("echo", 1)
        assert pool.to(first) is channel and pool.to(second) is not channel
        await pool.to(second).call("echo", 2)
        assert servers[0].frames_received == 1 and len(servers[0].outboxes) == 1
        channel.close()
        replacement = pool.to(first)
        assert replacement is not channel and await replacement.call("echo", 3) == (3,)

    asyncio.run(scenario())


def test_an_address_must_be_host_and_port_with_an_optional_local_socket():
    assert split_address("10.0.0.2:4711") == ("10.0.0.2", 4711, None)
    assert split_address("[::1]:80") == ("::1", 80, None)
    assert split_address("10.0.0.2:4711@specserve-1-ab") == ("10.0.0.2", 4711, "specserve-1-ab")
    with pytest.raises(ValueError, match="host:port"):
        split_address("10.0.0.2")
    with pytest.raises(ValueError, match="host:port"):
        split_address("10.0.0.2@specserve-1-ab")


@pytest.mark.skipif(not LOCAL_SOCKETS, reason="abstract Unix sockets are Linux's")
def test_a_channel_on_one_host_takes_the_local_socket_and_tcp_where_that_is_not_there():
    """A peer on this host is reached over its local socket; an address whose local socket this
    process cannot reach (another host's, as a peer on another node's looks from here) over TCP."""
    async def scenario():
        server = ChannelServer(answer)
        address = await server.start(HOST)
        local = Channel(address)
        assert await local.call("echo", 1) == (1,) and local.transport == "local"
        elsewhere = Channel(address.partition("@")[0] + "@specserve-on-another-host")
        assert await elsewhere.call("echo", 2) == (2,) and elsewhere.transport == "tcp"
        tcp_only = Channel(address.partition("@")[0])
        assert await tcp_only.call("echo", 3) == (3,) and tcp_only.transport == "tcp"
        assert len(server.outboxes) == 3
        pool = ChannelPool()
        await pool.to(address).call("echo", 4)
        await pool.to(address.partition("@")[0]).call("echo", 5)
        assert pool.transports() == {"local": 1, "tcp": 1}
        pool.close()
        assert pool.transports() == {}
        await server.close()

    asyncio.run(scenario())
