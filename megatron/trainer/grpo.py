"""The GRPO training loop: collect -> advantages -> train step -> log -> checkpoint.

Every rank runs this loop. Rank 0 also owns the rollout pipeline (agents, forced-lag generator,
inference engine, and the inference server when remote environments need it) inside
``RolloutSource``; the other ranks take part in its engine steps and receive each batch from it.
Flags become typed configs in ``config.py``; the device picks the ``Tier`` that builds the model,
optimizer, train step, engine and checkpoint shards.

Optional pieces, each off by default: dynamic sampling picks the groups a step trains on
(``training_groups``; ``megatron/rl/grpo/filtering.py``), loss terms, IS correction, repeated
updates and packing shape the step (``step.py``), and evaluation runs on its own engine between
steps (``evaluation.py``).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

from megatron.rl.agent.api import Agent
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.grpo.batch import build_train_batch
from megatron.rl.grpo.filtering import DynamicSamplingExhausted, select_groups
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import RolloutGroup
from megatron.trainer import config
from megatron.trainer.checkpointing import (
    Checkpoint,
    TrainState,
    load_checkpoint,
    save_checkpoint,
)
from megatron.trainer.evaluation import Evaluator, eval_agents
from megatron.trainer.initialize import initialize_distributed, shutdown_distributed
from megatron.trainer.metrics import MetricsWriter, step_metrics
from megatron.trainer.reference import build_reference_model
from megatron.trainer.rollouts import CollectedBatch, RolloutSource
from megatron.trainer.tiers import select_tier


def train(args: argparse.Namespace) -> None:
    """Run GRPO for ``--train-iters`` steps (resuming from ``--load`` if given)."""
    agent = load_agent(args)
    ctx = initialize_distributed(args)
    writer = evaluator = None
    try:
        tier = select_tier(args, ctx)  # CPU or CUDA: model, optimizer, step, engine, checkpoints
        tokenizer = CharTokenizer()
        step_config = config.step_config(args, tokenizer.vocab_size)
        model = tier.build_model(tokenizer.vocab_size)
        reference = build_reference_model(  # before --load overwrites the initial weights
            args, model, tokenizer.vocab_size, ctx, step_config.needs_reference
        )
        state = TrainState(model, *tier.build_optimizer(model))
        resumed = Checkpoint(iteration=0, pipeline=None)
        if args.load:
            shards = tier.checkpoint_shards()
            resumed = load_checkpoint(args.load, shards, state, args, ctx, args.ckpt_step)
        if ctx.is_main:
            print(tier.describe(), flush=True)
        writer = metrics_writer(args, resumed.iteration) if ctx.is_main else None
        rank0_agent = agent if ctx.is_main else None
        if args.eval_interval is not None:
            eval_engine = config.scheduler_config(args, ctx.dp_size, tokenizer.eos_id, False)
            evaluator = Evaluator(
                ctx, tier, model, tokenizer, rank0_agent, config.eval_config(args), eval_engine
            )
        with RolloutSource(
            ctx, tier, model, tokenizer, rank0_agent, config.rollout_config(args),
            config.scheduler_config(args, ctx.dp_size, tokenizer.eos_id), resumed.iteration,
            config.inference_server_config(args),
            resumed.pipeline, config.failure_budget(args), stop_cancels_window=not args.save,
        ) as rollouts:  # fmt: skip
            stop_on_signals(rollouts)
            for step in range(resumed.iteration, args.train_iters):
                t0 = time.perf_counter()
                collected = rollouts.next_batch()  # collect (ordered, forced lag)
                groups, extra = training_groups(args, collected)  # dynamic sampling (if on)
                batch = build_train_batch(groups, tokenizer.pad_id)  # advantages
                result = tier.train_step(state, batch, step_config, reference)  # train step
                rollouts.policy_version = step + 1
                elapsed = time.perf_counter() - t0
                if evaluator is not None and (step + 1) % args.eval_interval == 0:
                    extra.update(evaluator.run(policy_version=step + 1))  # own engine and window
                if writer is not None:  # log
                    m = step_metrics(step, args.rl_forced_lag, collected, result, elapsed, extra)
                    writer.write(m)
                stop = rollouts.stop_requested()  # a signal on any rank (collective)
                if checkpoint_due(args, step + 1) or (stop and args.save):  # after draining
                    pipeline = rollouts.drain()
                    shards = tier.checkpoint_shards()
                    save_checkpoint(args.save, step + 1, shards, state, pipeline, args, ctx)
                if stop:
                    if ctx.is_main:
                        saved = f", saved iteration {step + 1} to {args.save}" if args.save else ""
                        name = signal.Signals(stop).name
                        print(f"{name}: stopped after step {step}{saved}", flush=True)
                    raise SystemExit(128 + stop)
    finally:
        if evaluator is not None:
            evaluator.close()
        if writer is not None:
            writer.close()
        shutdown_distributed()


def training_groups(
    args: argparse.Namespace, collected: CollectedBatch
) -> tuple[list[RolloutGroup], dict[str, Any]]:
    """The groups the step trains on, and the dynamic-sampling metrics (every rank alike)."""
    groups = collected.batch.groups
    sampling = config.dynamic_sampling_config(args)
    if sampling is None:
        return groups, {}
    try:
        chosen = select_groups(groups, sampling, collected.batch.batch_id)
    except DynamicSamplingExhausted as err:
        raise SystemExit(f"pretrain_grpo.py: error: {err}") from None
    kept = [r.reward for g in chosen.groups for r in g.rollouts if not r.is_placeholder]
    return chosen.groups, {
        "dynamic_sampling_rounds": chosen.rounds_used,
        "dynamic_sampling_dropped_groups": chosen.dropped,
        "dynamic_sampling_generated_groups": len(groups),
        "dynamic_sampling_kept_reward_mean": sum(kept) / max(len(kept), 1),
    }


def load_agent(args: argparse.Namespace) -> Agent:
    """The env-config's agents; a bad config exits before anything is built."""
    try:
        agent = load_env_config(args.env_config)
    except EnvConfigError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --env-config: {err}") from None
    if args.eval_interval is not None:
        eval_agents(agent)  # refuses remote environments on every rank, before any collective
    return agent


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

    Without ``--save`` the generation window in progress is cancelled and the run stops at once;
    with it the current step finishes, the pipeline is drained and a checkpoint saved first. The
    handler only records the request (an exception raised from a signal handler could land in
    any asyncio task, e.g. an HTTP handler that would swallow it); the loop (or ``RolloutSource``)
    raises ``SystemExit`` and leaving its context shuts the pipeline down.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, frame: rollouts.request_stop(s))
