"""Streaming, top logprobs, echo scoring and stop strings of the inference server's OpenAI
endpoints, driven by the official ``openai`` client (and raw HTTP where the wire itself is
checked) over a real local port, on the real engine (scheduler + KV-cache runner) of a tiny
Hugging Face model. The reference numbers are a plain full forward of the same model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from grpo_testing.fakes import FakeSteps
from grpo_testing.hf_engine import load_hf_policy, running_engine, serve_on_port
from grpo_testing.hf_models import full_logits

from megatron.rl.http_client import ClientPool, RetryPolicy
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import ScoreRequest

MESSAGES = [{"role": "user", "content": "What is 12+7?"}]


async def serve(model, tokenizer, work, max_seq_len: int = 96):
    """``await work(base_url)`` against the inference server on a real local port."""
    return await serve_on_port(model, tokenizer, work, max_seq_len)


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def llama3(single_rank_world, tiny_hf_checkpoints):
    return load_hf_policy(tiny_hf_checkpoints["llama3"])


def forward_logprobs(model, tokenizer, ids: list[int]) -> torch.Tensor:
    """(T, V) log-softmax of a plain full forward over ``ids``."""
    logits = full_logits(model, torch.tensor([ids]), tokenizer.vocab_size)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_a_streamed_chat_is_the_answer_not_streamed_chunk_by_chunk(llama3):
    model, tokenizer = llama3
    common = dict(
        model="policy",
        messages=MESSAGES,
        max_completion_tokens=10,
        seed=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )

    async def work(url):
        async with client(url) as c:
            whole = await c.chat.completions.create(**common)
            chunks = [
                chunk
                async for chunk in await c.chat.completions.create(
                    **common, stream=True, stream_options={"include_usage": True}
                )
            ]
            return whole, chunks

    whole, chunks = asyncio.run(serve(model, tokenizer, work))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    *choice_chunks, usage = chunks
    assert usage.choices == [] and usage.usage == whole.usage
    for choice in whole.choices:
        mine = [c.choices[0] for c in choice_chunks if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"  # the role first
        assert [m.finish_reason for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == choice.finish_reason
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        tokens = [t for m in mine for t in m.model_extra["token_ids"]]
        assert tokens == choice.model_extra["token_ids"]
        versions = [v for m in mine for v in m.model_extra["policy_versions"]]
        assert versions == choice.model_extra["policy_versions"]
        assert mine[-1].model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
        # the same tokens; their logprobs as exact as a batch of another shape gives (fp32)
        streamed = [e for m in mine if m.logprobs for e in m.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in streamed] == pytest.approx(
            [e.logprob for e in choice.logprobs.content], abs=1e-5
        )
        assert all(len(e.top_logprobs) == 3 for e in streamed)


def test_a_streamed_completion_ends_with_done_and_joins_to_the_answer(llama3):
    model, tokenizer = llama3
    body = {"prompt": "12+7=", "max_tokens": 12, "seed": 3, "logprobs": 2, "n": 2}

    async def work(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            whole = (await http.post("/v1/completions", json=body)).json()
            events = []
            async with http.stream(
                "POST", "/v1/completions", json={**body, "stream": True}
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
            return whole, events

    whole, events = asyncio.run(serve(model, tokenizer, work))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [t for m in mine for t in m["token_ids"]] == choice["token_ids"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        logprobs = [lp for m in mine for lp in m["logprobs"]["token_logprobs"]]
        assert logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        tops = [t for m in mine for t in m["logprobs"]["top_logprobs"]]
        assert [sorted(t) for t in tops] == [sorted(t) for t in choice["logprobs"]["top_logprobs"]]


def test_top_logprobs_are_the_most_likely_tokens_of_a_full_forward(llama3):
    model, tokenizer = llama3

    async def work(url):
        async with client(url) as c:
            return await c.chat.completions.create(
                model="policy",
                messages=MESSAGES,
                max_completion_tokens=6,
                seed=1,
                logprobs=True,
                top_logprobs=20,
            )

    choice = asyncio.run(serve(model, tokenizer, work)).choices[0]
    prompt, tokens = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    logp = forward_logprobs(model, tokenizer, prompt + tokens)
    for i, entry in enumerate(choice.logprobs.content):
        row = logp[len(prompt) - 1 + i]  # (V,)
        values, ids = torch.topk(row, 20)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([j]) for j in ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        # the sampled token, from the same distribution: among them with its own logprob, or
        # less likely than all of them (several ids may decode to one text)
        listed = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        assert entry.logprob in listed or entry.logprob < values[-1].item()


def test_echo_with_max_tokens_0_scores_the_prompt_like_a_full_forward(llama3):
    model, tokenizer = llama3
    prompt = tokenizer.encode("The answer to 12+7 is 19")

    async def work(url):
        async with client(url) as c:
            scored = await c.completions.create(
                model="policy", prompt=prompt, max_tokens=0, echo=True, logprobs=5
            )
            generated = await c.completions.create(
                model="policy", prompt=[prompt], max_tokens=1, echo=True, logprobs=1, temperature=0
            )
            return scored, generated

    scored, generated = asyncio.run(serve(model, tokenizer, work))
    logp = forward_logprobs(model, tokenizer, prompt)
    expected = [logp[i - 1, t].item() for i, t in enumerate(prompt) if i]
    (choice,) = scored.choices
    assert choice.text == tokenizer.decode(prompt) and choice.model_extra["token_ids"] == []
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for i, top in enumerate(choice.logprobs.top_logprobs[1:], start=1):
        best = torch.topk(logp[i - 1], 5)
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=1e-4)
        assert tokenizer.decode([int(best.indices[0])]) in top
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt)
    # what lm-evaluation-harness asks: the prompt scored, one greedy token after it
    (greedy,) = generated.choices
    assert greedy.logprobs.token_logprobs[: len(prompt)] == choice.logprobs.token_logprobs
    assert len(greedy.logprobs.token_logprobs) == len(prompt) + 1
    assert greedy.text.startswith(choice.text)
    last = greedy.logprobs
    assert last.token_logprobs[-1] == max(last.top_logprobs[-1].values())  # greedy


def test_stop_strings_end_the_text_before_them_streamed_or_not():
    tokenizer = CharTokenizer()

    async def work(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"prompt": "12=", "max_tokens": 12, "seed": 4, "ignore_eos": True}
            free = (await http.post("/v1/completions", json=body)).json()["choices"][0]
            stop = free["text"][3:5]
            stopped = (await http.post("/v1/completions", json={**body, "stop": stop})).json()
            streamed = []
            async with http.stream(
                "POST", "/v1/completions", json={**body, "stop": [stop], "stream": True}
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[6:])["choices"][0])
            return free, stop, stopped["choices"][0], streamed

    async def run():
        config = SchedulerConfig(max_requests=2, max_seq_len=32)
        engine = ContinuousBatchingScheduler(FakeSteps(), config, lambda: 0)
        engine.start()
        engine.resume()
        try:
            app = create_inference_app(LocalInferenceInterface(engine, tokenizer), tokenizer)
            server = await EmbeddedServer.start(app, "127.0.0.1", 0)
            try:
                return await work(server.url)
            finally:
                await server.stop()
        finally:
            await engine.aclose()

    free, stop, stopped, streamed = asyncio.run(run())
    cut = free["text"].index(stop)
    assert stopped["text"] == free["text"][:cut] and stopped["finish_reason"] == "stop"
    # the tokens end with the one that completed the stop string
    assert stopped["token_ids"] == free["token_ids"][: len(stopped["token_ids"])]
    assert tokenizer.decode(stopped["token_ids"]).endswith(stop)
    assert "".join(c["text"] for c in streamed) == stopped["text"]
    assert [t for c in streamed for t in c["token_ids"]] == stopped["token_ids"]


class SlowSteps(FakeSteps):
    """Fake steps that take 5 ms each, so a long generation is still running when tested."""

    def step(self, plan):
        time.sleep(0.005)
        return super().step(plan)


def test_a_client_that_leaves_a_stream_frees_its_generation():
    tokenizer = CharTokenizer()
    budget = 4000

    async def run():
        config = SchedulerConfig(max_requests=2, max_seq_len=budget + 8)
        engine = ContinuousBatchingScheduler(SlowSteps(), config, lambda: 0)
        engine.start()
        engine.resume()
        app = create_inference_app(LocalInferenceInterface(engine, tokenizer), tokenizer)
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        try:
            body = {"prompt": "1=", "max_tokens": budget, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass
            left_at = engine.counters.generated_tokens
            for _ in range(200):  # the slot is freed at the engine's next step
                if not engine.holds_requests():
                    break
                await asyncio.sleep(0.01)
            return left_at, engine.holds_requests(), engine.counters.generated_tokens
        finally:
            await server.stop()
            await engine.aclose()

    left_at, holds, generated = asyncio.run(run())
    assert not holds
    assert generated < min(budget, left_at + 100)


def test_a_model_not_served_is_a_404_on_completions_too():
    tokenizer = CharTokenizer()

    async def run():
        engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(2, 32), lambda: 0)
        engine.start()
        engine.resume()
        app = create_inference_app(
            LocalInferenceInterface(engine, tokenizer), tokenizer, model_name="tiny-digits"
        )
        try:
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                body = {"prompt": "1=", "max_tokens": 2}
                known = await http.post("/v1/completions", json={**body, "model": "tiny-digits"})
                unknown = await http.post("/v1/completions", json={**body, "model": "gpt-4o"})
                listed = await http.get("/v1/models")
                return known, unknown, listed
        finally:
            await engine.aclose()

    known, unknown, listed = asyncio.run(run())
    assert known.status_code == 200 and known.json()["model"] == "tiny-digits"
    assert unknown.status_code == 404
    assert unknown.json()["detail"] == (
        "field 'model': the model 'gpt-4o' is not served here ('tiny-digits')"
    )
    assert [m["id"] for m in listed.json()["data"]] == ["tiny-digits"]


def test_a_remote_interface_scores_through_the_server_as_in_process(llama3):
    model, tokenizer = llama3
    prompt = tokenizer.encode("Paris is the capital of France")

    async def run():
        async with running_engine(model, tokenizer.vocab_size, tokenizer.eos_id, 4, 64) as e:
            local = LocalInferenceInterface(e, tokenizer)
            transport = httpx.ASGITransport(create_inference_app(local, tokenizer))
            pool = ClientPool(2, httpx.Timeout(30.0), transport)
            remote = RemoteInferenceInterface("http://t", pool, RetryPolicy(0))
            try:
                here = await local.score(ScoreRequest(prompt_tokens=prompt))
                there = await remote.score(ScoreRequest(prompt_tokens=prompt))
                with pytest.raises(InvalidInferenceRequest, match="top_logprobs"):
                    await remote.score(ScoreRequest(prompt_tokens=prompt, top_logprobs=2))
                return here, there
            finally:
                await pool.aclose()

    here, there = asyncio.run(run())
    assert there.prompt_tokens == here.prompt_tokens == prompt
    assert there.logprobs == here.logprobs and len(here.logprobs) == len(prompt) - 1


def test_echo_of_a_text_prompt_scores_the_tokens_it_generated_after(llama3):
    model, tokenizer = llama3
    text = "The answer to 12+7 is"

    async def work(url):
        async with client(url) as c:
            by_text = await c.completions.create(
                model="policy", prompt=text, max_tokens=2, echo=True, logprobs=1, temperature=0
            )
            ids = by_text.choices[0].model_extra["prompt_token_ids"]
            by_ids = await c.completions.create(
                model="policy", prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0
            )
            return by_text.choices[0], by_ids.choices[0]

    by_text, by_ids = asyncio.run(serve(model, tokenizer, work))
    assert by_text.text.startswith(text)
    assert by_text.logprobs.token_logprobs == by_ids.logprobs.token_logprobs
    assert len(by_text.logprobs.token_logprobs) == len(by_text.model_extra["prompt_token_ids"]) + 2
