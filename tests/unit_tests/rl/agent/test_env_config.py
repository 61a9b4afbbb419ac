"""Env-config YAML -> ``MixtureAgent``: errors name file, entry and field; exact weighted mixes."""

from __future__ import annotations

import asyncio
import random
import sys
import types
from collections import Counter

import pytest

from megatron.rl.agent import mixture
from megatron.rl.agent.env_config import (
    DEFAULT_ENV_CONFIG,
    EnvConfigError,
    build_agents,
    load_env_config,
    resolve_agent_type,
)
from megatron.rl.agent.mixture import MixtureAgent, mixture_assignment
from megatron.rl.environments.digits import DigitTaskEnvironment
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest

TWO_DIGITS = """\
- agent_type: digits
  env_id: copy
  agent_args: {task: copy, min_digits: 1, max_digits: 3}
  weight: 3
- agent_type: megatron.rl.environments.digits:DigitTaskEnvironment
  agent_args: {task: add, max_digits: 2}
  weight: 1
"""


def write(tmp_path, text: str):
    path = tmp_path / "envs.yaml"
    path.write_text(text)
    return path


def request(index: int, groups: int, seed: int = 11, batch_id: int = 4) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=groups,
        group_size=2,
        seed=seed,
        submission_policy_version=0,
    )


def test_yaml_with_two_entries_builds_the_mixture(tmp_path):
    agent = load_env_config(write(tmp_path, TWO_DIGITS))
    assert isinstance(agent, MixtureAgent)
    default_id = "megatron.rl.environments.digits:DigitTaskEnvironment1"
    assert [a.env_id for a in agent.agents] == ["copy", default_id]
    assert agent.weights == (3.0, 1.0)
    assert all(isinstance(a, DigitTaskEnvironment) for a in agent.agents)
    copy, add = agent.agents
    assert (copy.args.task, copy.args.min_digits, copy.args.max_digits) == ("copy", 1, 3)
    assert (add.args.task, add.args.max_digits) == ("add", 2)


def test_default_env_id_is_type_and_index(tmp_path):
    text = "- {agent_type: digits}\n- {agent_type: digits, agent_args: {task: sort}}\n"
    agent = load_env_config(write(tmp_path, text))
    assert [a.env_id for a in agent.agents] == ["digits0", "digits1"]
    assert agent.weights == (1.0, 1.0)
    assert agent.agents[1].args.task == "sort"


def test_no_path_gives_embedded_default():
    agent = load_env_config(None)
    assert [a.env_id for a in agent.agents] == [e["env_id"] for e in DEFAULT_ENV_CONFIG]
    assert agent.agents[0].args.task == "copy"


