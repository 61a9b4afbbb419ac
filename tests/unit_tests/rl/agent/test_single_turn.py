"""``SingleTurnEnvironment.group_rollout`` over a fake inference whose output depends on the seed.

The fake "generates" the decimal digits of ``seed % 1000`` then EOS, with logprobs and policy
versions that are also functions of the seed, so every rollout can be predicted from its
sample seed ``derive_seed(derive_seed(seed, batch_id, index_in_batch), k)``.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from grpo_testing.fakes import fake_route

from megatron.rl.agent.api import Problem, SingleTurnEnvironment
from megatron.rl.environments.digits import positional_match_reward
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import (
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)

TOK = CharTokenizer()
RUN_SEED, BATCH, INDEX, K = 1234, 5, 2, 4


def fake_text(seed: int) -> str:
    return str(seed % 1000)


def fake_response(prompt: str, seed: int, routes: bool = False) -> InferenceResponse:
    tokens = TOK.encode(fake_text(seed)) + [TOK.eos_id]
    fed = len(TOK.encode(prompt)) + len(tokens) - 1
    return InferenceResponse(
        routed_experts=[fake_route(seed, p) for p in range(fed)] if routes else None,
        prompt_tokens=TOK.encode(prompt),
        tokens=tokens,
        text=TOK.decode(tokens),
        logprobs=[-(((seed >> (3 * i)) % 7) + 1) / 10 for i in range(len(tokens))],
        policy_versions=[seed % 3 + i for i in range(len(tokens))],
        finish_reason="stop",
    )


class FakeInference(InferenceInterface):
    """Records requests; answers from the seed, finishing in an order unrelated to submission."""

    def __init__(
        self, raise_for: dict[int, BaseException] | None = None, routes: bool = False
    ) -> None:
        self.requests: list[InferenceRequest] = []
        self.raise_for = raise_for or {}
        self.routes = routes

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        for _ in range(request.seed % 5):  # finish out of order
            await asyncio.sleep(0)
        error = self.raise_for.get(request.rollout_key.sample_index)
        if error is not None:
            raise error
        return fake_response(request.prompt, request.seed, self.routes)


class EchoEnvironment(SingleTurnEnvironment):
    """Prompt "<n>=", answer "<n>"; the reward can be made to fail for chosen completions."""

    def __init__(
        self,
        max_tokens: int | None = 6,
        failing_completions: frozenset[str] = frozenset(),
        reward_override: dict[str, float] | None = None,
        fail_problem: bool = False,
    ) -> None:
        super().__init__("echo")
        self.max_tokens = max_tokens
        self.failing_completions = failing_completions
        self.reward_override = reward_override or {}
        self.fail_problem = fail_problem

    def make_problem(self, rng: random.Random) -> Problem:
        if self.fail_problem:
            raise RuntimeError("no problems today")
        n = str(rng.randrange(1000))
        return Problem(problem_id=f"echo:{n}", prompt=f"{n}=", answer=n, max_tokens=self.max_tokens)

    def reward(self, problem: Problem, completion: str) -> float:
        if completion in self.failing_completions:
            raise KeyError(f"cannot score {completion}")
        if completion in self.reward_override:
            return self.reward_override[completion]
        return positional_match_reward(problem.answer, completion)


def group_request(**overrides) -> GroupedRolloutRequest:
    fields = dict(
        batch_id=BATCH,
        index_in_batch=INDEX,
        groups_in_batch=4,
        group_size=K,
        seed=RUN_SEED,
        submission_policy_version=7,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=16),
    )
    fields.update(overrides)
    return GroupedRolloutRequest(**fields)


def run(env, inference, request=None):
    return asyncio.run(env.group_rollout(request or group_request(), inference))


def sample_seeds(k: int = K) -> list[int]:
    return [derive_seed(derive_seed(RUN_SEED, BATCH, INDEX), i) for i in range(k)]


def expected_problem(env: EchoEnvironment) -> Problem:
    return env.make_problem(random.Random(derive_seed(RUN_SEED, BATCH, INDEX)))


def test_group_rollouts_carry_tokens_masks_logprobs_and_rewards():
    env = EchoEnvironment()
    group = run(env, FakeInference())
    problem = expected_problem(env)
    assert (group.batch_id, group.index_in_batch) == (BATCH, INDEX)
    assert len(group.rollouts) == K
    prompt_tokens = TOK.encode(problem.prompt)
    for rollout, seed in zip(group.rollouts, sample_seeds()):
        response = fake_response(problem.prompt, seed)
        assert not rollout.is_placeholder
        assert rollout.env_id == "echo"
        assert rollout.problem_id == problem.problem_id
        assert rollout.prompt == problem.prompt
        assert rollout.completion == fake_text(seed)
        assert rollout.tokens == prompt_tokens + response.tokens
        assert rollout.generation_mask == [False] * len(prompt_tokens) + [True] * len(
            response.tokens
        )
        assert rollout.logprobs == response.logprobs
        assert rollout.policy_versions == response.policy_versions
        assert rollout.reward == positional_match_reward(problem.answer, fake_text(seed))
        assert rollout.submission_policy_version == 7
        assert rollout.temperature == 0.7


@pytest.mark.parametrize(
    "routes", [pytest.param(True, id="recorded"), pytest.param(False, id="not_recorded")]
)
def test_rollouts_carry_the_routes_of_their_response(routes):
    env = EchoEnvironment()
    group = run(env, FakeInference(routes=routes))
    problem = expected_problem(env)
    for rollout, seed in zip(group.rollouts, sample_seeds()):
        want = fake_response(problem.prompt, seed, routes).routed_experts
        assert rollout.routed_experts == want
        assert want is None or len(want) == len(rollout.tokens) - 1


def test_each_request_has_rollout_key_and_derived_seed():
    inference = FakeInference()
    run(EchoEnvironment(max_tokens=6), inference)
    by_sample = sorted(inference.requests, key=lambda r: r.rollout_key.sample_index)
    assert [r.rollout_key for r in by_sample] == [
        RolloutKey(batch_id=BATCH, index_in_batch=INDEX, sample_index=k) for k in range(K)
    ]
    assert [r.seed for r in by_sample] == sample_seeds()
    assert len(set(sample_seeds())) == K
    for r in by_sample:
        # the problem's budget replaces max_tokens; the other sampling settings are kept
        assert r.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=6)
        assert r.prompt == expected_problem(EchoEnvironment()).prompt
        assert r.prompt_tokens is None


def test_problem_without_budget_keeps_request_max_tokens():
    inference = FakeInference()
    run(EchoEnvironment(max_tokens=None), inference)
    assert {r.sampling.max_tokens for r in inference.requests} == {16}


def test_expected_requests_is_group_size():
    assert EchoEnvironment().expected_requests(group_request(group_size=3)) == 3


def test_same_request_twice_gives_identical_groups():
    first = run(EchoEnvironment(), FakeInference())
    second = run(EchoEnvironment(), FakeInference())
    assert first == second
    other = run(EchoEnvironment(), FakeInference(), group_request(index_in_batch=3))
    assert [r.completion for r in other.rollouts] != [r.completion for r in first.rollouts]


def test_different_run_seed_changes_prompt_and_samples():
    first = run(EchoEnvironment(), FakeInference())
    second = run(EchoEnvironment(), FakeInference(), group_request(seed=RUN_SEED + 1))
    assert [r.completion for r in first.rollouts] != [r.completion for r in second.rollouts]


def test_reward_error_gives_placeholder_for_that_sample_only():
    texts = [fake_text(s) for s in sample_seeds()]
    assert len(set(texts)) == K  # each sample is identifiable by its completion
    env = EchoEnvironment(failing_completions=frozenset({texts[1]}))
    group = run(env, FakeInference())
    good = run(EchoEnvironment(), FakeInference())
    assert len(group.rollouts) == K
    bad = group.rollouts[1]
    assert bad.is_placeholder
    assert "KeyError" in bad.error and "cannot score" in bad.error
    assert bad.reward == 0.0
    assert bad.tokens == [] and bad.logprobs == [] and bad.generation_mask == []
    assert bad.problem_id == expected_problem(env).problem_id
    assert bad.env_id == "echo"
    assert bad.submission_policy_version == 7 and bad.temperature == 0.7
    for k in (0, 2, 3):
        assert group.rollouts[k] == good.rollouts[k]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_gives_placeholder(value):
    texts = [fake_text(s) for s in sample_seeds()]
    env = EchoEnvironment(reward_override={texts[2]: value})
    group = run(env, FakeInference())
    assert [r.is_placeholder for r in group.rollouts] == [False, False, True, False]
    assert "not finite" in group.rollouts[2].error
    assert group.rollouts[2].reward == 0.0


def test_make_problem_error_gives_all_placeholder_group_without_inference():
    inference = FakeInference()
    group = run(EchoEnvironment(fail_problem=True), inference)
    assert (group.batch_id, group.index_in_batch) == (BATCH, INDEX)
    assert len(group.rollouts) == K
    for rollout in group.rollouts:
        assert rollout.is_placeholder
        assert "RuntimeError: no problems today" in rollout.error
        assert rollout.reward == 0.0 and rollout.tokens == []
    assert inference.requests == []


def test_invalid_inference_request_gives_placeholders_for_the_group():
    """The samples of a group share one prompt: a prompt the engine refuses masks them all."""
    inference = FakeInference(raise_for={2: InvalidInferenceRequest("prompt too long: 999")})
    group = run(EchoEnvironment(), inference)
    assert [r.is_placeholder for r in group.rollouts] == [True] * K
    assert all("prompt too long: 999" in r.error for r in group.rollouts)
    assert all("InvalidInferenceRequest" in r.error for r in group.rollouts)
    assert all(r.reward == 0.0 for r in group.rollouts)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("engine crashed"), id="runtime-error"),
        pytest.param(ValueError("plain value error"), id="value-error-not-invalid-request"),
        pytest.param(ConnectionError("server gone"), id="connection-error"),
    ],
)
def test_other_inference_errors_propagate(error):
    with pytest.raises(type(error), match=str(error)):
        run(EchoEnvironment(), FakeInference(raise_for={1: error}))


@pytest.mark.parametrize("budget", [0, -3], ids=["zero", "negative"])
def test_invalid_problem_budget_never_reaches_inference_as_an_invalid_request(budget):
    """A bad ``Problem.max_tokens`` is the environment's fault: it must not produce a request
    that fails its own wire validation (an env server would answer 422, the local engine would
    silently generate one token)."""
    inference = FakeInference()
    group = run(EchoEnvironment(max_tokens=budget), inference)
    for request in inference.requests:
        InferenceRequest.model_validate_json(request.model_dump_json())
    if not inference.requests:
        assert all(r.is_placeholder for r in group.rollouts)


class CutOffInference(FakeInference):
    """As ``FakeInference``, but sample 1 ran out of budget: its tokens end without EOS."""

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        response = await super().generate(request)
        if request.rollout_key.sample_index != 1:
            return response
        tokens = response.tokens[:-1]
        return response.model_copy(
            update={
                "tokens": tokens,
                "text": TOK.decode(tokens),
                "logprobs": response.logprobs[:-1],
                "policy_versions": response.policy_versions[:-1],
                "finish_reason": "length",
            }
        )


@pytest.mark.parametrize(
    "max_tokens, budget",
    [pytest.param(6, 6, id="problem-budget"), pytest.param(None, 16, id="request-budget")],
)
def test_rollouts_record_their_budget_length_and_truncation(max_tokens, budget):
    """What overlong shaping reads: the budget the request was sampled with, the generated
    tokens, and whether the budget (not a stop token) ended the generation."""
    group = run(EchoEnvironment(max_tokens=max_tokens), CutOffInference())
    for k, rollout in enumerate(group.rollouts):
        assert rollout.max_tokens == budget
        assert rollout.turn_lengths == [sum(rollout.generation_mask)]
        assert rollout.truncated is (k == 1)
