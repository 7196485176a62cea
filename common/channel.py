"""A process's persistent connection to a peer: a router's to each engine, over which every
request's round calls go, and a router's to each ingress replica, over which every request's
chunks stream back.

Why not a Ray actor call per round, or a Serve streaming item per chunk: each one costs pickling,
Ray's transport and an event-loop handoff on both ends, paid every round (docs/transport.md). Ray
and Serve still place the processes and hand a router the engines' and the ingress's addresses
once per request; the rounds and chunks go over connections that each pair of processes opens
once and reuses: a local socket where both share a host (its round trip is shorter than
loopback TCP's), TCP across hosts.

Addresses: "host:port@name", the TCP address and the name of the server's local socket (an
abstract Unix socket: no file to clean up, reachable only from the same network namespace, which
on Kubernetes is the same pod); "host:port" where there is none. A caller tries the local socket
first and takes TCP where it is not there, so nobody has to know which processes share a host.

Batching: every call a process's coroutines make to one engine in one event-loop turn leaves as
ONE frame (its entries keyed by call id); the engine runs them as concurrent tasks (its batching
loop then batches them with every other router's calls) and answers, in one frame, every call
that finished in the same turn of its event loop: one engine step's answers travel together. A
message sent with `send` expects no answer (a streamed chunk): the peer handles it at once, in
order with the calls around it.

Faults: a connection that closes (the peer's process ended) or stays silent past
`heartbeat_timeout_s` (the answering side sends an empty frame every HEARTBEAT_INTERVAL_S, so
silence means a hung process or a lost node) fails every call waiting on it with
ChannelLostError, which the router treats as a lost engine (or a lost client, for an ingress's
channel); a refused connection (nothing listens at the address any more) is EngineGoneError. A
lost channel is never reused: the next call to that address opens a new one. A peer-side error
travels back as itself and is raised to the caller.

Wire: a frame is an 8-byte length, then a pickle (protocol 5) of a tuple of ChannelCall or
ChannelReply (common.messages), a ChannelCall with no call id being a message sent with `send`;
an empty tuple is a heartbeat. Pickle runs what it reads, so a
channel, like Ray's own ports, must only be reachable from inside the cluster.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import pickle
import secrets
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from specserve.common.messages import ChannelCall, ChannelReply

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!Q")
# While a ChannelServer answers a call: which of its connections the call came over (an id that
# stays unique for the server's life), so an answer can remember who asks and `on_close` can name
# the connection that went away.
CALLER: contextvars.ContextVar[int] = contextvars.ContextVar("channel_caller")
HEARTBEAT_INTERVAL_S = 1.0   # how often the answering side tells each open channel it is alive
HEARTBEAT_TIMEOUT_S = 15.0   # silence this long means the peer is lost (far beyond a heartbeat's delay on a loaded box)
CONNECT_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 31
# Abstract Unix sockets (a name, not a file) are Linux's; elsewhere every channel is TCP.
LOCAL_SOCKETS = sys.platform.startswith("linux")


class ChannelLostError(ConnectionError):
    """The peer behind a channel cannot answer: its connection closed or went silent."""


class EngineGoneError(ChannelLostError):
    """Nothing listens at the peer's address (an engine's, mostly): its process has ended, with its state."""


class RemoteCallError(RuntimeError):
    """A peer-side error that could not travel as itself (it does not pickle)."""


def encode_frame(entries: tuple) -> bytes:
    body = pickle.dumps(entries, protocol=5)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ChannelLostError(f"a frame of {size} bytes: the peer does not speak this protocol")
    return pickle.loads(await reader.readexactly(size))


def split_address(address: str) -> tuple[str, int, str | None]:
    """"host:port" or "host:port@name" (an IPv6 host in brackets) -> (host, port, the local
    socket's name or None)."""
    tcp, _, local = address.partition("@")
    host, sep, port = tcp.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a channel address is host:port[@name], not {address!r}")
    return host.strip("[]"), int(port), local or None


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Outbox:
    """Entries to send on one connection: the first one queued in an event-loop turn schedules
    a flush at the next turn, which sends everything queued by then as one frame."""

    def __init__(self, writer: asyncio.StreamWriter, on_unpicklable: Callable[[Any, Exception], Any]) -> None:
        """on_unpicklable(entry, error) -> what to send instead of an entry that does not pickle (None: nothing)."""
        self.writer = writer
        self.entries: list = []
        self.on_unpicklable = on_unpicklable
        self.frames = 0   # frames written, heartbeats not counted
        self._scheduled = False

    def put(self, entry: Any) -> None:
        self.entries.append(entry)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self.entries or self.writer.is_closing():
            return
        entries, self.entries = tuple(self.entries), []
        try:
            frame = encode_frame(entries)
        except Exception:   # an entry does not pickle: send the rest, tell its owner why
            sendable = []
            for entry in entries:
                try:
                    pickle.dumps(entry, protocol=5)
                    sendable.append(entry)
                except Exception as error:
                    instead = self.on_unpicklable(entry, error)
                    if instead is not None:
                        sendable.append(instead)
            frame = encode_frame(tuple(sendable))
        self.writer.write(frame)
        self.frames += 1


class Channel:
    """The calling side of one channel: `call` returns a future of the peer's answer, `send`
    returns nothing."""

    def __init__(self, address: str, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.address = address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.transport: str | None = None   # "local" or "tcp" once connected
        self.error: ChannelLostError | None = None
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._waiting: list[ChannelCall] = []   # calls made before the connection was open
        self._outbox: _Outbox | None = None
        self._last_frame_s = time.monotonic()
        self._task = self._loop.create_task(self._run())

    @property
    def lost(self) -> bool:
        return self.error is not None

    def call(self, method: str, *args: Any) -> asyncio.Future:
        """Send method(*args) to the peer (with every other call of this event-loop turn);
        -> a future of its answer. A caller that stops waiting leaves the call running there."""
        future = self._loop.create_future()
        if self.error is not None:
            future.set_exception(type(self.error)(str(self.error)))
            return future
        call = ChannelCall(next(self._ids), method, args)
        self._pending[call.call_id] = future
        self._put(call)
        return future

    def send(self, method: str, *args: Any) -> None:
        """Send method(*args) to the peer (with every other call of this event-loop turn), wanting
        no answer; raises the channel's error if it is lost."""
        if self.error is not None:
            raise type(self.error)(str(self.error))
        self._put(ChannelCall(None, method, args))

    def _put(self, call: ChannelCall) -> None:
        if self._outbox is None:
            self._waiting.append(call)
        else:
            self._outbox.put(call)

    def close(self) -> None:
        """Fail what waits and close the connection (the router is going away)."""
        self._lose(ChannelLostError(f"the channel to {self.address} was closed"))

    def _unpicklable(self, call: ChannelCall, error: Exception) -> None:
        if call.call_id is None:
            logger.error("a %s message was not sent: its arguments do not pickle (%s)", call.method, error)
            return None
        future = self._pending.pop(call.call_id, None)
        if future is not None and not future.done():
            future.set_exception(TypeError(f"{call.method}'s arguments do not pickle: {error}"))
        return None

    async def _run(self) -> None:
        writer = None
        try:
            reader, writer = await self._connect()
            self._outbox = _Outbox(writer, self._unpicklable)
            for call in self._waiting:
                self._outbox.put(call)
            self._waiting.clear()
            self._last_frame_s = time.monotonic()
            watchdog = self._loop.create_task(self._watch(writer))
            try:
                while True:
                    replies = await read_frame(reader)
                    self._last_frame_s = time.monotonic()
                    for reply in replies:
                        future = self._pending.pop(reply.call_id, None)
                        if future is None or future.done():
                            continue
                        if reply.error is not None:
                            future.set_exception(reply.error)
                        else:
                            future.set_result(reply.value)
            finally:
                watchdog.cancel()
        except ChannelLostError as exc:
            self._lose(exc)
        except asyncio.CancelledError:
            self._lose(ChannelLostError(f"the channel to {self.address} was closed"))
            raise
        except Exception as exc:   # closed, reset, or a frame that does not unpickle
            self._lose(ChannelLostError(f"the connection to {self.address} broke "
                                        f"({type(exc).__name__}: {exc})"))
        finally:
            if writer is not None:
                writer.transport.abort()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The peer's local socket where this process shares its host, else its TCP port."""
        host, port, local = split_address(self.address)
        if local is not None and LOCAL_SOCKETS:
            try:
                opened = await asyncio.wait_for(_open_local(local), CONNECT_TIMEOUT_S)
                self.transport = "local"
                return opened
            except (OSError, asyncio.TimeoutError):
                pass   # another host (or the peer is gone): TCP tells which
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        except ConnectionRefusedError as exc:
            raise EngineGoneError(f"nothing listens at {self.address}") from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise ChannelLostError(f"could not reach {self.address}: {exc!r}") from exc
        _no_delay(writer)
        self.transport = "tcp"
        return reader, writer

    async def _watch(self, writer: asyncio.StreamWriter) -> None:
        """Lose the channel once the peer has been silent past heartbeat_timeout_s."""
        while True:
            await asyncio.sleep(min(HEARTBEAT_INTERVAL_S, self.heartbeat_timeout_s / 4))
            silent_s = time.monotonic() - self._last_frame_s
            if silent_s > self.heartbeat_timeout_s:
                self._lose(ChannelLostError(f"{self.address} sent nothing for {silent_s:.1f} s"))
                writer.transport.abort()
                return

    def _lose(self, error: ChannelLostError) -> None:
        """The first error wins; every call waiting now, and every later one, gets it."""
        if self.error is None:
            self.error = error
            logger.debug("channel lost: %s", error)
        pending, self._pending = self._pending, {}
        self._waiting.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(type(self.error)(str(self.error)))
        if not self._task.done() and asyncio.current_task() is not self._task:
            self._task.cancel()


class ChannelPool:
    """A process's channels, one per peer address, each opened at its first call and kept
    (per event loop: a future belongs to the loop it was made on)."""

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._channels: dict[tuple[int, str], Channel] = {}

    def to(self, address: str) -> Channel:
        """The open channel to address, or a new one when there is none or it was lost."""
        key = (id(asyncio.get_running_loop()), address)
        channel = self._channels.get(key)
        if channel is None or channel.lost:
            self._channels = {k: c for k, c in self._channels.items() if not c.lost}
            channel = self._channels[key] = Channel(address, self.heartbeat_timeout_s)
        return channel

    def transports(self) -> dict[str, int]:
        """How many open channels go over each transport ("local", "tcp"): which way this
        process reaches its peers."""
        counts: dict[str, int] = {}
        for channel in self._channels.values():
            if not channel.lost and channel.transport is not None:
                counts[channel.transport] = counts.get(channel.transport, 0) + 1
        return counts

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


async def _open_local(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the abstract Unix socket name. The socket is made here and handed over, as
    every event loop (uvloop's too) takes a connected socket but not all take an abstract path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def portable_error(error: BaseException) -> BaseException:
    """error itself if it survives a pickle round trip, else a RemoteCallError naming it."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
        return error
    except Exception:
        return RemoteCallError(f"{type(error).__name__}: {error}")


class ChannelServer:
    """The answering side (an engine, an ingress replica): accepts channels, answers each call with
    `await answer(method, args)` (CALLER naming the connection it came over) and hands each
    message sent with `send` to `receive(method, args)` at once (no task: a streamed chunk costs no
    more than its queueing); `on_close(caller)` hears of a connection that ended."""

    def __init__(self, answer: Callable[[str, tuple], Awaitable[Any]],
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 receive: Callable[[str, tuple], None] | None = None,
                 on_close: Callable[[int], None] | None = None) -> None:
        self.answer = answer
        self.receive = receive
        self.on_close = on_close
        self._callers = itertools.count()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.address: str | None = None
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self.frames_received = 0   # call frames, over every channel
        self.outboxes: list[_Outbox] = []   # one per open channel

    async def start(self, host: str) -> str:
        """Listen on host at a port the OS picks, and on a local socket of a fresh name; -> the
        address ("host:port@name") callers connect to."""
        tcp = await asyncio.start_server(self._serve, host, 0)
        self._servers.append(tcp)
        self.address = join_address(host, tcp.sockets[0].getsockname()[1])
        if LOCAL_SOCKETS:
            name = f"specserve-{os.getpid()}-{secrets.token_hex(8)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind("\0" + name)
            self._servers.append(await asyncio.start_unix_server(self._serve, sock=sock))
            self.address += "@" + name
        return self.address

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _no_delay(writer)
        caller = next(self._callers)
        CALLER.set(caller)   # this connection's task, and the answering tasks it starts, see it
        outbox = _Outbox(writer, self._unpicklable)
        self.outboxes.append(outbox)
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(writer))
        try:
            while True:
                calls = await read_frame(reader)
                self.frames_received += 1
                for call in calls:
                    if call.call_id is None:
                        self._receive(call)
                        continue
                    task = asyncio.get_running_loop().create_task(self._answer(call, outbox))
                    self._tasks.add(task)   # kept referenced until it ends
                    task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass   # the router went away: calls still running finish, their answers go nowhere
        except Exception:
            logger.exception("a channel sent a frame this process cannot read; closing it")
        finally:
            heartbeat.cancel()
            self.outboxes.remove(outbox)
            writer.transport.abort()
            if self.on_close is not None:
                self.on_close(caller)

    def _receive(self, call: ChannelCall) -> None:
        if self.receive is None:
            logger.error("a %s message came where nothing receives messages", call.method)
            return
        try:
            self.receive(call.method, call.args)
        except Exception:
            logger.exception("a %s message could not be received", call.method)

    async def _answer(self, call: ChannelCall, outbox: _Outbox) -> None:
        try:
            reply = ChannelReply(call.call_id, await self.answer(call.method, call.args))
        except Exception as exc:
            reply = ChannelReply(call.call_id, error=portable_error(exc))
        outbox.put(reply)

    @staticmethod
    def _unpicklable(reply: ChannelReply, error: Exception) -> ChannelReply:
        return ChannelReply(reply.call_id, error=RemoteCallError(f"the answer does not pickle: {error}"))

    async def _heartbeat(self, writer: asyncio.StreamWriter) -> None:
        frame = encode_frame(())
        while not writer.is_closing():
            writer.write(frame)
            await asyncio.sleep(self.heartbeat_interval_s)
