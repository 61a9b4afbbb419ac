"""An LLM judge behind any OpenAI-compatible endpoint as a reward function.

Options (``JudgeArgs``, the ``args`` of ``function: llm_judge`` or the ``agent_args`` of
``agent_type: llm_judge``)::

    base_url: http://127.0.0.1:8001/v1   # the endpoint's OpenAI base URL (vLLM, SGLang, our serve)
    model: judge                          # the model name it serves
    api_key_env: JUDGE_API_KEY            # environment variable holding its key (null: none)
    api: chat                             # or completions
    system_prompt: null
    prompt_template: "...{prompt}...{response}...{reference}..."
    max_tokens: 16
    temperature: 0.0                      # greedy: the same completion gets the same score
    seed: 0                               # sent when not null
    score_pattern: "(-?\\d+(?:\\.\\d+)?)"  # the score: the first group of the first match
    score_match: first                    # or last
    score_parser: null                    # or package.module:function (text -> number)
    score_range: [0, 10]                  # normalised to [0, 1]
    clip: false                           # a score outside the range is a failure (true: clipped)
    timeout_s: 60
    max_retries: 2                        # the client's retries, with backoff
    max_concurrency: 16                   # judge calls in flight per environment
    extra_body: {}                        # more request fields (e.g. top_k)

Each completion is one request through the ``openai`` client (``AsyncOpenAI``; its retries cover
connection errors, timeouts, 408, 409, 429 and 5xx answers). The judge's text is parsed into a
number (``score_pattern`` or ``score_parser``) and normalised by ``score_range`` to [0, 1].
``{prompt}`` in the template is the prompt text (for a chat prompt: its last user message),
``{response}`` the completion, ``{reference}`` the problem's reference answer; other braces are
left as they are.

A failed judge call (after the retries) or an answer without a usable score fails that rollout
only, under the environment fault policy: it becomes a masked placeholder whose error names the
judge and quotes its answer, and ``--rl-max-failed-rollout-fraction`` stops a run whose judge
keeps failing. The client (and its connection pool) is made per event loop, so the training
rollouts and the evaluation loop each have their own.
"""

from __future__ import annotations

import asyncio
import os
import re
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from megatron.rl.agent.rewards.base import RewardFunction, Sample, Value
from megatron.rl.agent.user_code import load_function
from megatron.rl.wire import MAX_TOKENS, BaseUrl

DEFAULT_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (useless) to 10 (perfect).\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Reply with the score alone, a number from 0 to 10."
)
FIELDS = ("{prompt}", "{response}", "{reference}")


class JudgeError(Exception):
    """A judge call failed, or its answer has no usable score."""


