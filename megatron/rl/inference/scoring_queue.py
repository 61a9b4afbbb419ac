"""Scoring requests of the continuous-batching scheduler: sequences queued by ``score`` and
scored at the engine loop's next turn of an open window (``ScoreQueue``, a base of
``ContinuousBatchingScheduler``)."""

from __future__ import annotations

import asyncio

from megatron.rl.inference.protocol import (
    EngineError,
    InvalidInferenceRequest,
    ScoreOutput,
    ScoreWork,
)


class ScoreQueue:
    """The scheduler's sequences to score (its ``_scoring`` list of (work, future)); its
    methods run on the engine's event loop and use the scheduler's ``steps``, ``config``,
    ``_wakeup``, ``_task`` and ``_raise_if_failed``."""

    async def score(
        self, tokens: list[int], top_logprobs: int = 0, adapter: str | None = None
    ) -> ScoreOutput:
        """The logprob of each token of ``tokens`` after the first (a plain forward at the next
        loop turn of an open window, beside any step: it touches no slot, so no request's
        schedule or tokens change)."""
        self._raise_if_failed()
        if self._task is None:
            raise RuntimeError("the inference engine is not running: call start() first")
        if not 2 <= len(tokens) <= self.config.max_seq_len:
            raise InvalidInferenceRequest(
                f"a scored text of {len(tokens)} tokens: it needs at least 2 and at most the "
                f"engine's max_seq_len={self.config.max_seq_len}"
            )
        future = asyncio.get_running_loop().create_future()
        self._scoring.append((ScoreWork(tuple(tokens), top_logprobs, adapter), future))
        self._wakeup.set()
        return await future

    def _score_waiting(self) -> None:
        """Score every queued sequence whose caller still waits. A runner that cannot score
        (it raises before any collective) fails those callers only."""
        jobs = [(work, future) for work, future in self._scoring if not future.done()]
        self._scoring.clear()
        if not jobs:
            return
        try:
            outputs = self.steps.score([work for work, _ in jobs])
        except Exception as exc:  # noqa: BLE001 - every rank raises alike, before any collective
            for _, future in jobs:
                future.set_exception(InvalidInferenceRequest(f"cannot score: {exc}"))
            return
        for (_, future), output in zip(jobs, outputs):
            future.set_result(output)

    def _fail_scoring(self, message: str) -> None:
        """Fail every queued scoring request with an ``EngineError`` of its own."""
        futures = [future for _, future in self._scoring]
        self._scoring.clear()
        for future in futures:
            if not future.done():
                future.set_exception(EngineError(message))
