"""Small structured-concurrency helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """Await all of ``awaitables`` concurrently; on the first failure cancel the rest and raise it.

    Unlike ``asyncio.gather`` no task outlives a failure, and unlike ``TaskGroup`` the first
    exception is raised as itself (with its own traceback), not wrapped in an ExceptionGroup.
    """
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_as_coroutine(a)) for a in awaitables]
    except BaseExceptionGroup as eg:
        first = eg.exceptions[0]
        raise first from first.__cause__  # keeps its own cause; drops the group as context
    return [t.result() for t in tasks]


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
