"""``FairQueue``: outside requests wait their turn, round robin across client addresses, within
the engine's slots and the per-client limit; 429 with ``Retry-After`` only past the queue's
bound; a request cancelled while waiting leaves the queue."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException

from megatron.rl.server.fair_queue import FairQueue


def queue(
    slots: int | None = 1,
    per_client: int = 16,
    max_queued: int = 512,
    max_queued_per_client: int = 256,
    clock=None,
) -> FairQueue:
    extra = {} if clock is None else {"clock": clock}
    return FairQueue(slots, per_client, max_queued, max_queued_per_client, **extra)


async def settle() -> None:
    """Let every ready task run."""
    for _ in range(5):
        await asyncio.sleep(0)


class Recorder:
    """Requests that take their turn from ``q``, record the order they got it in and run until
    ``finish_oldest``."""

    def __init__(self, q: FairQueue) -> None:
        self.q = q
        self.granted: list[str] = []
        self.releases: list = []
        self.tasks: list[asyncio.Task] = []

    def send(self, name: str, client: str, weight: int = 1) -> asyncio.Task:
        async def request() -> None:
            release = await self.q.admit(client, weight)
            self.granted.append(name)
            self.releases.append(release)

        self.tasks.append(asyncio.ensure_future(request()))
        return self.tasks[-1]

    async def finish_oldest(self) -> None:
        self.releases.pop(0)()
        await settle()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.mark.parametrize("slots", [1, 3], ids=["one-slot", "three-slots"])
def test_a_flood_from_one_client_does_not_delay_another_clients_request_past_one_turn(slots):
    async def run():
        r = Recorder(queue(slots=slots))
        for i in range(20):
            r.send(f"a{i}", "10.0.0.1")
        await settle()
        r.send("b0", "10.0.0.2")
        await settle()
        assert r.granted == [f"a{i}" for i in range(slots)]  # the slots are taken
        while len(r.granted) < 21:
            await r.finish_oldest()
        await r.close()
        return r.granted

    granted = asyncio.run(run())
    # b0 is granted the second free slot: one turn of the flood, then b0, then the flood's tail.
    assert granted.index("b0") == slots + 1, granted
    assert granted.index("b0") < granted.index("a19")


def test_turns_alternate_between_clients_with_requests_waiting():
    async def run():
        r = Recorder(queue(slots=1))
        r.send("hold", "10.0.0.9")
        for i in range(3):
            r.send(f"a{i}", "10.0.0.1")
            r.send(f"b{i}", "10.0.0.2")
        await settle()
        for name in ("c0", "c1"):
            r.send(name, "10.0.0.3")
        await settle()
        while len(r.granted) < 9:
            await r.finish_oldest()
        await r.close()
        return r.granted

    assert asyncio.run(run()) == ["hold", "a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2"]


def test_a_client_at_its_running_limit_waits_and_others_go_first():
    async def run():
        r = Recorder(queue(slots=None, per_client=2))
        for i in range(3):
            r.send(f"a{i}", "10.0.0.1")
        await settle()
        assert r.granted == ["a0", "a1"] and r.q.queued == 1
        r.send("b0", "10.0.0.2")  # another client, under its limit: no wait
        await settle()
        assert r.granted == ["a0", "a1", "b0"]
        await r.finish_oldest()  # a0 ends: a2 gets a0's place
        assert r.granted == ["a0", "a1", "b0", "a2"] and r.q.queued == 0
        await r.close()

    asyncio.run(run())


def test_a_request_of_several_samples_waits_for_its_slots_and_is_not_overtaken():
    async def run():
        r = Recorder(queue(slots=4))
        r.send("a0", "10.0.0.1", weight=2)
        r.send("a1", "10.0.0.1", weight=1)
        await settle()
        r.send("b-n3", "10.0.0.2", weight=3)  # 1 slot left: waits
        await settle()
        r.send("c0", "10.0.0.3", weight=1)  # would fit, but b is in turn before it
        await settle()
        assert r.granted == ["a0", "a1"] and r.q.queued == 2
        await r.finish_oldest()  # a0's two slots free: b's three fit
        assert r.granted == ["a0", "a1", "b-n3"]
        await r.finish_oldest()
        assert r.granted[-1] == "c0"
        big = r.send("d-n9", "10.0.0.4", weight=9)  # more than every slot: runs alone
        await r.finish_oldest()
        await r.finish_oldest()
        assert r.granted[-1] == "d-n9" and big.done()
        await r.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "max_queued, per_client_bound, expected",
    [
        pytest.param(3, 256, "the server's queue holds 3 requests", id="total-bound"),
        pytest.param(512, 2, "10.0.0.1 has 2 requests queued", id="per-client-bound"),
    ],
)
def test_past_the_bound_a_request_is_refused_with_429_and_retry_after(
    max_queued, per_client_bound, expected
):
    async def run():
        now = [0.0]
        q = queue(
            slots=1,
            max_queued=max_queued,
            max_queued_per_client=per_client_bound,
            clock=lambda: now[0],
        )
        r = Recorder(q)
        r.send("first", "10.0.0.1")
        await settle()
        now[0] += 4.0
        await r.finish_oldest()  # one request served in 4 s: the estimate's mean
        r.send("running", "10.0.0.9")
        queued = [r.send(f"q{i}", "10.0.0.1" if i < 2 else "10.0.0.2") for i in range(3)]
        await settle()
        if per_client_bound == 2:
            assert not any(t.done() for t in queued)  # 2 of 10.0.0.1 and 1 of 10.0.0.2 wait
        with pytest.raises(HTTPException) as refused:
            await q.admit("10.0.0.1")
        waiting = q.queued
        await r.close()
        return refused.value, waiting

    refused, waiting = asyncio.run(run())
    assert refused.status_code == 429 and expected in refused.detail
    # 3 queued + this one, one slot, 4 s a request: 4 rounds of 4 s.
    assert refused.headers == {"Retry-After": "16"}
    assert "retry after 16 s" in refused.detail
    assert waiting == 3  # the refused request did not stay queued


def test_retry_after_is_one_second_before_any_request_was_served():
    async def run():
        q = queue(slots=1, max_queued=1)
        r = Recorder(q)
        r.send("running", "10.0.0.1")
        r.send("queued", "10.0.0.1")
        await settle()
        with pytest.raises(HTTPException) as refused:
            await q.admit("10.0.0.2")
        await r.close()
        return refused.value

    assert asyncio.run(run()).headers == {"Retry-After": "1"}


def test_a_request_cancelled_while_queued_leaves_at_once_and_takes_no_slot():
    async def run():
        r = Recorder(queue(slots=1))
        r.send("running", "10.0.0.1")
        leaving = r.send("leaving", "10.0.0.2")
        r.send("next", "10.0.0.3")
        await settle()
        assert r.q.queued == 2 and r.q.queued_of("10.0.0.2") == 1
        leaving.cancel()  # its client disconnected
        await settle()
        left = (r.q.queued, r.q.queued_of("10.0.0.2"))
        await r.finish_oldest()
        granted, running = list(r.granted), r.q.running
        await r.close()
        return left, granted, running

    left, granted, running = asyncio.run(run())
    assert left == (1, 0)
    assert granted == ["running", "next"]  # the slot went to the next request, not the leaver
    assert running == 1  # "next" alone


def test_a_request_granted_as_it_is_cancelled_gives_its_slot_back():
    async def run():
        q = queue(slots=1)
        first = await q.admit("10.0.0.1")
        waiting = asyncio.ensure_future(q.admit("10.0.0.2"))
        await settle()
        first()  # grants the waiting request ...
        waiting.cancel()  # ... whose handler is cancelled before it resumes
        await asyncio.gather(waiting, return_exceptions=True)
        return q.running, q.queued

    assert asyncio.run(run()) == (0, 0)


def test_release_is_idempotent():
    async def run():
        q = queue(slots=2)
        release = await q.admit("10.0.0.1")
        release()
        release()
        return q.running

    assert asyncio.run(run()) == 0
