"""``RemoteInferenceInterface``: chat messages go to the trainer's ``/v1/chat/completions`` and
come back exactly as the in-process interface answers them (the recorded expert routes
included)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.http_client import ClientPool, RetryPolicy
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, RolloutKey, SamplingParams

MESSAGES = [{"role": "user", "content": "What is 12+7?"}]


class RecordingTransport(httpx.AsyncBaseTransport):
    """The ASGI app of the inference server, recording each request's path."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app)
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)


def group(tokenizer, request: InferenceRequest, n: int, remote: bool):
    """``n`` samples of ``request`` in process or through the inference server (fake steps)."""

    async def run():
        engine = ContinuousBatchingScheduler(
            FakeSteps(routes=True), SchedulerConfig(max_requests=4, max_seq_len=64), lambda: 2
        )
        engine.start()
        engine.resume()
        local = LocalInferenceInterface(engine, tokenizer)
        transport = RecordingTransport(create_inference_app(local, tokenizer))
        pool = ClientPool(4, httpx.Timeout(10.0), transport)
        interface = RemoteInferenceInterface("http://trainer", pool, RetryPolicy(max_retries=0))
        try:
            out = await (interface if remote else local).generate_group(request, n)
            return out, transport.paths
        finally:
            await pool.aclose()
            await engine.aclose()

    return asyncio.run(run())


def chat_request() -> InferenceRequest:
    return InferenceRequest(
        messages=MESSAGES,
        sampling=SamplingParams(max_tokens=4, temperature=0.5),
        seed=8,
        rollout_key=RolloutKey(batch_id=0, index_in_batch=1, sample_index=0),
    )


def test_messages_are_sent_as_one_chat_completion_and_equal_the_local_answer(tiny_hf_checkpoints):
    tokenizer = HuggingFaceTokenizer(tiny_hf_checkpoints["llama3"])
    remote, paths = group(tokenizer, chat_request(), 3, remote=True)
    local, _ = group(tokenizer, chat_request(), 3, remote=False)
    assert paths == ["/v1/chat/completions"]
    assert remote == local  # the recorded routes included
    assert all(out.routed_experts for out in remote)
    assert remote[0].prompt_text == tokenizer.apply_chat_template(MESSAGES)


def test_text_prompts_still_use_completions(tiny_hf_checkpoints):
    tokenizer = HuggingFaceTokenizer(tiny_hf_checkpoints["llama3"])
    request = InferenceRequest(prompt="12+7=", sampling=SamplingParams(max_tokens=3))
    remote, paths = group(tokenizer, request, 2, remote=True)
    assert paths == ["/v1/completions"]
    assert remote == group(tokenizer, request, 2, remote=False)[0]
    assert all(out.routed_experts for out in remote)


def test_no_chat_template_on_the_trainer_is_an_invalid_request_naming_it():
    with pytest.raises(InvalidInferenceRequest, match=r"\(CharTokenizer\) has no chat template"):
        group(CharTokenizer(), chat_request(), 2, remote=True)
