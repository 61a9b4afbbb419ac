"""``MultiTurnEnvironment`` over the real scheduler (fake steps): the trajectory layout, the seeds,
the engine schedule's independence of the environment's latency, in process == over HTTP, and
the environment's failures."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from grpo_testing.fakes import FakeSteps, fake_route

from megatron.rl.agent.api import Problem
from megatron.rl.agent.multi_turn import (
    MultiTurnArgs,
    MultiTurnEnvironment,
    assemble_routes,
    run_episode,
)
from megatron.rl.http_client import ClientPool
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.seeding import derive_seed
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import (
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)

TOK = CharTokenizer()
SEED, BATCH, INDEX, GROUP = 99, 3, 1, 8


class Countdown(MultiTurnEnvironment):
    """Prompt "3?"; after turn t the environment answers "<2 - t>:", or ends the episode when
    that reaches 0 or the turn ends with 0 or 1. Reward: turns taken / max_turns.
    ``delay_s`` makes each answer take up to that long (random)."""

    def __init__(self, max_turns: int = 4, delay_s: float = 0.0, fail_on: str = "") -> None:
        super().__init__("countdown", MultiTurnArgs(max_turns=max_turns))
        self.delay_s = delay_s
        self.fail_on = fail_on

    def make_problem(self, rng: random.Random) -> Problem:
        return Problem(problem_id="cd:3", prompt="3?", answer="", max_tokens=2)

    async def observe(self, problem: Problem, completions: list[str]) -> str | None:
        await asyncio.sleep(self.delay_s * random.random())
        if self.fail_on and completions[-1].startswith(self.fail_on):
            raise RuntimeError(f"tool failed on {completions[-1]!r}")
        left = int(problem.prompt[:-1]) - len(completions)
        return f"{left}:" if left > 0 and completions[-1][-1] not in "01" else None

    async def reward(self, problem: Problem, completions: list[str]) -> float:
        return len(completions) / self.args.max_turns


def request(group_size: int = GROUP) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=BATCH,
        index_in_batch=INDEX,
        groups_in_batch=4,
        group_size=group_size,
        seed=SEED,
        submission_policy_version=2,
    )


def run_group(env: MultiTurnEnvironment, remote: bool = False, routes: bool = False):
    """The group and the engine's step plans, through the local interface or over HTTP
    (``routes``: the engine records ``fake_route`` routes)."""
    steps = FakeSteps(routes=routes)

    async def run():
        engine = ContinuousBatchingScheduler(
            steps, SchedulerConfig(max_requests=8, max_seq_len=32, barrier_timeout_s=5), lambda: 2
        )
        engine.start()
        engine.resume()
        local = LocalInferenceInterface(engine, TOK)
        app = create_inference_app(local, TOK)
        pool = ClientPool(8, httpx.Timeout(5.0), httpx.ASGITransport(app))
        inference = RemoteInferenceInterface("http://t", pool) if remote else local
        engine.expect_group(BATCH, INDEX, env.expected_requests(request()))
        try:
            return await asyncio.wait_for(env.group_rollout(request(), inference), 10)
        finally:
            engine.group_done(BATCH, INDEX)
            await pool.aclose()
            await engine.aclose()

    group = asyncio.run(run())
    return group, [[(r.seed, r.start, r.tokens) for r in p.rows[0]] for p in steps.plans]


def expected_rollout(k: int) -> tuple[list[int], list[bool]]:
    """Tokens and mask of rollout k, replaying FakeSteps (token 2 + (seed + position) % 7)."""
    turn0 = derive_seed(derive_seed(SEED, BATCH, INDEX), k)
    tokens, mask = TOK.encode("3?"), [False, False]
    for t in range(3):
        seed = turn0 if t == 0 else derive_seed(turn0, t)
        tokens += [2 + (seed + p) % 7 for p in (len(tokens), len(tokens) + 1)]
        mask += [True, True]
        if t == 2 or TOK.decode(tokens[-1:]) in "01":
            return tokens, mask
        tokens += TOK.encode(f"{2 - t}:")
        mask += [False, False]


def test_a_rollout_is_one_row_of_interleaved_model_and_environment_tokens():
    group, _ = run_group(Countdown())
    turns = []
    for k, rollout in enumerate(group.rollouts):
        tokens, mask = expected_rollout(k)
        assert rollout.tokens == tokens and rollout.generation_mask == mask
        assert len(rollout.logprobs) == len(rollout.policy_versions) == sum(mask)
        turns.append(sum(mask) // 2)
        assert rollout.reward == turns[-1] / 4 and rollout.error is None
        assert rollout.completion == TOK.decode(tokens[2:])
        assert rollout.submission_policy_version == 2
    assert len(set(turns)) > 1  # episodes of different lengths: some ended early


def test_the_schedule_does_not_depend_on_how_long_the_environment_takes():
    fast = run_group(Countdown())
    assert run_group(Countdown(delay_s=0.03)) == fast


def test_over_http_the_group_and_the_schedule_equal_the_in_process_ones():
    assert run_group(Countdown(delay_s=0.01), remote=True) == run_group(Countdown())


def test_a_failing_environment_masks_only_that_rollout_and_the_rest_go_on():
    clean, _ = run_group(Countdown())
    failing_turn = clean.rollouts[1].completion[:1]
    group, _ = run_group(Countdown(fail_on=failing_turn))
    for clean_rollout, rollout in zip(clean.rollouts, group.rollouts):
        if rollout.completion.startswith(failing_turn) or rollout.is_placeholder:
            assert rollout.is_placeholder and "tool failed" in rollout.error
        else:
            assert rollout == clean_rollout
    assert group.rollouts[1].is_placeholder


def test_a_history_that_outgrows_the_engine_is_a_placeholder():
    class Long(Countdown):
        def make_problem(self, rng):
            return Problem(problem_id="long", prompt="9?", answer="", max_tokens=8)

        async def observe(self, problem, completions):
            return "1" * 8

    group, _ = run_group(Long(max_turns=4), remote=True)
    assert all(r.is_placeholder and "max_seq_len" in r.error for r in group.rollouts)


@pytest.mark.parametrize("observation", ["", 5])
def test_an_observation_must_be_text_or_none(observation):
    class Bad(Countdown):
        async def observe(self, problem, completions):
            return observation

    group, _ = run_group(Bad())
    assert all(r.is_placeholder and "non-empty text or None" in r.error for r in group.rollouts)


def test_a_single_turn_episode_announces_nothing_and_ends_nothing():
    calls = []

    class Recording(LocalInferenceInterface):
        async def generate(self, req):
            calls.append(("generate", req.continued))
            return await super().generate(req)

        async def end_rollout(self, key):
            calls.append(("end", key))
            return await super().end_rollout(key)

    async def run():
        engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(), lambda: 0)
        engine.start()
        engine.resume()
        key = RolloutKey(batch_id=0, index_in_batch=0, sample_index=0)
        first = InferenceRequest(
            prompt="1?", sampling=SamplingParams(max_tokens=2), rollout_key=key
        )
        try:
            return await run_episode(Recording(engine, TOK), first, 1, None)
        finally:
            await engine.aclose()

    episode = asyncio.run(run())
    assert calls == [("generate", False)] and episode.observations == []


def test_rollouts_record_each_turns_length_and_the_budget_that_cut_them():
    """Every Countdown turn generates its whole budget of 2 tokens (no stop token): the rollout
    records the budget, one length per model turn, and that a turn was cut off."""
    group, _ = run_group(Countdown())
    for k, rollout in enumerate(group.rollouts):
        _, mask = expected_rollout(k)
        assert rollout.max_tokens == 2
        assert rollout.turn_lengths == [2] * (sum(mask) // 2)
        assert rollout.truncated is True


def expected_routes(k: int) -> list[list[int]]:
    """Rollout k's route at each input position: that of the first turn that fed it (turn t
    feeds from where turn t - 1 stopped up to its own last generated token, excluded)."""
    tokens, mask = expected_rollout(k)
    turn0 = derive_seed(derive_seed(SEED, BATCH, INDEX), k)
    ends = [i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    routes: list[list[int]] = []
    for t, end in enumerate(ends):
        seed = turn0 if t == 0 else derive_seed(turn0, t)
        routes += [fake_route(seed, p) for p in range(len(routes), end - 1)]
    assert len(routes) == len(tokens) - 1
    return routes


@pytest.mark.parametrize(
    "remote", [pytest.param(False, id="in_process"), pytest.param(True, id="http")]
)
def test_each_input_position_takes_the_route_of_the_first_turn_that_fed_it(remote):
    group, _ = run_group(Countdown(), remote=remote, routes=True)
    assert any(sum(r.generation_mask) > 2 for r in group.rollouts)  # multi-turn rollouts
    for k, rollout in enumerate(group.rollouts):
        assert rollout.routed_experts == expected_routes(k)
    plain, _ = run_group(Countdown(), remote=remote)
    assert all(r.routed_experts is None for r in plain.rollouts)


def test_routes_of_turns_are_none_unless_every_turn_has_them():
    def turn(prompt, tokens, routes):
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=tokens,
            text="",
            logprobs=[0.0] * len(tokens),
            policy_versions=[0] * len(tokens),
            finish_reason="length",
            routed_experts=routes,
        )

    first = turn([1, 2], [3, 4], [[0], [1], [2]])  # fed 1, 2, 3
    second = turn([1, 2, 3, 4, 9], [5, 6], [[7], [7], [7], [4], [9], [5]])  # fed 1..5
    assert assemble_routes([first, second]) == [[0], [1], [2], [4], [9], [5]]
    assert assemble_routes([first]) == first.routed_experts
    unrecorded = second.model_copy(update={"routed_experts": None})
    assert assemble_routes([first, unrecorded]) is None