@pytest.mark.parametrize(
    "yaml_text, fragments",
    [
        pytest.param(
            "- {agent_type: digits}\n- {agent_type: nosuch}\n",
            ["entry 1", "'agent_type'", "nosuch"],
            id="unknown-agent-type",
        ),
        pytest.param(
            "- {agent_type: 'nosuchmodule.x:Y'}\n",
            ["entry 0", "'agent_type'", "nosuchmodule"],
            id="unimportable-agent-type",
        ),
        pytest.param(
            "- {agent_type: 'megatron.rl.wire:RolloutKey'}\n",
            ["entry 0", "'agent_type'", "not an Agent subclass"],
            id="agent-type-not-an-agent",
        ),
        pytest.param(
            "- {agent_type: digits, agent_args: {min_digits: 0}}\n",
            ["entry 0", "agent_args.min_digits"],
            id="bad-agent-arg-value",
        ),
        pytest.param(
            "- {agent_type: digits}\n- {agent_type: digits, agent_args: {max_digit: 2}}\n",
            ["entry 1", "agent_args.max_digit"],
            id="misspelled-agent-arg",
        ),
        pytest.param(
            "- {agent_type: digits, agent_args: {min_digits: 3, max_digits: 2}}\n",
            ["entry 0", "agent_args", "min_digits"],
            id="inconsistent-agent-args",
        ),
        pytest.param(
            "- {agent_type: digits, weight: -1}\n",
            ["entry 0", "'weight'"],
            id="negative-weight",
        ),
        pytest.param(
            "- {agent_type: digits, weight: 0}\n- {agent_type: digits, evaluation_only: true}\n",
            ["no entry trains", "evaluation_only"],
            id="nothing-trains",
        ),
        pytest.param(
            "- {agent_type: digits, evaluation_only: maybe}\n",
            ["entry 0", "'evaluation_only'"],
            id="evaluation-only-not-a-bool",
        ),
        pytest.param(
            "- {agent_type: digits, weight: .inf}\n",
            ["entry 0", "'weight'"],
            id="infinite-weight",
        ),
        pytest.param(
            "- {agent_type: digits, wieght: 2}\n",
            ["entry 0", "'wieght'"],
            id="misspelled-entry-key",
        ),
        pytest.param(
            "- {agent_type: digits, env_id: a}\n- {agent_type: digits, env_id: a}\n",
            ["env_id", "unique"],
            id="duplicate-env-id",
        ),
        pytest.param("agent_type: digits\n", ["non-empty list"], id="mapping-not-list"),
        pytest.param("[]\n", ["non-empty list"], id="empty-list"),
        pytest.param("", ["non-empty list"], id="empty-file"),
        pytest.param("- {agent_type: digits\n", ["invalid YAML"], id="invalid-yaml"),
    ],
)
def test_bad_config_raises_error_naming_file_entry_and_field(tmp_path, yaml_text, fragments):
    path = write(tmp_path, yaml_text)
    with pytest.raises(EnvConfigError) as info:
        load_env_config(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file_raises_error_naming_it(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(EnvConfigError, match="cannot read") as info:
        load_env_config(path)
    assert str(path) in str(info.value)


def test_env_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        build_agents([{"agent_type": "nosuch"}], "inline")


def test_resolve_builtin_name():
    assert resolve_agent_type("digits") is DigitTaskEnvironment


@pytest.mark.parametrize(
    "weights, groups, counts",
    [
        pytest.param((3, 1), 8, [6, 2], id="3-1-over-8"),
        pytest.param((1, 1, 1), 8, [3, 3, 2], id="thirds-ties-to-earlier"),
        pytest.param((1, 1, 1), 7, [3, 2, 2], id="thirds-of-7"),
        pytest.param((1, 2), 4, [1, 3], id="largest-remainder-wins"),  # quotas 1.33, 2.67
        pytest.param((5,), 3, [3], id="single-env"),
        pytest.param((0.1, 0.2, 0.7), 10, [1, 2, 7], id="float-weights"),
        pytest.param((1, 1000), 3, [0, 3], id="tiny-weight-can-get-nothing"),
        pytest.param((2, 1, 1), 1, [1, 0, 0], id="one-group"),
    ],
)
def test_mixture_assignment_largest_remainder_counts(weights, groups, counts):
    for seed in range(5):
        slots = mixture_assignment(weights, groups, seed)
        assert len(slots) == groups
        assert [Counter(slots)[i] for i in range(len(weights))] == counts


def test_mixture_assignment_deterministic_per_seed_and_varies_across_seeds():
    a = mixture_assignment((3, 1), 32, seed=5)
    assert a == mixture_assignment((3, 1), 32, seed=5)
    distinct = {tuple(mixture_assignment((3, 1), 32, seed=s)) for s in range(5, 15)}
    assert len(distinct) == 10  # 32!/(24!8!) orderings: a repeat would mean the seed is ignored


def test_mixture_assignment_is_a_seeded_shuffle_of_sorted_slots():
    slots = [0] * 6 + [1] * 2
    random.Random(9).shuffle(slots)
    assert mixture_assignment((3, 1), 8, 9) == slots


def test_agent_for_follows_mixture_assignment(tmp_path):
    agent = load_env_config(write(tmp_path, TWO_DIGITS))
    groups = 16
    seed, batch_id = 11, 4
    expected = mixture_assignment(
        (3.0, 1.0), groups, derive_seed(seed, batch_id, mixture._MIXTURE_STREAM)
    )
    chosen = [agent.agent_for(request(i, groups, seed, batch_id)) for i in range(groups)]
    assert [agent.agents.index(a) for a in chosen] == expected
    assert Counter(a.env_id for a in chosen)["copy"] == 12
    # same request, same agent; the expected request count is the chosen agent's group size
    assert agent.agent_for(request(3, groups, seed, batch_id)) is chosen[3]
    assert agent.expected_requests(request(3, groups, seed, batch_id)) == 2


def test_agent_for_assignment_changes_with_batch_but_keeps_the_mix():
    two = build_agents(
        [{"agent_type": "digits", "env_id": "a"}, {"agent_type": "digits", "env_id": "b"}]
    )
    picks = {
        tuple(two.agents.index(two.agent_for(request(i, 8, batch_id=b))) for i in range(8))
        for b in range(8)
    }
    assert len(picks) > 1
    assert all(sorted(p) == [0] * 4 + [1] * 4 for p in picks)


def test_mixture_agent_needs_one_weight_per_agent():
    agents = load_env_config(None).agents
    with pytest.raises(ValueError):
        MixtureAgent(agents, [1.0, 2.0])
    with pytest.raises(ValueError):
        MixtureAgent([], [])


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param([1.0, -1.0], id="negative"),
        pytest.param([1.0, float("inf")], id="infinite"),
    ],
)
def test_mixture_agent_rejects_negative_or_infinite_weights(weights):
    """Its own error message promises "one positive weight per agent"; without the check a
    negative weight silently skews the mix and an infinite one crashes in ``agent_for``."""
    agents = build_agents(
        [{"agent_type": "digits", "env_id": "a"}, {"agent_type": "digits", "env_id": "b"}]
    ).agents
    with pytest.raises(ValueError):
        MixtureAgent(agents, weights)


