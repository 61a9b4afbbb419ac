"""Evaluation of the current policy on a held-out prompt set: greedy reward and unbiased pass@k.

For each environment, problem i of the held-out set is the one its agent draws for the grouped
request (batch_id=i, index_in_batch=0, eval_prompts=the set's size) under the *evaluation seed*,
a seed derived from the run seed on a stream of its own; training batches use the run seed
itself, so the held-out set is a fixed sample of the task distribution drawn independently of
the training prompts (a small procedural task can still repeat a training prompt by chance).
Environments with a fixed held-out list (``reward_only``: ``evaluation_prompts``) take its
problem i instead. Two passes over the set:

* greedy: one rollout per problem at temperature 0 -> ``greedy_reward`` (mean reward);
* sampled: n rollouts per problem with the given sampling parameters -> ``sample_reward`` and
  pass@k for each requested k, counting a rollout as correct when its reward reaches the
  threshold.

Requests are keyed and announced like training groups, so with a ``BatchScheduler`` (the engine)
the schedule, and so every token, is deterministic. Environment failures (placeholder rollouts)
count as incorrect with reward 0 and are reported in ``failed``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from megatron.rl.agent.api import Agent
from megatron.rl.async_utils import gather_all
from megatron.rl.eval.passk import mean_pass_at_k
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import BatchScheduler
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, SamplingParams

EVAL_STREAM = 0x6576616C  # "eval": keeps the held-out prompts apart from the training prompts


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation measures."""

    num_prompts: int = 32
    """Held-out problems per environment."""
    samples_per_prompt: int = 8
    """n: sampled rollouts per problem for pass@k."""
    pass_k: tuple[int, ...] = (1,)
    """The k of pass@k to report (each 1 <= k <= n)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling of the pass@k rollouts (the greedy pass uses the same with temperature 0)."""
    correct_threshold: float = 1.0
    """A rollout is correct when its reward is >= this."""
    seed: int = 1234
    """The run seed; the held-out set is drawn from ``derive_seed(seed, EVAL_STREAM)``."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.samples_per_prompt < 1:
            raise ValueError("num_prompts and samples_per_prompt must be >= 1")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= {self.samples_per_prompt}, got {bad}")


@dataclass(frozen=True)
class EnvEvaluation:
    """Scores of one environment on its held-out set."""

    env_id: str
    greedy_reward: float
    sample_reward: float
    pass_at_k: dict[int, float]
    failed: int
    """Rollouts that were placeholders (environment errors), both passes."""


async def evaluate_agents(
    agents: list[Agent],
    inference: InferenceInterface,
    config: EvalConfig,
    scheduler: BatchScheduler | None = None,
) -> list[EnvEvaluation]:
    """Evaluate each agent (environment) in turn; see the module docstring."""
    return [await _evaluate_one(agent, inference, config, scheduler) for agent in agents]


def eval_metrics(results: list[EnvEvaluation]) -> dict[str, float]:
    """Flat ``eval/...`` metrics: means over environments, plus per environment when several."""
    metrics: dict[str, float] = {}

    def put(name: str, values: list[float]) -> None:
        metrics[f"eval/{name}"] = statistics.fmean(values)
        if len(results) > 1:
            for r, v in zip(results, values):
                metrics[f"eval/{name}/{r.env_id}"] = v

    put("greedy_reward", [r.greedy_reward for r in results])
    put("sample_reward", [r.sample_reward for r in results])
    for k in sorted(results[0].pass_at_k):
        put(f"pass@{k}", [r.pass_at_k[k] for r in results])
    metrics["eval/failed"] = float(sum(r.failed for r in results))
    return metrics


async def _evaluate_one(
    agent: Agent,
    inference: InferenceInterface,
    config: EvalConfig,
    scheduler: BatchScheduler | None,
) -> EnvEvaluation:
    greedy_sampling = config.sampling.model_copy(update={"temperature": 0.0})
    greedy = await _run_pass(agent, inference, config, greedy_sampling, 1, scheduler)
    sampled = await _run_pass(
        agent, inference, config, config.sampling, config.samples_per_prompt, scheduler
    )

    def reward(r) -> float:
        return 0.0 if r.is_placeholder else r.reward

    correct = [
        sum(1 for r in g.rollouts if not r.is_placeholder and r.reward >= config.correct_threshold)
        for g in sampled
    ]
    return EnvEvaluation(
        env_id=agent.env_id,
        greedy_reward=statistics.fmean(reward(g.rollouts[0]) for g in greedy),
        sample_reward=statistics.fmean(reward(r) for g in sampled for r in g.rollouts),
        pass_at_k={k: mean_pass_at_k(correct, config.samples_per_prompt, k) for k in config.pass_k},
        failed=sum(r.is_placeholder for g in (*greedy, *sampled) for r in g.rollouts),
    )


async def _run_pass(
    agent: Agent,
    inference: InferenceInterface,
    config: EvalConfig,
    sampling: SamplingParams,
    group_size: int,
    scheduler: BatchScheduler | None,
) -> list[RolloutGroup]:
    """One group per held-out problem, all submitted at once and announced to the scheduler."""
    seed = derive_seed(config.seed, EVAL_STREAM)
    requests = [
        GroupedRolloutRequest(
            batch_id=i,
            index_in_batch=0,
            groups_in_batch=1,
            group_size=group_size,
            seed=seed,
            submission_policy_version=0,
            sampling=sampling,
            eval_prompts=config.num_prompts,
        )
        for i in range(config.num_prompts)
    ]
    if scheduler is not None:
        for request in requests:
            expected = agent.expected_requests(request)
            if expected:
                scheduler.expect_group(request.batch_id, 0, expected)

    async def run(request: GroupedRolloutRequest) -> RolloutGroup:
        try:
            return await agent.group_rollout(request, inference)
        finally:
            if scheduler is not None:
                scheduler.group_done(request.batch_id, 0)

    return await gather_all(*(run(r) for r in requests))
