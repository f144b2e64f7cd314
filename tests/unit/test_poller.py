"""The /dev/fuse poller (rpmemfs/poller.py): it polls for its budget after a request, and not
while a durability point waits."""

from __future__ import annotations

import time

import trio

from rpmemfs.poller import RequestPoller

BUDGET = 0.2


def test_no_polling_while_a_point_waits_and_a_whole_budget_after() -> None:
    poller = RequestPoller(int(BUDGET * 1e6))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            await trio.sleep(0.01)
            poller.kick()
            await trio.sleep(0.05)  # polling (or given way, on a busy machine)
            with poller.held():
                with trio.fail_after(5):
                    while poller._idle is None:  # the poll under way when the hold began ends
                        await trio.sleep(0.001)
                before = (poller.polls, poller.yielded)
                poller.kick()  # a request arriving while the point waits
                await trio.sleep(BUDGET + 0.05)  # the point waiting for its replicas
                assert (poller.polls, poller.yielded) == before, "polled while a point waited"
            ended = time.perf_counter()
            # The point's end starts a whole budget (unless a busy machine made it back off).
            assert poller._until >= ended + BUDGET * 0.99 or poller._quiet_until > ended
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_budget_of_zero_never_polls() -> None:
    poller = RequestPoller(0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            with poller.held():
                poller.kick()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert poller.polls == 0

    trio.run(main)
