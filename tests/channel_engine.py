"""A stand-in engine process for tests/test_channel.py: a ChannelServer on 127.0.0.1 that prints
its address and answers "echo" (its arguments) and "hang" (never), so a test can kill or stop
a real process with calls waiting on it."""

import asyncio

from specserve.common.channel import ChannelServer


async def answer(method: str, args: tuple):
    if method == "hang":
        await asyncio.Event().wait()
    return args


async def main() -> None:
    server = ChannelServer(answer)
    print(await server.start("127.0.0.1"), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
