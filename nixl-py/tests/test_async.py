"""Beyond NIXL: asyncio counterparts (awaitable transfers, an async iterator of
notifications), completed through the event loop with no polling thread."""

import asyncio
import threading

import pytest
from conftest import HANG, addr, buf, connect, pattern, unique

import nixl_rs

N = 1 << 20


def _setup(agents):
    a, b = agents(unique("as-a")), agents(unique("as-b"))
    src, dst = pattern(N, 9), buf(N)
    a.register_memory([(addr(src), N, 0, "")], "DRAM")
    b.register_memory([(addr(dst), N, 0, "")], "DRAM")
    connect(a, b)
    loc = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src) + i * 4096, 4096, 0)
                                                for i in range(N // 4096)], "DRAM")
    rem = a.prep_xfer_dlist(b.name, [(addr(dst) + i * 4096, 4096, 0)
                                     for i in range(N // 4096)], "DRAM")
    return a, b, src, dst, loc, rem


def test_awaitable_transfer_and_notifications(agents):
    a, b, src, dst, loc, rem = _setup(agents)
    idx = list(range(N // 4096))

    async def main():
        threads_before = threading.active_count()
        got = []

        async def listen():
            async for peer, msg in b.notifications():
                got.append((peer, msg))
                if len(got) == 3:
                    return

        listener = asyncio.create_task(listen())
        h = a.make_prepped_xfer("WRITE", loc, idx, rem, idx, notif_msg=b"n0")
        assert await a.transfer_async(h) == "DONE"
        assert (dst == src).all()
        dst[:] = 0
        assert await a.transfer_async(h, b"n1") == "DONE"
        assert (dst == src).all()
        # Posted the NIXL way, awaited the asyncio way.
        dst[:] = 0
        a.transfer(h, b"n2")
        assert await a.wait_xfer(h) == "DONE"
        assert a.check_xfer_state(h) == "DONE"
        assert (dst == src).all()
        await asyncio.wait_for(listener, HANG)
        assert got == [(a.name, b"n0"), (a.name, b"n1"), (a.name, b"n2")]
        # Awaiting started no Python thread.
        assert threading.active_count() == threads_before

    asyncio.run(main())


def test_async_errors_raise(agents):
    a, b, src, dst, loc, rem = _setup(agents)

    async def main():
        h = a.make_prepped_xfer("WRITE", loc, [0], rem, [0])
        a.release_xfer_handle(h)
        with pytest.raises(nixl_rs.nixlNotFoundError):
            await a.transfer_async(h)

    asyncio.run(main())


def test_cancelled_notification_wait_loses_nothing(agents):
    a, b, src, dst, loc, rem = _setup(agents)

    async def main():
        it = b.notifications()
        # A waiter that times out before anything arrives.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(it.__anext__(), 0.05)
        a.send_notif(b.name, b"after the timeout")
        peer, msg = await asyncio.wait_for(it.__anext__(), HANG)
        assert (peer, msg) == (a.name, b"after the timeout")

    asyncio.run(main())


def test_a_waiter_cancelled_as_its_notification_arrives_loses_nothing(agents):
    import time

    a, b, src, dst, loc, rem = _setup(agents)

    async def main():
        it = b.notifications()
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # the waiter awaits its future
        a.send_notif(b.name, b"raced")
        # Block the loop until the delivery is queued on it, then let it run: the
        # waiter's future holds the notification, the waiter has not resumed yet.
        wait_for_queued = time.monotonic() + 0.5
        while time.monotonic() < wait_for_queued:
            time.sleep(0.01)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        peer, msg = await asyncio.wait_for(it.__anext__(), HANG)
        assert (peer, msg) == (a.name, b"raced")

    asyncio.run(main())


def test_notification_stream_ends_at_shutdown(agents):
    a, b, src, dst, loc, rem = _setup(agents)

    async def main():
        async def drain():
            return [x async for x in b.notifications()]

        task = asyncio.create_task(drain())
        a.send_notif(b.name, b"one")
        await asyncio.sleep(0)
        # Shutting the agent down (GIL released meanwhile) ends the iteration.
        for _ in range(1000):
            await asyncio.sleep(0.001)
            if task.done():
                break
            if not b.agent.is_shut_down and b.get_new_notifs() == {}:
                pass
        await asyncio.get_running_loop().run_in_executor(None, b.shutdown)
        got = await asyncio.wait_for(task, HANG)
        assert got in ([(a.name, b"one")], [])

    asyncio.run(main())