EVAL_ONLY = """\
- {agent_type: digits, env_id: copy, agent_args: {task: copy}, weight: 2}
- {agent_type: digits, env_id: sort, agent_args: {task: sort}, evaluation_only: true}
- {agent_type: digits, env_id: add, agent_args: {task: add}, weight: 0}
- {agent_type: digits, env_id: rev, agent_args: {task: reverse}, weight: 1}
"""


def test_evaluation_only_and_zero_weight_entries_are_evaluated_but_not_trained(tmp_path):
    agent = load_env_config(write(tmp_path, EVAL_ONLY))
    assert [a.env_id for a in agent.agents] == ["copy", "rev"] and agent.weights == (2.0, 1.0)
    assert [a.env_id for a in agent.evaluation_only] == ["sort", "add"]
    assert [a.env_id for a in agent.evaluated] == ["copy", "rev", "sort", "add"]
    # The training mix is that of the trained entries alone.
    trained_only = build_agents(
        [{"agent_type": "digits", "env_id": e, "weight": w} for e, w in [("copy", 2), ("rev", 1)]]
    )
    for index in range(6):
        assert agent.agent_for(request(index, 6)).env_id == (
            trained_only.agent_for(request(index, 6)).env_id
        )


def test_the_mixture_starts_and_closes_evaluation_only_agents_too(tmp_path):
    agent = load_env_config(write(tmp_path, EVAL_ONLY))
    calls = []
    for a in agent.evaluated:
        a.astart = lambda a=a: _record(calls, "start", a.env_id)
        a.aclose = lambda a=a: _record(calls, "close", a.env_id)

    async def run():
        await agent.astart()
        await agent.aclose()

    asyncio.run(run())
    ids = ["copy", "rev", "sort", "add"]
    assert calls == [("start", e) for e in ids] + [("close", e) for e in ids]


async def _record(calls: list, what: str, env_id: str) -> None:
    calls.append((what, env_id))


class NeedsAnOptionalPackage(DigitTaskEnvironment):
    """A digit task that declares an optional package it would import when it runs."""

    required_modules = {"json": "(stdlib)", "grpo_optional_pkg": "pip install grpo-optional-pkg"}


class ImportsAnUndeclaredPackage(DigitTaskEnvironment):
    """A digit task that imports a package it does not declare when it is built."""

    def __init__(self, env_id, args=None) -> None:
        import grpo_undeclared_pkg  # noqa: F401

        super().__init__(env_id, args)


@pytest.mark.parametrize(
    "class_name, fragments",
    [
        pytest.param(
            "NeedsAnOptionalPackage",
            ["'grpo_optional_pkg' package", "pip install grpo-optional-pkg"],
            id="declared-names-its-install-command",
        ),
        pytest.param(
            "ImportsAnUndeclaredPackage",
            ["needs 'grpo_undeclared_pkg'", "cannot be imported"],
            id="undeclared-is-named",
        ),
    ],
)
def test_a_package_that_does_not_import_is_an_error_naming_the_entry(
    tmp_path, monkeypatch, class_name, fragments
):
    for name in ("grpo_optional_pkg", "grpo_undeclared_pkg"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    path = write(
        tmp_path, f"- {{agent_type: digits}}\n- {{agent_type: '{__name__}:{class_name}'}}\n"
    )
    with pytest.raises(EnvConfigError) as info:
        load_env_config(path)
    message = str(info.value)
    assert message.startswith(f"env config {path}, entry 1 (agent_type '{__name__}:{class_name}')")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_declared_packages_that_import_build_the_agent(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "grpo_optional_pkg", types.ModuleType("grpo_optional_pkg"))
    agent = load_env_config(
        write(tmp_path, f"- {{agent_type: '{__name__}:NeedsAnOptionalPackage'}}\n")
    )
    assert isinstance(agent.agents[0], NeedsAnOptionalPackage)
