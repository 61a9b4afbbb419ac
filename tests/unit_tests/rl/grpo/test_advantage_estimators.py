"""The advantage-estimator registry (``megatron/rl/grpo/advantages``): the estimators are found
by their modules without torch, the flag's choices and help come from them, and every estimator
keeps the contract ``compute.advantages`` relies on. A new estimator is checked here without any
edit."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from grpo_testing.probes import loads_torch

from megatron.rl.grpo import advantages as registry
from megatron.rl.grpo.advantages import (
    DEFAULT_ESTIMATOR,
    estimators,
    estimators_help,
    load_estimator,
)
from megatron.rl.grpo.advantages.base import Estimator
from megatron.rl.grpo.advantages.compute import AdvantageConfig, advantages
from megatron.trainer.flags.grpo import GRPO


def test_the_estimators_are_the_modules_found_and_loaded_without_torch():
    probe = "from megatron.rl.grpo.advantages import estimators, estimators_help as h\nh()"
    assert loads_torch(probe + "\nprint(estimators())") == (str(estimators()), False)
    assert estimators()[0] == DEFAULT_ESTIMATOR == "grpo"
    assert {"grpo", "rloo"} <= set(estimators()) and not {"base", "compute"} & set(estimators())


def test_the_flag_offers_every_estimator_with_its_help():
    field = GRPO.__dataclass_fields__["adv_estimator"]
    declared = field.metadata["option"]
    assert field.default == DEFAULT_ESTIMATOR and tuple(declared.choices) == estimators()
    for name in estimators():
        assert f"'{name}', {load_estimator(name).help}" in declared.help


def test_an_unknown_estimator_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"estimator must be one of \('grpo'"):
        load_estimator("gae")
    with pytest.raises(ValueError, match=r"estimator must be one of \('grpo'"):
        AdvantageConfig("gae", "group")


@pytest.mark.parametrize("name", estimators())
def test_every_estimator_centers_valid_rewards_and_zeroes_the_rest(name):
    """(G, K) float64 out; 0 on placeholders; a group of equal rewards centers to 0; shifting
    every reward of a group by a constant changes nothing."""
    g = torch.Generator().manual_seed(3)
    valid = torch.rand(4, 6, generator=g) > 0.25
    rewards = torch.where(valid, torch.rand(4, 6, generator=g, dtype=torch.float64), 0.0)
    weights = valid.double()

    def centered(r: torch.Tensor) -> torch.Tensor:
        total = (r * weights).sum(dim=1, keepdim=True)
        return load_estimator(name).centered(r, weights, total, weights.sum(dim=1, keepdim=True))

    out = centered(rewards)
    assert out.shape == rewards.shape and out.dtype == torch.float64
    assert torch.all(out[~valid] == 0)
    equal = torch.where(valid, torch.full_like(rewards, 0.7), 0.0)
    torch.testing.assert_close(centered(equal), torch.zeros_like(rewards))
    torch.testing.assert_close(centered(torch.where(valid, rewards + 5.0, 0.0)), out)


@pytest.fixture
def extra_module(tmp_path, monkeypatch):
    """Writes a module into a folder added to the package's path; the registry's caches and
    ``sys.modules`` forget it afterwards."""
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(tmp_path)])
    written = []

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        estimators.cache_clear()

    yield write
    for name in written:
        sys.modules.pop(f"{registry.__name__}.{name}", None)
    estimators.cache_clear()
    load_estimator.cache_clear()


def test_adding_a_module_adds_an_estimator(extra_module):
    extra_module(
        "zz_max",
        'HELP = "the group\'s best reward"\n'
        "def centered(rewards, weights, total, count):\n"
        "    return (rewards - (rewards * weights).amax(dim=1, keepdim=True)) * weights\n",
    )
    assert estimators()[-1] == "zz_max" and "'zz_max', the group's best reward" in estimators_help()
    got = advantages(torch.tensor([[1.0, 3.0]]), None, AdvantageConfig("zz_max", "none"))
    assert got.tolist() == [[-2.0, 0.0]]


@pytest.mark.parametrize(
    "source, message",
    [
        pytest.param("def centered(*a): pass\n", "must define HELP", id="no-help"),
        pytest.param('HELP = "x"\n', "must define a function centered()", id="no-function"),
    ],
)
def test_a_malformed_estimator_module_is_named(extra_module, source, message):
    extra_module("zz_bad", source)
    with pytest.raises(TypeError, match=re.escape(f"estimator 'zz_bad' {message}")):
        load_estimator("zz_bad")
    assert isinstance(load_estimator("grpo"), Estimator)
