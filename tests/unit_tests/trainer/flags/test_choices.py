"""Every flag whose values name a library mode offers exactly the library's names: each choice
builds the library's config (or loads its variant), and each library name is a choice. The flags
import the names from torch-free library modules (``megatron/rl/grpo/names.py``, the
``policy_loss`` and ``advantages`` packages' scans), so a choice typed into a flag alone fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from megatron.rl.grpo import names
from megatron.rl.grpo.advantages import estimators
from megatron.rl.grpo.advantages.compute import AdvantageConfig
from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.policy_loss import load_policy_loss, policy_losses
from megatron.trainer.flags.option import options
from megatron.trainer.flags.run import SECTIONS

LIBRARY_NAMES: list[tuple[str, tuple[str, ...], Callable[[str], Any]]] = [
    # (flag, the library's names, what the library builds of one)
    (
        "--policy-loss",
        policy_losses(),
        lambda v: (load_policy_loss(v), GRPOLossConfig(0.2, 0.28, policy_loss=v)),
    ),
    ("--loss-agg-mode", names.AGG_MODES, lambda v: LossAggregation(v, 4.0)),
    ("--rl-importance-sampling-mode", names.IS_MODES, lambda v: ImportanceConfig(2.0, v, 0.5)),
    ("--adv-estimator", estimators(), lambda v: AdvantageConfig(estimator=v, scale="group")),
    ("--scale-rewards", names.SCALES, lambda v: AdvantageConfig(estimator="grpo", scale=v)),
]


def declaration(flag: str) -> tuple[Any, tuple[str, ...]]:
    """(default, choices) of ``flag``'s option."""
    for _, section in SECTIONS:
        for f, declared, found in options(section):
            if found == flag:
                return f.default, tuple(declared.choices)
    raise AssertionError(f"no option {flag}")


@pytest.mark.parametrize(
    "flag, library, build", LIBRARY_NAMES, ids=[flag for flag, _, _ in LIBRARY_NAMES]
)
def test_the_flag_offers_exactly_the_librarys_names(flag, library, build):
    default, choices = declaration(flag)
    for choice in choices:
        build(choice)  # a name the library lacks raises
    assert set(choices) == set(library), flag
    assert len(choices) == len(set(choices)) and default in choices


def test_a_choice_the_library_lacks_is_refused_by_it():
    for flag, _, build in LIBRARY_NAMES:
        with pytest.raises(ValueError, match="must be one of"):
            build("no-such-mode")


def test_the_defaults_are_the_librarys_spelled_once():
    assert declaration("--policy-loss")[0] == GRPOLossConfig(0.2, 0.28).policy_loss == "vanilla"
    assert declaration("--loss-agg-mode")[0] == GRPOLossConfig(0.2, 0.28).aggregation.mode
    assert declaration("--rl-importance-sampling-mode")[0] == ImportanceConfig.tis(1.0).mode
    assert policy_losses()[0] == "vanilla" and "base" not in policy_losses()
