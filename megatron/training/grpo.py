"""The GRPO training loop: collect -> advantages -> train step -> log -> checkpoint.

Every rank runs this loop. Rank 0 also owns the rollout pipeline (agents, forced-lag generator,
inference engine, and the inference server when remote environments need it) inside
``RolloutSource``; the other ranks take part in its engine steps and receive each batch from it.

Optional pieces, each off by default: dynamic sampling picks the groups a step trains on
(``training_groups``; ``megatron/rl/grpo/filtering.py``), the step options add the reference KL,
entropy, IS correction, repeated updates and packing (``train_step.py``), and evaluation runs on
its own engine between steps (``evaluation.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import signal
import threading
import time
from typing import Any

import torch

from megatron.rl.agent.api import Agent
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.grpo.batch import build_train_batch
from megatron.rl.grpo.filtering import (
    DynamicSamplingConfig,
    DynamicSamplingExhausted,
    select_groups,
)
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.inference.engine import LocalEngineConfig
from megatron.rl.rollout.generator import RolloutConfig
from megatron.rl.tokenizer import CharTokenizer, Tokenizer
from megatron.rl.wire import RolloutGroup, SamplingParams
from megatron.training.checkpointing import Checkpoint
from megatron.training.evaluation import Evaluator, eval_agents, eval_config
from megatron.training.initialize import (
    ParallelContext,
    initialize_distributed,
    shutdown_distributed,
)
from megatron.training.metrics import MetricsWriter, step_metrics
from megatron.training.reference import build_reference_model
from megatron.training.rollouts import CollectedBatch, InferenceServerConfig, RolloutSource
from megatron.training.tiers import Tier, select_tier
from megatron.training.train_step import StepOptions


def train(args: argparse.Namespace) -> None:
    """Run GRPO for ``--train-iters`` steps (resuming from ``--load`` if given)."""
    agent = load_agent(args)
    ctx = initialize_distributed(args)
    writer = evaluator = None
    try:
        tier = select_tier(args, ctx)  # CPU or CUDA: model, optimizer, step, engine, checkpoints
        tokenizer = CharTokenizer()
        model = tier.build_model(tokenizer.vocab_size)
        reference = build_reference_model(args, model, tokenizer.vocab_size, ctx)  # before --load
        optimizer, scheduler = tier.build_optimizer(model)
        resumed = Checkpoint(iteration=0, pipeline=None)
        if args.load:
            resumed = tier.load_checkpoint(args.load, model, optimizer, scheduler)
        step_fn = functools.partial(
            tier.train_step, model, optimizer, scheduler, loss_config=loss_config(args),
            vocab_size=tokenizer.vocab_size, options=step_options(args, reference),
        )  # fmt: skip
        if ctx.is_main:
            print(tier.describe(), flush=True)
        writer = metrics_writer(args, resumed.iteration) if ctx.is_main else None
        evaluator = build_evaluator(args, ctx, tier, model, tokenizer, agent)
        with rollout_source(args, ctx, tier, model, tokenizer, agent, resumed) as rollouts:
            stop_on_signals(rollouts)
            for step in range(resumed.iteration, args.train_iters):
                t0 = time.perf_counter()
                collected = rollouts.next_batch()  # collect (ordered, forced lag)
                groups, extra = training_groups(args, collected)  # dynamic sampling (if on)
                batch = build_train_batch(groups, tokenizer.pad_id)  # advantages
                result = step_fn(batch=batch)  # train step: --grpo-iterations optimizer updates
                rollouts.policy_version = step + 1
                elapsed = time.perf_counter() - t0
                extra.update(run_evaluation(args, evaluator, step + 1))  # own engine and window
                if writer is not None:  # log
                    m = step_metrics(step, args.rl_forced_lag, collected, result, elapsed, extra)
                    writer.write(m)
                if checkpoint_due(args, step + 1):  # checkpoint (after draining the pipeline)
                    state = rollouts.drain()
                    tier.save_checkpoint(args.save, step + 1, model, optimizer, scheduler, state)
    finally:
        if evaluator is not None:
            evaluator.close()
        if writer is not None:
            writer.close()
        shutdown_distributed()


def loss_config(args: argparse.Namespace) -> GRPOLossConfig:
    """Clipping and the optional KL and entropy terms of the loss."""
    return GRPOLossConfig(
        args.grpo_clamp_eps_lower,
        args.grpo_clamp_eps_upper,
        kl_beta=args.grpo_kl_beta,
        entropy_weight=args.grpo_entropy_term_weight,
    )


def step_options(args: argparse.Namespace, reference: torch.nn.Module | None) -> StepOptions:
    """Iterations, reference model, IS correction and packing of the train step."""
    importance = None
    if args.rl_inference_logprobs_is_correction:
        coef = args.rl_importance_sampling_truncation_coef
        importance = ImportanceConfig() if coef is None else ImportanceConfig(coef)
    return StepOptions(
        iterations=args.grpo_iterations,
        reference_model=reference,
        importance=importance,
        packing_capacity=args.seq_length if args.rl_use_sequence_packing else None,
    )


def generation_rounds(args: argparse.Namespace) -> int:
    """Rounds of groups generated per batch (> 1 only with dynamic sampling)."""
    return args.grpo_max_generation_rounds if args.grpo_filter_groups_with_same_reward else 1


def training_groups(
    args: argparse.Namespace, collected: CollectedBatch
) -> tuple[list[RolloutGroup], dict[str, Any]]:
    """The groups the step trains on, and the dynamic-sampling metrics (every rank alike)."""
    groups = collected.batch.groups
    if not args.grpo_filter_groups_with_same_reward:
        return groups, {}
    config = DynamicSamplingConfig(args.grpo_prompts_per_step, generation_rounds(args))
    try:
        chosen = select_groups(groups, config, collected.batch.batch_id)
    except DynamicSamplingExhausted as err:
        raise SystemExit(f"pretrain_grpo.py: error: {err}") from None
    kept = [r.reward for g in chosen.groups for r in g.rollouts if not r.is_placeholder]
    return chosen.groups, {
        "dynamic_sampling_rounds": chosen.rounds_used,
        "dynamic_sampling_dropped_groups": chosen.dropped,
        "dynamic_sampling_generated_groups": len(groups),
        "dynamic_sampling_kept_reward_mean": sum(kept) / max(len(kept), 1),
    }


def build_evaluator(
    args: argparse.Namespace,
    ctx: ParallelContext,
    tier: Tier,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    agent: Agent,
) -> Evaluator | None:
    """The evaluation engine of ``--eval-interval`` (None when evaluation is off)."""
    if args.eval_interval is None:
        return None
    return Evaluator(
        ctx,
        tier,
        model,
        tokenizer,
        agent if ctx.is_main else None,
        eval_config(args),
        engine_config(args, ctx, tokenizer),
    )


def run_evaluation(
    args: argparse.Namespace, evaluator: Evaluator | None, iteration: int
) -> dict[str, Any]:
    """Evaluate after every ``--eval-interval`` steps (collective); the eval/* metrics."""
    if evaluator is None or iteration % args.eval_interval != 0:
        return {}
    return evaluator.run(policy_version=iteration)


def engine_config(
    args: argparse.Namespace, ctx: ParallelContext, tokenizer: Tokenizer
) -> LocalEngineConfig:
    """KV-cache slots per data-parallel replica, sequence length and EOS of an engine."""
    return LocalEngineConfig(
        max_requests=args.inference_max_requests // ctx.dp_size,
        max_seq_len=args.seq_length,
        eos_id=tokenizer.eos_id,
    )


def load_agent(args: argparse.Namespace) -> Agent:
    """The env-config's agents; a bad config exits before anything is built."""
    try:
        agent = load_env_config(args.env_config)
    except EnvConfigError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --env-config: {err}") from None
    if args.eval_interval is not None:
        eval_agents(agent)  # refuses remote environments on every rank, before any collective
    return agent


def rollout_source(
    args: argparse.Namespace,
    ctx: ParallelContext,
    tier: Tier,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    agent: Agent,
    resumed: Checkpoint,
) -> RolloutSource:
    """The rollout pipeline described by the flags."""
    sampling = SamplingParams(
        temperature=args.rl_default_temperature,
        top_p=args.rl_default_top_p,
        top_k=args.rl_default_top_k,
        max_tokens=args.rl_default_max_tokens,
    )
    return RolloutSource(
        ctx,
        tier,
        model,
        tokenizer,
        agent if ctx.is_main else None,
        RolloutConfig(
            forced_lag=args.rl_forced_lag,
            groups_per_batch=args.grpo_prompts_per_step * generation_rounds(args),
            group_size=args.grpo_group_size,
            seed=args.seed,
            sampling=sampling,
        ),
        dataclasses.replace(
            engine_config(args, ctx, tokenizer), window_target=args.rl_deterministic_schedule
        ),
        first_step=resumed.iteration,
        resume_from=resumed.pipeline,
        server_config=InferenceServerConfig(
            args.rl_inference_server_host, args.rl_inference_server_port
        ),
    )


def checkpoint_due(args: argparse.Namespace, iteration: int) -> bool:
    """Whether to save after ``iteration`` steps: every ``--save-interval`` and at the end."""
    if not args.save:
        return False
    return (
        iteration == args.train_iters or iteration % (args.save_interval or args.train_iters) == 0
    )


def metrics_writer(args: argparse.Namespace, first_step: int) -> MetricsWriter:
    """Log line, JSONL and TensorBoard outputs of the flags (a resumed run starts at first_step)."""
    return MetricsWriter(
        args.train_iters, args.log_interval, args.metrics_file, args.tensorboard_dir, first_step
    )


def stop_on_signals(rollouts: RolloutSource) -> None:
    """SIGTERM/SIGINT end the run at the next safe point with exit status 128 + signum.

    The handler only records the request (an exception raised from a signal handler could land in
    any asyncio task, e.g. an HTTP handler that would swallow it); ``RolloutSource`` raises
    ``SystemExit`` and leaving its context shuts the pipeline down.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, frame: rollouts.request_stop(s))
