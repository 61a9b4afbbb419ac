"""``gather_all``: results in order, the first failure raised as itself with its own cause."""

from __future__ import annotations

import asyncio

import pytest

from megatron.rl.async_utils import gather_all


def test_results_come_back_in_argument_order():
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert asyncio.run(gather_all(value(1, 0.02), value(2, 0.0), value(3, 0.01))) == [1, 2, 3]


def test_first_failure_is_raised_with_its_cause_and_cancels_the_rest():
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def failing() -> None:
        await asyncio.sleep(0)
        try:
            raise KeyError("root cause")
        except KeyError as exc:
            raise RuntimeError("wrapped") from exc

    async def run() -> BaseException:
        with pytest.raises(RuntimeError, match="wrapped") as info:
            await gather_all(slow(), failing())
        assert cancelled.is_set()
        return info.value

    error = asyncio.run(run())
    assert isinstance(error.__cause__, KeyError)  # the root cause's traceback stays reachable
    assert error.__suppress_context__  # the TaskGroup's ExceptionGroup is not shown
