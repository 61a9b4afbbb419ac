"""Benchmark environments, usable as env-config ``agent_type`` entries.

With the repository root on ``PYTHONPATH`` (``tools/benchmarks`` has an ``__init__.py``; ``tools``
is a namespace package)::

    - agent_type: tools.benchmarks.envs:LongTailLatencyEnvironment
      agent_args: {budget_alpha: 1.2, budget_max: 192, latency_min_ms: 20, latency_max_ms: 200}
    - agent_type: tools.benchmarks.envs:FixedBudgetDigits
      agent_args: {task: copy}

``LongTailLatencyEnvironment`` is the lag-sweep workload: long-tailed generation lengths and a
slow (asyncio) reward per rollout. ``FixedBudgetDigits`` is the digit task with the same token
budget for every rollout (the trainer's ``--rl-default-max-tokens``), as TRL's
``max_completion_length`` gives, for the side-by-side comparison.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

from pydantic import Field, model_validator

from megatron.rl.agent.api import Agent, AgentArgs, Problem, placeholder_rollout
from megatron.rl.environments.digits import DigitTaskEnvironment
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import (
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    RolloutKey,
    SamplingParams,
    TokenRollout,
)

_LATENCY_STREAM = 0x6C6174  # keeps the latency draws apart from the budget draws


class LongTailLatencyArgs(AgentArgs):
    """``agent_args`` of ``LongTailLatencyEnvironment``."""

    min_digits: int = Field(1, ge=1, le=8, description="Shortest prompt operand, in digits.")
    max_digits: int = Field(4, ge=1, le=8, description="Longest prompt operand, in digits.")
    budget_min: int = Field(4, ge=1, description="Pareto scale: the smallest token budget.")
    budget_alpha: float = Field(1.2, gt=0.0, description="Pareto shape (smaller: longer tail).")
    budget_max: int = Field(192, ge=1, description="Cap on a rollout's token budget.")
    latency_min_ms: float = Field(20.0, ge=0.0, description="Fastest reward call.")
    latency_max_ms: float = Field(200.0, ge=0.0, description="Slowest reward call.")
    keyed: bool = Field(
        True,
        description="Send rollout keys (the engine's deterministic schedule); False: unkeyed "
        "requests, stepped whenever a generation window is open, first come first served.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> LongTailLatencyArgs:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        if self.budget_min > self.budget_max:
            raise ValueError("budget_min must not exceed budget_max")
        if self.latency_min_ms > self.latency_max_ms:
            raise ValueError("latency_min_ms must not exceed latency_max_ms")
        return self


class LongTailLatencyEnvironment(Agent):
    """Rollouts with Pareto-distributed token budgets and a slow asynchronous reward.

    * Every rollout gets its own budget ``min(budget_max, floor(budget_min * U ** (-1/alpha)))``,
      drawn from an RNG seeded by (seed, batch, group, sample): most rollouts are short, a few per
      batch run to ``budget_max``. Each rollout is one keyed generation request, so the engine's
      deterministic schedule applies (``keyed: false`` sends unkeyed requests instead).
    * The reward of a rollout is the fraction of its budget it used (EOS before the budget scores
      less). The policy quickly learns not to emit EOS early; from then on the budgets alone set
      the lengths, the rewards are (nearly) all 1, the advantages (nearly) 0 and the policy stops
      drifting, so every forced lag generates (nearly) the same tokens.
    * Scoring one rollout waits a log-uniform 20-200 ms (``asyncio.sleep``; a stand-in for a
      sandbox or verifier call) right after its own generation finishes.
    """

    Args = LongTailLatencyArgs
    args: LongTailLatencyArgs

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """One keyed request per rollout, all sent at once (none announced when unkeyed)."""
        return request.group_size if self.args.keyed else None

    def budget(self, seed: int, batch_id: int, index: int, sample: int) -> int:
        """Token budget of one rollout (a pure function of its path)."""
        a = self.args
        u = 1.0 - random.Random(derive_seed(seed, batch_id, index, sample)).random()  # (0, 1]
        return max(1, min(a.budget_max, math.floor(a.budget_min * u ** (-1.0 / a.budget_alpha))))

    def latency_s(self, seed: int, batch_id: int, index: int, sample: int) -> float:
        """Reward latency of one rollout in seconds, log-uniform over the configured range."""
        a = self.args
        rng = random.Random(derive_seed(seed, batch_id, index, sample, _LATENCY_STREAM))
        lo, hi = max(a.latency_min_ms, 1e-3), max(a.latency_max_ms, 1e-3)
        return math.exp(rng.uniform(math.log(lo), math.log(hi))) / 1000.0

    def prompt(self, rng: random.Random) -> str:
        """A digit string followed by ``=``."""
        n = rng.randint(self.args.min_digits, self.args.max_digits)
        return "".join(rng.choice("0123456789") for _ in range(n)) + "="

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """Send every rollout's request at once; score each as soon as it finishes."""
        b, i = request.batch_id, request.index_in_batch
        group_seed = derive_seed(request.seed, b, i)
        prompt = self.prompt(random.Random(group_seed))
        rollouts = await asyncio.gather(
            *(
                self._rollout(request, inference, prompt, group_seed, k)
                for k in range(request.group_size)
            )
        )
        return RolloutGroup(batch_id=b, index_in_batch=i, rollouts=list(rollouts))

    async def _rollout(
        self,
        request: GroupedRolloutRequest,
        inference: InferenceInterface,
        prompt: str,
        group_seed: int,
        k: int,
    ) -> TokenRollout:
        b, i = request.batch_id, request.index_in_batch
        budget = self.budget(request.seed, b, i, k)
        sampling = SamplingParams.model_validate(
            {**request.sampling.model_dump(), "max_tokens": budget}
        )
        gen = InferenceRequest(
            prompt=prompt,
            sampling=sampling,
            seed=derive_seed(group_seed, k),
            rollout_key=(
                RolloutKey(batch_id=b, index_in_batch=i, sample_index=k)
                if self.args.keyed
                else None
            ),
        )
        try:
            response = await inference.generate(gen)
        except InvalidInferenceRequest as exc:
            return placeholder_rollout(self.env_id, request, exc, prompt)
        await asyncio.sleep(self.latency_s(request.seed, b, i, k))  # the slow reward call
        return self._scored(request, prompt, response, budget, sampling.temperature)

    def _scored(
        self,
        request: GroupedRolloutRequest,
        prompt: str,
        response: InferenceResponse,
        budget: int,
        temperature: float,
    ) -> TokenRollout:
        used = len(response.tokens) - (response.finish_reason == "stop")  # EOS does not count
        return TokenRollout(
            env_id=self.env_id,
            problem_id=prompt,
            prompt=prompt,
            completion=response.text,
            reward=used / budget,
            tokens=response.prompt_tokens + response.tokens,
            generation_mask=[False] * len(response.prompt_tokens) + [True] * len(response.tokens),
            logprobs=response.logprobs,
            policy_versions=response.policy_versions,
            submission_policy_version=request.submission_policy_version,
            temperature=temperature,
        )


class FixedBudgetDigits(DigitTaskEnvironment):
    """The built-in digit task, but every rollout may use the request's full ``max_tokens``."""

    def make_problem(self, rng: random.Random) -> Problem:
        """The digit problem without its per-problem budget."""
        return dataclasses.replace(super().make_problem(rng), max_tokens=None)
