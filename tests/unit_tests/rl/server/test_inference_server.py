"""The trainer's inference server (OpenAI completions subset) over the real engine (scheduler + KV-cache runner)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from grpo_testing.fakes import FakeSteps, SeededInference
from grpo_testing.inference_apps import inference_app

from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.seeding import derive_seed
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import CompletionResponse, ModelList


def post_completions(bodies: list, steps: FakeSteps | None = None, fail: bool = False):
    """POST each body to /v1/completions of an app over a running engine."""
    steps = steps or FakeSteps()
    tokenizer = CharTokenizer()

    async def run():
        config = SchedulerConfig(max_requests=4, max_seq_len=24)
        async with inference_app(steps, config, tokenizer, lambda: 7) as (app, _):
            if fail:
                steps.fail_on_step = 0
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://trainer"
            ) as client:
                return [await client.post("/v1/completions", json=b) for b in bodies]

    return asyncio.run(run())


def test_text_prompt_completion_with_logprobs_and_extensions():
    (r,) = post_completions([{"prompt": "12=", "max_tokens": 3, "seed": 4, "logprobs": 1}])
    assert r.status_code == 200
    body = CompletionResponse.model_validate(r.json())
    choice = body.choices[0]
    tokenizer = CharTokenizer()
    assert choice.prompt_token_ids == tokenizer.encode("12=")
    # FakeSteps samples 2 + (seed + position) % 7 at positions 3, 4, 5
    assert choice.token_ids == [2 + (4 + p) % 7 for p in (3, 4, 5)]
    assert choice.text == tokenizer.decode(choice.token_ids)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in choice.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx([-0.3, -0.4, -0.5])
    assert choice.policy_versions == [7, 7, 7]
    assert choice.finish_reason == "length"
    assert body.usage.total_tokens == 6
    assert body.to_inference_responses()[0].tokens == choice.token_ids


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["stops-at-eos", "ignore-eos"])
def test_ignore_eos_extension_generates_the_whole_budget(ignore_eos):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "seed": 4, "ignore_eos": ignore_eos}
    (r,) = post_completions([body], FakeSteps(eos_at={4: 4}))  # EOS sampled at position 4
    choice = CompletionResponse.model_validate(r.json()).choices[0]
    eos = CharTokenizer().eos_id
    tokens = [2 + (4 + 3) % 7, eos, 2 + (4 + 5) % 7, 2 + (4 + 6) % 7]  # positions 3 to 6
    want = tokens if ignore_eos else tokens[:2]
    assert (choice.token_ids, choice.finish_reason) == (want, "length" if ignore_eos else "stop")


def test_n_samples_are_seeded_and_keyed_like_separate_requests():
    steps = FakeSteps()
    key = {"batch_id": 1, "index_in_batch": 2, "sample_index": 0}
    (r,) = post_completions(
        [{"prompt": "12=", "max_tokens": 2, "seed": 4, "n": 3, "rollout_key": key}], steps
    )
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    seeds = [derive_seed(4, i) for i in range(3)]
    assert [c["token_ids"] for c in choices] == [[2 + (s + p) % 7 for p in (3, 4)] for s in seeds]
    assert r.json()["usage"]["completion_tokens"] == 6


def test_token_prompt_and_logprobs_only_when_asked():
    (r,) = post_completions([{"prompt": [2, 3, 4], "max_tokens": 2}])
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [2, 3, 4] and choice["logprobs"] is None


def test_rollout_key_and_seed_reach_the_inference_interface():
    inference = SeededInference()
    app = create_inference_app(inference, inference.tokenizer)
    key = {"batch_id": 4, "index_in_batch": 1, "sample_index": 2}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.post(
                "/v1/completions", json={"prompt": "1=", "seed": 9, "rollout_key": key}
            )

    assert asyncio.run(run()).status_code == 200
    (request,) = inference.requests
    assert request.rollout_key.model_dump() == key and request.seed == 9


@pytest.mark.parametrize(
    "body, status, needle",
    [
        pytest.param(
            {"prompt": "12=", "best_of": 2}, 422, "field 'best_of'", id="unsupported-field"
        ),
        pytest.param({"prompt": "12=", "stop": [""]}, 422, "field 'stop", id="empty-stop-string"),
        pytest.param({"prompt": "12=", "max_tokens": 0}, 422, "'echo'", id="nothing-to-generate"),
        pytest.param({"prompt": "12=", "n": 0}, 422, "field 'n'", id="n-zero"),
        pytest.param(
            {"prompt": "12=", "stream": True, "echo": True}, 422, "'echo'", id="echo-stream"
        ),
        pytest.param({"prompt": "12=", "logprobs": 21}, 422, "field 'logprobs'", id="logprobs-21"),
        pytest.param(
            {
                "prompt": [2],
                "stream": True,
                "rollout_key": {"batch_id": 0, "index_in_batch": 0, "sample_index": 0},
            },
            422,
            "'stream' with 'rollout_key'",
            id="streamed-rollout",
        ),
        pytest.param({"prompt": "hello"}, 422, "prompt", id="character-outside-alphabet"),
        pytest.param({"prompt": [2, 999]}, 422, "outside the vocabulary", id="token-out-of-vocab"),
        pytest.param({"prompt": "1" * 20, "max_tokens": 10}, 422, "max_seq_len", id="too-long"),
        pytest.param({"prompt": ""}, 422, "prompt", id="empty-prompt"),
        pytest.param(
            {"max_tokens": 3}, 422, "exactly one of 'prompt' and 'messages'", id="missing-prompt"
        ),
        pytest.param({"prompt": "1=", "top_p": 0}, 422, "field 'top_p'", id="top-p-zero"),
        pytest.param(
            {"prompt": "1=", "prompt_suffix": "+"}, 422, "token ids", id="suffix-after-text"
        ),
        pytest.param({"prompt": [2], "prompt_suffix": "a"}, 422, "prompt_suffix", id="bad-suffix"),
    ],
)
def test_bad_requests_are_rejected_naming_the_problem(body, status, needle):
    (r,) = post_completions([body])
    assert r.status_code == status
    assert needle in r.json()["detail"]


def test_engine_failure_is_503():
    (r,) = post_completions([{"prompt": "1=", "max_tokens": 2}], fail=True)
    assert r.status_code == 503
    assert "inference engine" in r.json()["detail"]


def test_ending_a_rollout_the_engine_does_not_wait_for_is_harmless():
    tokenizer = CharTokenizer()

    async def run():
        engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(), lambda: 0)
        app = create_inference_app(LocalInferenceInterface(engine, tokenizer), tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            key = {"batch_id": 1, "index_in_batch": 0, "sample_index": 0}
            ok = await c.post("/v1/rollouts/end", json={"rollout_key": key})
            bad = await c.post("/v1/rollouts/end", json={"rollout_key": {"batch_id": -1}})
            return ok, bad

    ok, bad = asyncio.run(run())
    assert ok.status_code == 200 and ok.json() == {"awaited": False}
    assert bad.status_code == 422 and "rollout_key.batch_id" in bad.json()["detail"]


def test_models_lists_the_served_model_in_openais_format():
    import openai.types

    tokenizer = CharTokenizer()

    async def run():
        engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(), lambda: 0)
        inference = LocalInferenceInterface(engine, tokenizer)
        app = create_inference_app(inference, tokenizer, model_name="ckpt-7")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.get("/v1/models")

    before = int(time.time())
    r = asyncio.run(run())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = openai.types.Model.model_validate(body["data"][0])
    assert (card.id, card.object, card.owned_by) == ("ckpt-7", "model", "megatron-rl")
    assert before <= card.created <= int(time.time())
    assert ModelList.model_validate(body).data[0].id == "ckpt-7"
