"""The trainer's inference server over a started scheduler, for the server tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import Tokenizer


@contextlib.asynccontextmanager
async def inference_app(
    steps: StepGroup,
    config: SchedulerConfig,
    tokenizer: Tokenizer,
    policy_version: Callable[[], int] = lambda: 0,
) -> AsyncIterator[tuple[FastAPI, ContinuousBatchingScheduler]]:
    """``create_inference_app`` over a started, resumed ``ContinuousBatchingScheduler`` that
    runs ``steps``; yields the app and the engine, closed on exit."""
    engine = ContinuousBatchingScheduler(steps, config, policy_version)
    engine.start()
    engine.resume()
    try:
        yield create_inference_app(LocalInferenceInterface(engine, tokenizer), tokenizer), engine
    finally:
        await engine.aclose()
