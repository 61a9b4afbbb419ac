"""The environment fault policy shared by in-process group workers and the env server."""

from __future__ import annotations

import asyncio
import logging

import pytest
from grpo_testing.fakes import RaisingDigits, SeededInference

from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.agent.remote import RemoteEnvironmentError
from megatron.rl.environments.digits import DigitTaskEnvironment
from megatron.rl.inference.protocol import EngineError
from megatron.rl.rollout.faults import (
    EnvironmentFailures,
    FailureBudget,
    FaultLog,
    run_group,
)
from megatron.rl.wire import GroupedRolloutRequest


def request(batch_id: int, index: int, group_size: int = 4) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=8,
        group_size=group_size,
        seed=5,
        submission_policy_version=2,
    )


def run_groups(agent, requests, faults):
    async def run():
        return [await run_group(agent, r, SeededInference(), faults) for r in requests]

    return asyncio.run(run())


def test_a_raising_environment_in_a_mixture_gives_placeholders_named_after_it(caplog):
    mixture = MixtureAgent([RaisingDigits("raising"), DigitTaskEnvironment("copy")], [1, 1])
    faults = FaultLog()
    requests = [request(b, i) for b in range(4) for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.faults"):
        groups = run_groups(mixture, requests, faults)
    failed = [g for g in groups if g.rollouts[0].is_placeholder]
    assert failed and len(failed) < len(groups)
    for g in failed:
        assert [r.env_id for r in g.rollouts] == ["raising"] * 4
        assert all("KeyError" in r.error and r.submission_policy_version == 2 for r in g.rollouts)
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [
        (r.batch_id, r.index_in_batch) for r in requests
    ]
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "'raising'" in tracebacks[0].getMessage()
    assert faults.first_error["raising"].startswith("KeyError: 'lost the state of group")


@pytest.mark.parametrize(
    "error", [EngineError("engine closed"), RemoteEnvironmentError("env server down")]
)
def test_inference_failures_are_not_masked(error):
    class Failing(DigitTaskEnvironment):
        async def group_rollout(self, request, inference):
            raise error

    with pytest.raises(type(error)):
        run_groups(Failing("x"), [request(0, 0)], FaultLog())


def test_placeholders_an_environment_made_itself_are_logged_once_per_kind(caplog):
    class BadScore(DigitTaskEnvironment):
        def reward(self, problem, completion):
            raise ValueError(f"cannot score {completion!r}")

    faults = FaultLog()
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.faults"):
        groups = run_groups(BadScore("bad"), [request(b, 0) for b in range(3)], faults)
    assert all(r.is_placeholder for g in groups for r in g.rollouts)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "environment 'bad'" in logged[0] and "cannot score" in logged[0]


def test_failure_budget_names_the_environment_once_it_is_judged():
    mixture = MixtureAgent([RaisingDigits("raising"), DigitTaskEnvironment("copy")], [1, 1])
    faults = FaultLog()
    groups = run_groups(mixture, [request(b, i) for b in range(6) for i in range(8)], faults)
    lenient, strict = FailureBudget(0.5, 32), FailureBudget(0.2, 32)
    for batch in range(6):
        lenient.check(batch, groups[batch * 8 : batch * 8 + 8], faults)
    share = lenient.failed["raising"] / lenient.total["raising"]
    assert 0.2 < share < 0.5
    with pytest.raises(
        EnvironmentFailures, match="environment 'raising': .* above the limit of 20%"
    ):
        for batch in range(6):
            strict.check(batch, groups[batch * 8 : batch * 8 + 8], faults)
    assert strict.total["raising"] >= 32  # not judged before a batch's worth of its rollouts


def test_a_batch_whose_every_rollout_failed_stops_even_without_a_limit():
    class Broken(DigitTaskEnvironment):
        async def group_rollout(self, request, inference):
            raise OSError("dataset shard missing")

    faults = FaultLog()
    groups = run_groups(Broken("broken"), [request(0, i) for i in range(8)], faults)
    with pytest.raises(EnvironmentFailures, match=r"every rollout of batch 0 failed .*\(broken\)"):
        FailureBudget(1.0, 10**9).check(0, groups, faults)
