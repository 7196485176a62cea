"""What a round's hop costs where nothing else runs: a channel call's round trip between two
processes, and an engine loop's handoff of a call to its worker thread and back.

    python -m specserve.bench.figures.channel_hops [--calls 2000] [--turns 3] --out bench/results --name NAME

Why: a served round's orchestration (bench.round_profile) is mostly its hops, each measured from
the router's send to the engine's batching loop and back. These are their floors on the same box,
so the two can be read side by side (docs/transport.md). Variants, taking turns, each turn
`calls` calls one after another, spaced as a round's calls are (SPACING_S):
- channel: `Channel.call` to a `ChannelServer` in another process that answers at once, over the
  server's local socket (what a channel on one host takes) and over TCP on loopback (what it
  takes across hosts);
- channel beside busy cores: each of those while one process per core spins (what a woken peer
  meets while the engines compute);
- engine loop: `EngineLoop.submit` of a call whose iteration does nothing, in this process (the
  event loop hands the call to the loop's worker thread and takes the answer back);
- inline: the same do-nothing iteration on the event loop, with the loop turns EngineLoop lets
  arrivals in by: what is left of the engine loop without its worker thread.
Medians of each turn's calls, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.report import markdown_table

SPACING_S = 0.002   # idle between calls, as between a round's hops: each call finds its peer asleep
WARMUP_CALLS = 200
# The echo server starts fresh rather than forked from a process whose threads (torch's, a test
# runner's) might hold a lock at the fork; a spinner is forked, so it spins at once, and it runs
# nothing that could wait on such a lock.
SERVER_PROCESS = multiprocessing.get_context("spawn")
SPINNER_PROCESS = multiprocessing.get_context("fork")


async def _echo(method: str, args: tuple) -> object:
    return args[0]


def _serve_channel(addresses) -> None:
    """(a child process) A ChannelServer answering every call with its argument, until killed."""
    import uvloop

    from specserve.common.channel import ChannelServer

    async def serve() -> None:
        server = ChannelServer(_echo)
        addresses.put(await server.start("127.0.0.1"))
        await asyncio.Event().wait()
    uvloop.run(serve())


def _spin() -> None:
    """(a child process) Keep one core busy until killed."""
    while True:
        pass


@dataclass
class _Call:
    seq_id: str


def _nothing(calls: list) -> tuple[dict[int, None], int]:
    return {index: None for index in range(len(calls))}, len(calls)


async def _timed(call, calls: int) -> list[float]:
    for _ in range(WARMUP_CALLS):
        await call()
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - started)
        await asyncio.sleep(SPACING_S)
    return seconds


async def _channel_calls(address: str, calls: int) -> list[float]:
    from specserve.common.channel import Channel

    channel = Channel(address)
    try:
        return await _timed(lambda: channel.call("echo", 1), calls)
    finally:
        channel.close()


async def _engine_loop_calls(calls: int) -> list[float]:
    from specserve.deployments.engine_loop import EngineLoop

    loop = EngineLoop(_nothing, release=lambda seq_id: None)
    return await _timed(lambda: loop.submit(_Call("bench")), calls)


async def _inline_calls(calls: int) -> list[float]:
    from specserve.deployments.engine_loop import LET_ARRIVALS_IN

    async def call() -> None:
        _nothing([_Call("bench")])
        for _ in range(LET_ARRIVALS_IN):
            await asyncio.sleep(0)
    return await _timed(call, calls)


def _with_spinners(count: int, run):
    spinners = [SPINNER_PROCESS.Process(target=_spin, daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        return run()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per variant and turn")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--name", default="channel-hops")
    args = parser.parse_args(argv)

    import uvloop

    addresses = SERVER_PROCESS.Queue()
    server = SERVER_PROCESS.Process(target=_serve_channel, args=(addresses,), daemon=True)
    server.start()
    address = addresses.get(timeout=30)
    cores = os.cpu_count() or 1
    transports = {"local socket": address, "TCP": address.partition("@")[0]}
    variants = {}
    for transport, reached_at in transports.items():
        variants[f"channel round trip, {transport}"] = (
            lambda reached_at=reached_at: uvloop.run(_channel_calls(reached_at, args.calls)))
    for transport, reached_at in transports.items():
        variants[f"channel round trip, {transport}, {cores} cores busy"] = (
            lambda reached_at=reached_at: _with_spinners(
                cores, lambda: uvloop.run(_channel_calls(reached_at, args.calls))))
    variants.update({
        "engine loop (worker thread) round trip": lambda: uvloop.run(_engine_loop_calls(args.calls)),
        "inline on the event loop": lambda: uvloop.run(_inline_calls(args.calls)),
    })
    turns: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.turns):
            for name, run in variants.items():
                turns[name].append(round(statistics.median(run()) * 1e6, 1))
    finally:
        server.kill()
        server.join()
    medians = {name: round(statistics.median(values), 1) for name, values in turns.items()}
    command = (f"python -m specserve.bench.figures.channel_hops --calls {args.calls} --turns {args.turns} "
               f"--out {args.out} --name {args.name}")
    result = {"command": command, "cores": cores, "calls": args.calls, "spacing_s": SPACING_S,
              "turns_us": turns, "median_us": medians}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [[name, str(medians[name]), ", ".join(map(str, turns[name]))] for name in variants]
    lines = [f"# channel hops: {args.name}", "", f"- command: `{command}`",
             f"- {cores} CPUs; {args.calls} calls a variant and turn, {SPACING_S * 1e3:.0f} ms apart; the variants "
             "taking turns; microseconds, the median of the turns' medians", "",
             markdown_table(["variant", "median us", "per turn"], rows)]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
