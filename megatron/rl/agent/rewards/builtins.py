"""The built-in reward functions of ``reward_funcs`` (``functions.py`` combines them): the
environment's own reward, ``exact_match``, ``regex``, ``soft_overlong_punishment``, and a user's
function in TRL's calling convention. ``reward_model`` and ``llm_judge`` live in their own modules.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from megatron.rl.agent.api import GroupScorer, Problem
from megatron.rl.agent.rewards.base import RewardFunction, Sample, Value
from megatron.rl.agent.user_code import load_function


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- built-ins


class EnvironmentReward(RewardFunction):
    """``environment``: the environment's own reward (``reward(problem, completion)``, or the
    reward sources it already has, e.g. a ``reward_model`` environment's model)."""

    Args = _Args

    def __init__(self, base: Callable[[Problem, str], float] | GroupScorer) -> None:
        self.base = base

    async def score(self, samples: list[Sample]) -> list[Value]:
        if callable(self.base):
            return [_call(self.base, s.problem, s.completion) for s in samples]
        scored = await self.base.score(samples[0].problem, [s.response for s in samples])
        return [s if isinstance(s, BaseException) else s.reward for s in scored]

    async def astart(self) -> None:
        if not callable(self.base):
            await self.base.astart()

    async def aclose(self) -> None:
        if not callable(self.base):
            await self.base.aclose()


def _call(fn: Callable[[Problem, str], float], problem: Problem, completion: str) -> Value:
    try:
        return float(fn(problem, completion))
    except Exception as exc:
        return exc


class ExactMatchArgs(_Args):
    strip: bool = Field(True, description="Compare without surrounding whitespace.")
    ignore_case: bool = Field(False, description="Compare case-insensitively.")


class ExactMatch(RewardFunction):
    """``exact_match``: 1 when the completion equals the problem's reference answer, else 0."""

    Args = ExactMatchArgs

    def __init__(self, args: ExactMatchArgs) -> None:
        self.args = args

    def _norm(self, text: str) -> str:
        text = text.strip() if self.args.strip else text
        return text.casefold() if self.args.ignore_case else text

    async def score(self, samples: list[Sample]) -> list[Value]:
        return [float(self._norm(s.completion) == self._norm(s.reference)) for s in samples]


class RegexArgs(_Args):
    pattern: str = Field(description="A Python regular expression.")
    fullmatch: bool = Field(False, description="The whole completion must match (else: search).")
    flags: list[Literal["IGNORECASE", "DOTALL", "MULTILINE"]] = Field(default_factory=list)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a regular expression: {err}") from None
        return value


class Regex(RewardFunction):
    """``regex``: 1 when the completion matches ``pattern`` (a format reward), else 0."""

    Args = RegexArgs

    def __init__(self, args: RegexArgs) -> None:
        flags = 0
        for name in args.flags:
            flags |= getattr(re, name)
        self.pattern = re.compile(args.pattern, flags)
        self.match = self.pattern.fullmatch if args.fullmatch else self.pattern.search

    async def score(self, samples: list[Sample]) -> list[Value]:
        return [float(self.match(s.completion) is not None) for s in samples]


class SoftOverlongArgs(_Args):
    max_completion_tokens: int = Field(ge=1, description="The budget L_max.")
    soft_punish_tokens: int = Field(ge=0, description="The soft interval L_cache before it.")

    @field_validator("soft_punish_tokens")
    @classmethod
    def _inside(cls, value: int, info) -> int:
        budget = info.data.get("max_completion_tokens")
        if budget is not None and value >= budget:
            raise ValueError(f"must be smaller than max_completion_tokens ({budget})")
        return value


class SoftOverlongPunishment(RewardFunction):
    """``soft_overlong_punishment``: DAPO's length penalty (TRL's
    ``get_soft_overlong_punishment``): 0 up to L_max - L_cache generated tokens, then falling
    linearly to -1 at L_max, and -1 beyond."""

    Args = SoftOverlongArgs

    def __init__(self, args: SoftOverlongArgs) -> None:
        self.budget = args.max_completion_tokens
        self.cache = args.soft_punish_tokens

    async def score(self, samples: list[Sample]) -> list[Value]:
        values = []
        for s in samples:
            length, free = s.completion_tokens, self.budget - self.cache
            if length <= free:
                values.append(0.0)
            elif length <= self.budget:
                values.append((free - length) / self.cache)
            else:
                values.append(-1.0)
        return values


USER_KEYWORDS = (
    "prompts",
    "completions",
    "references",
    "problem_ids",
    "completion_tokens",
    "finish_reasons",
)
"""The keyword lists a user function may declare (TRL passes ``prompts`` and ``completions``
the same way)."""


class UserFunction(RewardFunction):
    """``package.module:function`` or ``file.py:function`` (see the module docstring)."""

    def __init__(self, spec: str, args: dict[str, Any]) -> None:
        self.fn = load_function(spec)
        self.spec = spec
        self.args = args
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature: give it everything
            params = {}
        self.takes_all = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.keywords = {name for name in USER_KEYWORDS if self.takes_all or name in params}
        clash = sorted(set(args) & set(USER_KEYWORDS))
        if clash:
            raise ValueError(f"args {clash} are the keywords the function is called with")
        unknown = [
            name
            for name, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and name not in USER_KEYWORDS
            and name not in args
        ]
        if unknown:
            raise ValueError(
                f"{spec} requires {unknown}, which is neither a keyword it is called with "
                f"({', '.join(USER_KEYWORDS)}) nor in its args"
            )
        if not self.takes_all:
            extra = sorted(set(args) - set(params))
            if extra:
                raise ValueError(f"{spec} takes no parameter {extra} (args)")

    async def score(self, samples: list[Sample]) -> list[Value]:
        lists = {
            "prompts": [s.prompt for s in samples],
            "completions": [s.completion for s in samples],
            "references": [s.reference for s in samples],
            "problem_ids": [s.problem.problem_id for s in samples],
            "completion_tokens": [s.completion_tokens for s in samples],
            "finish_reasons": [s.response.finish_reason for s in samples],
        }
        result = self.fn(**{k: v for k, v in lists.items() if k in self.keywords}, **self.args)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, str | bytes | dict) or not hasattr(result, "__len__"):
            raise TypeError(f"{self.spec} returned {type(result).__name__}, not a list of numbers")
        result = list(result)  # a list, tuple, numpy array or tensor
        if len(result) != len(samples):
            raise ValueError(f"{self.spec} returned {len(result)} values for {len(samples)}")
        return [None if v is None else _number(v, self.spec) for v in result]


def _number(value: Any, spec: str) -> Value:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            return float(value)  # numpy and torch scalars
        except (TypeError, ValueError):
            return TypeError(f"{spec} returned {value!r}, not a number")
    return float(value)
