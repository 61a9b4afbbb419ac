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

With a held-out split (``agent/dataset.py``, ``--val-split-fraction``) a file-backed environment's
held-out set is its validation partition instead: problem i is validation problem i, each one
once (up to ``num_prompts`` of them), never a training problem.

Besides rewards, each pass reports response lengths (generated tokens per rollout, mean and max)
and the share of truncated rollouts (whose last generated token is no stop token: the budget ran
out), and ``EnvEvaluation.records`` keeps every rollout (prompt, response, reward) for a dump.

Requests are keyed and announced like training groups, so with a ``BatchScheduler`` (the engine)
the schedule, and so every token, is deterministic. Environment failures (placeholder rollouts)
count as incorrect with reward 0 and are reported in ``failed``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from megatron.rl.agent.api import Agent
from megatron.rl.agent.dataset import DatasetEnvironment
from megatron.rl.async_utils import gather_all
from megatron.rl.eval.passk import mean_pass_at_k
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import BatchScheduler
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, SamplingParams, TokenRollout

EVAL_STREAM = 0x6576616C  # "eval": keeps the held-out prompts apart from the training prompts


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation measures."""

    num_prompts: int
    """Held-out problems per environment."""
    samples_per_prompt: int
    """n: sampled rollouts per problem for pass@k."""
    pass_k: tuple[int, ...]
    """The k of pass@k to report (each 1 <= k <= n)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling of the pass@k rollouts (the greedy pass uses the same with temperature 0)."""
    correct_threshold: float = field(kw_only=True)
    """A rollout is correct when its reward is >= this."""
    seed: int = field(kw_only=True)
    """The run seed; the held-out set is drawn from ``derive_seed(seed, EVAL_STREAM)``."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a generation (EOS, the tokenizer's extra stop ids): a rollout whose last
    generated token is none of them was truncated."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.samples_per_prompt < 1:
            raise ValueError("num_prompts and samples_per_prompt must be >= 1")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= {self.samples_per_prompt}, got {bad}")


@dataclass(frozen=True)
class ResponseLengths:
    """Generated tokens per rollout of one pass (placeholders left out)."""

    mean: float
    max: int
    truncated_fraction: float
    """Share of the rollouts whose last generated token is no stop token."""


@dataclass(frozen=True)
class EnvEvaluation:
    """Scores of one environment on its held-out set."""

    env_id: str
    greedy_reward: float
    sample_reward: float
    pass_at_k: dict[int, float]
    failed: int
    """Rollouts that were placeholders (environment errors), both passes."""
    prompts: int = 0
    """Problems evaluated."""
    greedy_lengths: ResponseLengths = ResponseLengths(0.0, 0, 0.0)
    sample_lengths: ResponseLengths = ResponseLengths(0.0, 0, 0.0)
    records: list[dict] = field(default_factory=list)
    """One per rollout, both passes: ``eval_record``."""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of this environment's two passes (environments are evaluated in turn); not
    part of the result's equality."""


def truncated(rollout: TokenRollout, stop_token_ids: tuple[int, ...]) -> bool:
    """Whether the rollout's last generated token is no stop token (its budget ran out)."""
    generated = [t for t, m in zip(rollout.tokens, rollout.generation_mask) if m]
    return not generated or generated[-1] not in stop_token_ids


def response_lengths(
    groups: list[RolloutGroup], stop_token_ids: tuple[int, ...]
) -> ResponseLengths:
    """Length statistics of the non-placeholder rollouts of ``groups``."""
    real = [r for g in groups for r in g.rollouts if not r.is_placeholder]
    if not real:
        return ResponseLengths(0.0, 0, 0.0)
    lengths = [sum(r.generation_mask) for r in real]
    cut = sum(truncated(r, stop_token_ids) for r in real)
    return ResponseLengths(statistics.fmean(lengths), max(lengths), cut / len(real))


def eval_record(
    env_id: str, pass_name: str, group: RolloutGroup, sample: int, stop_token_ids: tuple[int, ...]
) -> dict:
    """One rollout of an evaluation as a JSON-able record (the dump's line); with reward
    functions (``reward_funcs``), each one's value under ``reward_components``."""
    r = group.rollouts[sample]
    components = {} if r.reward_components is None else {"reward_components": r.reward_components}
    return {
        "env_id": env_id,
        "pass": pass_name,
        "problem": group.batch_id,
        "sample": sample,
        "problem_id": r.problem_id,
        "prompt": r.prompt,
        "response": r.completion,
        "reward": 0.0 if r.is_placeholder else r.reward,
        "response_tokens": sum(r.generation_mask),
        "truncated": truncated(r, stop_token_ids),
        "error": r.error,
        **components,
    }


def held_out_prompts(agent: Agent, config: EvalConfig) -> int:
    """Problems evaluated: ``num_prompts``, or at most that many of a held-out partition."""
    if isinstance(agent, DatasetEnvironment) and agent.validation_indices:
        return min(config.num_prompts, len(agent.validation_indices))
    return config.num_prompts


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

    def put(name: str, values: list[float], reduce=statistics.fmean) -> None:
        metrics[f"eval/{name}"] = reduce(values)
        if len(results) > 1:
            for r, v in zip(results, values):
                metrics[f"eval/{name}/{r.env_id}"] = v

    put("greedy_reward", [r.greedy_reward for r in results])
    put("sample_reward", [r.sample_reward for r in results])
    for k in sorted(results[0].pass_at_k):
        put(f"pass@{k}", [r.pass_at_k[k] for r in results])
    put("prompts", [r.prompts for r in results], sum)
    for name in ("greedy", "sample"):
        lengths = [getattr(r, f"{name}_lengths") for r in results]
        put(f"{name}_response_length_mean", [x.mean for x in lengths])
        put(f"{name}_response_length_max", [x.max for x in lengths], max)
        put(f"{name}_truncated_fraction", [x.truncated_fraction for x in lengths])
    metrics["eval/failed"] = float(sum(r.failed for r in results))
    return metrics


async def _evaluate_one(
    agent: Agent,
    inference: InferenceInterface,
    config: EvalConfig,
    scheduler: BatchScheduler | None,
) -> EnvEvaluation:
    start = time.perf_counter()
    greedy_sampling = config.sampling.model_copy(update={"temperature": 0.0})
    prompts = held_out_prompts(agent, config)
    greedy = await _run_pass(agent, inference, config, greedy_sampling, 1, scheduler, prompts)
    sampled = await _run_pass(
        agent, inference, config, config.sampling, config.samples_per_prompt, scheduler, prompts
    )
    stops = config.stop_token_ids

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
        prompts=prompts,
        greedy_lengths=response_lengths(greedy, stops),
        sample_lengths=response_lengths(sampled, stops),
        records=[
            eval_record(agent.env_id, name, g, k, stops)
            for name, groups in (("greedy", greedy), ("sample", sampled))
            for g in groups
            for k in range(len(g.rollouts))
        ],
        seconds=time.perf_counter() - start,
    )


async def _run_pass(
    agent: Agent,
    inference: InferenceInterface,
    config: EvalConfig,
    sampling: SamplingParams,
    group_size: int,
    scheduler: BatchScheduler | None,
    num_prompts: int,
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
            eval_prompts=num_prompts,
        )
        for i in range(num_prompts)
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
