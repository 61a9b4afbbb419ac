"""Several reward functions per environment, with weights (TRL's ``reward_funcs`` and
``reward_weights``).

An env-config entry of a single-turn environment lists them::

    - agent_type: examples.rl.environments.math:MathEnvironment
      agent_args: {path: data.jsonl}
      reward_funcs:
        - {function: environment, weight: 1.0}            # the environment's own reward
        - {function: regex, weight: 0.2, args: {pattern: "\\\\boxed\\\\{.+\\\\}"}}
        - {function: my_rewards.py:brevity, name: brevity, weight: 0.1}
        - {function: reward_model, weight: 0.5, args: {model_dir: /models/rm}}
        - {function: llm_judge, args: {base_url: "http://127.0.0.1:8001/v1", model: judge}}

The rollout's reward is sum_i weight_i x value_i over the functions that scored it; each value
(before its weight) is kept in ``TokenRollout.reward_components`` under the function's name and
logged per step as ``reward/<env_id>/<name>``. The functions of a group run concurrently, each
on the whole group at once (a reward model's batch, a judge's concurrent calls).

* Built-ins (``BUILTINS``): ``environment``, ``exact_match``, ``regex``,
  ``soft_overlong_punishment`` (these four in ``builtins.py``), ``reward_model`` and ``llm_judge``.
* User code, ``package.module:function`` or ``path/to/file.py:function``, called as TRL calls
  its reward functions: once per group, with keyword lists of equal length, ``prompts``,
  ``completions``, ``references`` (the problem's answer), ``problem_ids``,
  ``completion_tokens`` (generated token counts), ``finish_reasons``, and the entry's ``args``;
  only the keywords the function declares are passed (all of them with ``**kwargs``). It returns
  one number per completion, or None where it does not apply (TRL's convention: that function
  then adds nothing to the rollout's reward); async functions are awaited. A plain function runs
  on the event loop: make a slow one async.

Faults follow the environment fault policy: a function that raises, a non-finite value, or a
rollout no function scored (all None) makes that rollout a masked placeholder whose error names
the function (``RewardFunctionError``); a function that raises for the whole group fails every
rollout of the group. ``--rl-max-failed-rollout-fraction`` bounds them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron.rl.agent.api import (
    GroupScorer,
    Problem,
    RewardFunctionError,
    Scored,
    SingleTurnEnvironment,
)
from megatron.rl.agent.rewards.base import RewardFunction, Sample, Value
from megatron.rl.agent.rewards.builtins import (
    EnvironmentReward,
    ExactMatch,
    Regex,
    SoftOverlongPunishment,
    UserFunction,
)
from megatron.rl.async_utils import gather_all
from megatron.rl.wire import InferenceResponse

HF_INSTALL = "pip install -e '.[hf]'"
"""Installs transformers, which a reward model needs."""
JUDGE_INSTALL = "pip install -e '.[judge]'"
"""Installs the openai client, which an LLM judge needs."""


class RewardConfigError(ValueError):
    """A ``reward_funcs`` list that cannot be used; the message names the field."""


class RewardFuncSpec(BaseModel):
    """One entry of ``reward_funcs``."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(
        min_length=1,
        description="A built-in name (environment, exact_match, regex, soft_overlong_punishment, "
        "reward_model, llm_judge) or 'package.module:function' / 'path/to/file.py:function'.",
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        max_length=64,
        description="Its name in reward_components and the metrics (default: the built-in's or "
        "the function's name).",
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Its weight in the sum.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Its options (a user function's extra keywords)."
    )


# --------------------------------------------------------------------------- the weighted sum


@dataclass(frozen=True)
class NamedFunction:
    """A reward function with its name and weight."""

    name: str
    weight: float
    function: RewardFunction


class WeightedRewards:
    """The ``GroupScorer`` of an entry's ``reward_funcs``: the weighted sum of its functions."""

    def __init__(self, functions: list[NamedFunction]) -> None:
        if not functions:
            raise ValueError("WeightedRewards needs at least one reward function")
        self.functions = functions

    async def astart(self) -> None:
        """Start every function (a reward model loads here)."""
        for f in self.functions:
            await f.function.astart()

    async def aclose(self) -> None:
        """Close every function."""
        for f in self.functions:
            await f.function.aclose()

    async def score(
        self, problem: Problem, responses: list[InferenceResponse]
    ) -> list[Scored | BaseException]:
        """Every function on the whole group (concurrently), then each rollout's weighted sum."""
        samples = [Sample(problem, r) for r in responses]
        columns = await gather_all(*(self._values(f, samples) for f in self.functions))
        results: list[Scored | BaseException] = []
        for i in range(len(samples)):
            total, components, failure = 0.0, {}, None
            for f, column in zip(self.functions, columns):
                value = column[i]
                if isinstance(value, BaseException):
                    failure = failure or _failure(f.name, value)
                elif value is not None:
                    if not math.isfinite(value):
                        failure = failure or RewardFunctionError(
                            f"reward function {f.name!r}: the value is not finite: {value}"
                        )
                    else:
                        components[f.name] = value
                        total += f.weight * value
            if failure is None and not components:
                names = [f.name for f in self.functions]
                failure = RewardFunctionError(f"reward functions {names}: every one returned None")
            if failure is None and not math.isfinite(total):
                failure = RewardFunctionError(f"reward functions: the weighted sum is {total}")
            results.append(failure if failure is not None else Scored(total, components))
        return results

    @staticmethod
    async def _values(f: NamedFunction, samples: list[Sample]) -> list[Value]:
        try:
            values = await f.function.score(samples)
        except Exception as exc:  # the function failed for the whole group
            return [exc] * len(samples)
        if len(values) != len(samples):
            error = ValueError(f"{len(values)} values for {len(samples)} completions")
            return [error] * len(samples)
        return list(values)


