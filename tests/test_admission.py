"""Router admission: past capacity a request waits in order; past the bounds it gets 503."""

import asyncio

import pytest

from specserve.deployments.admission import Admission, ServerOverloadedError


def run(coro):
    return asyncio.run(coro)


def test_requests_beyond_capacity_wait_and_are_admitted_in_order():
    async def scenario():
        admission = Admission(max_active=2, max_waiting=10, timeout_s=5)
        order: list[int] = []
        release = asyncio.Event()

        async def request(i: int):
            async with admission.slot():
                order.append(i)
                await release.wait()

        tasks = [asyncio.create_task(request(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert order == [0, 1] and admission.num_waiting == 3
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert admission.num_active == 0 and admission.num_waiting == 0

    run(scenario())


def test_too_many_waiters_are_refused_at_once():
    async def scenario():
        admission = Admission(max_active=1, max_waiting=1, timeout_s=5)
        hold = asyncio.Event()

        async def request():
            async with admission.slot():
                await hold.wait()

        first, second = asyncio.create_task(request()), asyncio.create_task(request())
        await asyncio.sleep(0.01)
        with pytest.raises(ServerOverloadedError):
            async with admission.slot():
                pass
        hold.set()
        await asyncio.gather(first, second)
        assert admission.num_active == 0

    run(scenario())


def test_a_waiter_past_the_timeout_is_refused_and_frees_its_place():
    async def scenario():
        admission = Admission(max_active=1, max_waiting=5, timeout_s=0.05)
        async with admission.slot():
            with pytest.raises(ServerOverloadedError) as refused:
                async with admission.slot():
                    pass
            assert refused.value.retry_after_s > 0
            assert admission.num_waiting == 0
        assert admission.num_active == 0
        async with admission.slot():  # capacity is whole again
            assert admission.num_active == 1

    run(scenario())


def test_a_cancelled_waiter_leaves_no_trace():
    async def scenario():
        admission = Admission(max_active=1, max_waiting=5, timeout_s=5)
        async with admission.slot():
            waiter = asyncio.create_task(admission.slot().__aenter__())
            await asyncio.sleep(0.01)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert admission.num_waiting == 0
        assert admission.num_active == 0

    run(scenario())
