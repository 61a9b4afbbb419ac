"""The window of the awaited batch and its reward-wait budget (``--rl-reward-wait-steps K``).

What it decides, for the scheduler (``scheduler.py``), while the trainer waits for batch ``b``
(``await_batch(b)``):

* whether keyed requests may take the coming engine step (``keyed_work_allowed``): while ``b``
  still has an announced, waiting or active keyed request, and then for the budget; otherwise
  only unkeyed requests step. Without a window target (``window_target=False``, a throughput
  mode) or with ``b=None`` (a drain before a checkpoint) keyed requests always step;
* whether that step is one of the budget's K (``counts_next_step``): once ``b`` has finished
  generating, keyed requests of later batches step for exactly K more engine steps, or fewer if,
  past the barrier, no keyed request is left to step. A step counts only if it carries keyed rows,
  so unkeyed traffic spends none of it;
* when the window has taken all its steps (``wait_spent``): ``window_spent(b)``, which the
  rollout generator awaits before handing ``b`` to the trainer, returns only then, so the
  trainer's weight update comes after it.

Why: determinism of token versions. Stepping later batches while ``b``'s rewards are computed
fills that wait with generation, but if they stepped until the trainer came back, how many steps
fit before its weight update (and so which policy version generates which token) would depend on
how long the rewards take; that is why, without a budget, keyed work stops as soon as ``b`` has
finished generating. With the budget, every step of the window is still a function of the
schedule alone: the steps while ``b`` generates, then K steps counted by the engine itself, or up
to the point where the keyed work, which past the barrier is the same whatever the timing, runs
out. Slow rewards make the trainer wait longer after the budget, never step more; fast rewards
make it wait for the budget, never step less.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class WindowBudget:
    """The window target of the awaited batch and its reward-wait budget (one per scheduler).

    Owned by the scheduler's loop: ``await_batch`` opens a window (and wakes whoever waited for
    the previous one), the loop asks ``keyed_work_allowed`` and ``counts_next_step`` before each
    step and reports a counted step with ``count_step``, and ``wait_spent`` is what
    ``window_spent`` awaits. ``unfinished(batch)`` passed in by the scheduler says whether the
    batch still has an announced, waiting or active keyed request.
    """

    def __init__(self, reward_wait_steps: int, window_target: bool = True) -> None:
        if reward_wait_steps < 0:
            raise ValueError(f"reward_wait_steps must be >= 0, got {reward_wait_steps}")
        self.reward_wait_steps = reward_wait_steps
        self.window_target = window_target
        self.awaited_batch: int | None = None
        """The batch the trainer waits for (None: no window target, keyed work always steps)."""
        self._left = 0  # budget steps the awaited batch's window still owes
        self._spent = asyncio.Event()  # set when the budget of the awaited batch runs out

    @property
    def enabled(self) -> bool:
        """Whether ``window_spent`` waits at all: a budget under the deterministic window target."""
        return self.window_target and self.reward_wait_steps > 0

    @property
    def spent(self) -> bool:
        """The awaited batch's window has taken every step it is given (or the engine failed)."""
        return self._spent.is_set()

    def await_batch(self, batch_id: int | None) -> None:
        """The trainer now waits for ``batch_id``; a new batch opens a window with a full budget
        and wakes every ``wait_spent`` of the previous one."""
        if batch_id != self.awaited_batch:
            self._spent.set()
            self._spent = asyncio.Event()
            self._left = self.reward_wait_steps
        self.awaited_batch = batch_id

    def state(self) -> tuple[int | None, int, bool]:
        """(awaited batch, budget steps left, spent): what a checkpoint saves."""
        return self.awaited_batch, self._left, self._spent.is_set()

    def restore(self, awaited_batch: int | None, left: int, spent: bool) -> None:
        """Continue a saved ``state``."""
        self.awaited_batch, self._left = awaited_batch, left
        self._spent = asyncio.Event()
        if spent:
            self._spent.set()

    def keyed_work_allowed(self, unfinished: Callable[[int], bool]) -> bool:
        """Whether keyed requests may take the coming step: no window target, the awaited batch
        still generates, or its budget has steps left."""
        b = self.awaited_batch
        if b is None or not self.window_target:
            return True
        return unfinished(b) or (self._left > 0 and not self._spent.is_set())

    def counts_next_step(
        self, unfinished: Callable[[int], bool], keyed_queued: Callable[[], bool]
    ) -> bool:
        """Whether the coming step, if it carries keyed rows, spends one step of the budget.

        True only once the awaited batch has finished generating and steps are left. With no
        budget, or with no keyed request queued (``keyed_queued``: the window has nothing more to
        give), the budget is spent here instead.
        """
        b = self.awaited_batch
        if b is None or not self.window_target or self._spent.is_set():
            return False
        if unfinished(b):
            return False
        if self._left == 0:  # no budget: spent as soon as the batch is finished
            self.spend()
            return False
        if not keyed_queued():
            self.spend()
            return False
        return True

    def count_step(self) -> None:
        """A counted step carried keyed rows: one budget step fewer."""
        self._left -= 1
        if self._left == 0:
            self.spend()

    def spend(self) -> None:
        """End the awaited batch's budget; ``wait_spent`` returns."""
        self._left = 0
        self._spent.set()

    def wake_waiters(self) -> None:
        """Let every ``wait_spent`` return (the engine failed; they re-check the error)."""
        self._spent.set()

    async def wait_spent(self, batch_id: int, failed: Callable[[], bool]) -> None:
        """Return once the window of ``batch_id`` is spent, the trainer no longer awaits
        ``batch_id``, or ``failed()`` is true."""
        while self.awaited_batch == batch_id and not self._spent.is_set():
            if failed():
                break
            await self._spent.wait()