def _failure(name: str, exc: BaseException) -> RewardFunctionError:
    if isinstance(exc, RewardFunctionError):
        return exc
    return RewardFunctionError(f"reward function {name!r}: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- building


BUILTINS = (
    "environment",
    "exact_match",
    "regex",
    "soft_overlong_punishment",
    "reward_model",
    "llm_judge",
)
"""The built-in reward functions' names."""


def build_function(
    spec: RewardFuncSpec,
    base: Callable[[Problem, str], float] | GroupScorer | None,
    field: str,
) -> RewardFunction:
    """The reward function of ``spec`` (``field``: where it is in the config, for messages).

    Raises ``RewardConfigError`` naming the field that is wrong."""
    name = spec.function
    if name == "environment":
        if base is None:
            raise RewardConfigError(
                f"field '{field}.function': 'environment' is the environment's own reward, and "
                "this environment has none (list other functions)"
            )
        _no_args(spec, field)
        return EnvironmentReward(base)
    simple = {"exact_match": ExactMatch, "regex": Regex}
    simple["soft_overlong_punishment"] = SoftOverlongPunishment
    if name in simple:
        return simple[name](_validate(simple[name].Args, spec.args, f"{field}.args"))
    if name == "reward_model":
        _require("transformers", HF_INSTALL, field)
        from megatron.rl.agent.rewards.reward_model import RewardModelArgs, RewardModelFunction

        args = _validate(RewardModelArgs, spec.args, f"{field}.args")
        return RewardModelFunction(args, f"{field}.args")
    if name == "llm_judge":
        _require("openai", JUDGE_INSTALL, field)
        from megatron.rl.agent.rewards.judge import JudgeArgs, LLMJudge

        return LLMJudge(_validate(JudgeArgs, spec.args, f"{field}.args"))
    if ":" not in name:
        raise RewardConfigError(
            f"field '{field}.function': unknown reward function {name!r} (built-ins: "
            f"{', '.join(BUILTINS)}; or 'package.module:function')"
        )
    try:
        return UserFunction(name, spec.args)
    except ValueError as err:
        raise RewardConfigError(f"field '{field}.function': {err}") from None


def default_name(spec: RewardFuncSpec) -> str:
    """A function's name in the metrics: its ``name``, the built-in's, or the function's own."""
    if spec.name is not None:
        return spec.name
    return spec.function.rpartition(":")[2] or spec.function


def build_reward_functions(
    raw: list[Any],
    base: Callable[[Problem, str], float] | GroupScorer | None,
    field: str = "reward_funcs",
) -> WeightedRewards:
    """The ``WeightedRewards`` of a ``reward_funcs`` list; ``base`` is what ``environment``
    means (None: the environment has no reward of its own)."""
    if not isinstance(raw, list) or not raw:
        raise RewardConfigError(f"field '{field}': expected a non-empty list of reward functions")
    functions, seen = [], {}
    for index, item in enumerate(raw):
        where = f"{field}.{index}"
        spec = _validate(RewardFuncSpec, item, where)
        name = default_name(spec)
        if name in seen:
            raise RewardConfigError(
                f"field '{where}.name': {name!r} is the name of {field}.{seen[name]} too; give "
                "each function a distinct name"
            )
        seen[name] = index
        functions.append(NamedFunction(name, spec.weight, build_function(spec, base, where)))
    return WeightedRewards(functions)


def attach_reward_functions(agent: Any, raw: list[Any]) -> None:
    """Make ``agent``'s reward the weighted sum of ``raw`` (an env-config entry's
    ``reward_funcs``); ``environment`` among them is the agent's reward so far."""
    if not isinstance(agent, SingleTurnEnvironment):
        raise RewardConfigError(
            f"field 'reward_funcs': needs a single-turn environment (a SingleTurnEnvironment), "
            f"not {type(agent).__name__} (a remote environment's reward functions go into the env "
            "server's config)"
        )
    if agent.reward_functions is not None:
        base = agent.reward_functions
    elif agent.requires_reward_functions:
        base = None
    else:
        base = agent.reward
    agent.reward_functions = build_reward_functions(raw, base)


def _validate(model: type[BaseModel], value: Any, field: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise RewardConfigError(describe(err, field)) from None


def describe(err: ValidationError, prefix: str) -> str:
    """``field 'prefix.loc': message; ...`` of a validation error."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        parts.append(f"field '{loc}': {e['msg']}")
    return "; ".join(parts)


def _no_args(spec: RewardFuncSpec, field: str) -> None:
    if spec.args:
        raise RewardConfigError(f"field '{field}.args': {spec.function!r} takes no args")


def _require(module: str, install: str, field: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise RewardConfigError(
            f"field '{field}.function': needs the {module!r} package, which cannot be imported "
            f"({err}): {install}"
        ) from None
