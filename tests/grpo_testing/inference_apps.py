"""The trainer's inference server over a started scheduler, for the server tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from megatron.rl.inference.interface import (
    InferenceInterface,
    LocalInferenceInterface,
    render_chat,
)
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse


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


class ScriptedChatInference(InferenceInterface):
    """Renders each chat request with the tokenizer's template and answers the next scripted
    text (tokenized by the tokenizer, the stop token appended); keeps every request and its
    rendered prompt."""

    def __init__(self, tokenizer: Tokenizer, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.requests: list[InferenceRequest] = []
        self.prompts: list[str] = []

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        prompt_text, prompt = render_chat(self.tokenizer, request.messages, request.tools)
        self.prompts.append(prompt_text)
        tokens = self.tokenizer.encode_continuation(self.texts.pop(0)) + [self.tokenizer.eos_id]
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=tokens,
            text=self.tokenizer.decode(tokens),
            logprobs=[-1.0] * len(tokens),
            policy_versions=[0] * len(tokens),
            finish_reason="stop",
            prompt_text=prompt_text,
        )
