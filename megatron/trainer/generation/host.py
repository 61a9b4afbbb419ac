"""Generation windows: the one place where the synchronous trainer lets the inference engine step.

A ``GenerationHost`` owns, on global rank 0, an asyncio event loop and an inference engine (the
tier's scheduler over this rank's step group); every rank owns its step group. The loop runs only
inside ``window(work)``: the engine is resumed, the loop runs until ``work()`` completes (while
the engine steps the requests that ``work`` causes), the engine is suspended, and the other ranks,
which sit in ``StepGroup.follow()`` executing each engine step on their shard of the model, are
released. So generation advances only while the trainer waits, and the weights never change
during an engine step.

Training rollouts (``rollouts.RolloutSource``) and evaluation (``evaluation.Evaluator``) each own
one host (evaluation has its own engine and KV cache, so it never disturbs the training engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.refit.layout import InferenceLayout
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.base import Tier

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GenerationHost:
    """An engine and its step group, stepped only inside generation windows.

    The event loop's tasks: the engine's loop task (consumes queued requests, produces tokens,
    waits while suspended) and whatever tasks the owner starts in it. The owner is the only one
    that runs the loop (``run``/``window``) and shuts it down (``close``).
    """

    def __init__(
        self,
        ctx: ParallelContext,
        tier: Tier,
        model: torch.nn.Module,
        config: SchedulerConfig,
        vocab_size: int,
        policy_version: Callable[[], int],
        layout: InferenceLayout | None = None,
    ) -> None:
        self.ctx = ctx
        self.model = model
        """What the engine generates with: the trained model, or an inference copy laid out for
        ``layout``."""
        self.steps = tier.build_step_group(model, config, vocab_size, layout)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._window: asyncio.Task | None = None
        if ctx.is_main:
            self.loop = asyncio.new_event_loop()
            self.engine = tier.build_engine(self.steps, config, policy_version)
            self.run(self._start_engine)

    async def _start_engine(self) -> None:
        self.engine.start()

    def run(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work()`` in the loop outside a window (the engine does not step; rank 0)."""
        return self.loop.run_until_complete(work())

    def window(self, work: Callable[[], Awaitable[T]] | None) -> T | None:
        """Step the engine until ``work()`` is done (rank 0); other ranks pass ``None`` and
        execute the steps (collective).

        The model is in eval mode for the window (the train step puts it back in training mode).
        A failure on rank 0 makes the followers raise too; a ``cancel`` raises ``CancelledError``.
        """
        self.model.eval()
        if work is None:
            self.steps.follow()
            return None
        try:
            self.engine.resume()
            self._window = self.loop.create_task(work())
            try:
                result = self.loop.run_until_complete(self._window)
            finally:
                self.engine.suspend()
        except BaseException as exc:
            self.steps.abort_followers(f"{type(exc).__name__}: {exc}")
            raise
        self.steps.stop_followers(idle=not self.engine.holds_requests())
        return result

    def cancel(self) -> None:
        """Cancel the window in progress, if any (safe to call from a signal handler)."""
        if self._window is not None and not self._window.done():
            self.loop.call_soon_threadsafe(self._window.cancel)

    def close(self, shutdown: Callable[[], Awaitable[None]], timeout_s: float = 30.0) -> None:
        """Run the owner's ``shutdown()`` (which closes the engine, in the owner's order) and
        close the loop; idempotent.

        Whatever is still running after ``timeout_s`` is logged and cancelled: closing never
        hangs.
        """
        if self.loop is None or self.loop.is_closed():
            return
        try:
            self.loop.run_until_complete(self._aclose(shutdown, timeout_s))
        finally:
            self.loop.close()

    async def _aclose(self, shutdown: Callable[[], Awaitable[None]], timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await shutdown()
        except TimeoutError:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                logger.warning("generation host: task still running at shutdown: %r", task)
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