class JudgeArgs(BaseModel):
    """Options of an LLM judge (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    base_url: BaseUrl = Field(description="The OpenAI base URL of the judge (ends in /v1).")
    model: str = Field(min_length=1, description="The model the endpoint serves.")
    api_key_env: str | None = Field(
        None, min_length=1, description="Environment variable holding the key (null: no key)."
    )
    api: Literal["chat", "completions"] = Field(
        "chat", description="/chat/completions (messages) or /completions (the prompt text)."
    )
    system_prompt: str | None = Field(None, description="System message (api chat).")
    prompt_template: str = Field(
        DEFAULT_TEMPLATE, description="The judge's prompt: {prompt}, {response}, {reference}."
    )
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="The judge's answer budget.")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int | None = Field(0, ge=0, lt=2**63, description="Sent when not null.")
    score_pattern: str = Field(
        r"(-?\d+(?:\.\d+)?)",
        description="Regular expression of the score: its first group (or the whole match).",
    )
    score_match: Literal["first", "last"] = Field("first", description="Which match is the score.")
    score_parser: str | None = Field(
        None,
        description="'package.module:function' taking the judge's text and returning its score "
        "(instead of score_pattern).",
    )
    score_range: tuple[float, float] = Field(
        (0.0, 10.0), description="[low, high]: the score is normalised to (s - low) / (high - low)."
    )
    clip: bool = Field(False, description="Clip a score outside score_range (else: a failure).")
    timeout_s: float = Field(60.0, gt=0, description="Timeout of one judge call.")
    max_retries: int = Field(2, ge=0, le=20, description="Retries of a failed call (backoff).")
    max_concurrency: int = Field(16, ge=1, le=4096, description="Judge calls in flight.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="More fields of each request (e.g. top_k)."
    )

    @field_validator("api_key_env")
    @classmethod
    def _set(cls, value: str | None) -> str | None:
        if value is not None and value not in os.environ:
            raise ValueError(
                f"the environment variable {value} is not set (null: the judge needs no key)"
            )
        return value

    @field_validator("prompt_template")
    @classmethod
    def _has_response(cls, value: str) -> str:
        if "{response}" not in value:
            raise ValueError("must contain '{response}'")
        return value

    @field_validator("score_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            pattern = re.compile(value)
        except re.error as err:
            raise ValueError(f"not a regular expression: {err}") from None
        if pattern.groups > 1:
            raise ValueError("has more than one group; the score is the first group")
        return value

    @field_validator("score_parser")
    @classmethod
    def _loads(cls, value: str | None) -> str | None:
        if value is not None:
            load_function(value)  # ValueError naming what is missing
        return value

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not value[0] < value[1]:
            raise ValueError(f"low must be below high, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _system_for_chat(self) -> JudgeArgs:
        if self.system_prompt is not None and self.api != "chat":
            raise ValueError("system_prompt needs api: chat")
        return self


@dataclass
class _LoopState:
    client: Any
    semaphore: asyncio.Semaphore


class LLMJudge(RewardFunction):
    """``llm_judge``: each completion's score by a judge model."""

    def __init__(self, args: JudgeArgs) -> None:
        self.args = args
        self.pattern = re.compile(args.score_pattern)
        self.parser = None if args.score_parser is None else load_function(args.score_parser)
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self.where = f"judge {args.base_url} ({args.model})"

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            import openai

            a = self.args
            key = os.environ.get(a.api_key_env) if a.api_key_env is not None else None
            client = openai.AsyncOpenAI(
                base_url=a.base_url,
                api_key=key or "unused",
                timeout=a.timeout_s,
                max_retries=a.max_retries,
            )
            state = self._states[loop] = _LoopState(client, asyncio.Semaphore(a.max_concurrency))
        return state

    async def aclose(self) -> None:
        """Close this event loop's client (the others' loops are gone or close their own)."""
        state = self._states.pop(asyncio.get_running_loop(), None)
        if state is not None:
            await state.client.close()

    async def score(self, samples: list[Sample]) -> list[Value]:
        return list(await asyncio.gather(*(self._judged(s) for s in samples)))

    async def _judged(self, sample: Sample) -> Value:
        try:
            return self.normalised(await self.ask(self.render(sample)))
        except JudgeError as exc:
            return exc

    def render(self, sample: Sample) -> str:
        """The judge's prompt for ``sample``."""
        prompt = sample.prompt
        if sample.problem.messages is not None:
            users = [m.content for m in sample.problem.messages if m.role == "user"]
            prompt = users[-1] if users else prompt
        values = {"{prompt}": prompt, "{response}": sample.completion}
        values["{reference}"] = sample.reference
        return re.sub(
            "|".join(map(re.escape, FIELDS)),
            lambda m: values[m.group(0)],
            self.args.prompt_template,
        )

    async def ask(self, content: str) -> str:
        """The judge's answer to ``content``; ``JudgeError`` once the client gave up."""
        import openai

        a, state = self.args, self._state()
        options: dict[str, Any] = {"max_tokens": a.max_tokens, "temperature": a.temperature}
        if a.seed is not None:
            options["seed"] = a.seed
        if a.extra_body:
            options["extra_body"] = a.extra_body
        async with state.semaphore:
            try:
                if a.api == "chat":
                    messages = [{"role": "user", "content": content}]
                    if a.system_prompt is not None:
                        messages.insert(0, {"role": "system", "content": a.system_prompt})
                    answer = await state.client.chat.completions.create(
                        model=a.model, messages=messages, **options
                    )
                    return answer.choices[0].message.content or ""
                answer = await state.client.completions.create(
                    model=a.model, prompt=content, **options
                )
                return answer.choices[0].text or ""
            except openai.OpenAIError as exc:
                raise JudgeError(f"{self.where}: {type(exc).__name__}: {exc}") from None
            except (IndexError, AttributeError) as exc:
                raise JudgeError(f"{self.where}: an answer without a choice ({exc})") from None

    def parse(self, text: str) -> float:
        """The raw score in the judge's ``text``; ``JudgeError`` if it has none."""
        a = self.args
        if self.parser is not None:
            try:
                return float(self.parser(text))
            except Exception as exc:
                raise JudgeError(
                    f"{self.where}: score_parser {a.score_parser} failed on the answer "
                    f"{_quote(text)}: {type(exc).__name__}: {exc}"
                ) from None
        matches = list(self.pattern.finditer(text))
        if not matches:
            raise JudgeError(
                f"{self.where}: the answer {_quote(text)} has no score matching score_pattern "
                f"{a.score_pattern!r}"
            )
        match = matches[0] if a.score_match == "first" else matches[-1]
        found = match.group(1) if self.pattern.groups else match.group(0)
        try:
            return float(found)
        except (TypeError, ValueError):
            raise JudgeError(
                f"{self.where}: the score {found!r} in the answer {_quote(text)} is not a number"
            ) from None

    def normalised(self, text: str) -> float:
        """The score of the judge's ``text`` mapped from ``score_range`` to [0, 1]."""
        low, high = self.args.score_range
        value = self.parse(text)
        if not low <= value <= high:
            if not self.args.clip:
                raise JudgeError(
                    f"{self.where}: the score {value:g} in the answer {_quote(text)} is outside "
                    f"score_range [{low:g}, {high:g}]"
                )
            value = min(max(value, low), high)
        return (value - low) / (high - low)


def _quote(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
