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
from megatron.rl.grpo.filtering import select_groups
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import RolloutGroup
from megatron.trainer import config
from megatron.trainer.checkpointing import (
    Checkpoint,
    LoadOptions,
    TrainState,
    load_checkpoint,
    save_checkpoint,
)
from megatron.trainer.collection import Collection
from megatron.trainer.evaluation import Evaluator, eval_agents
from megatron.trainer.initialize import initialize_distributed, shutdown_distributed
from megatron.trainer.metrics import MetricsWriter, step_metrics
from megatron.trainer.reference import build_reference_model
from megatron.trainer.rollouts import CollectedBatch, InferenceServerConfig, RolloutSource
from megatron.trainer.tiers import select_tier


def train(args: argparse.Namespace) -> None:
    """Run GRPO for ``--train-iters`` iterations (resuming from ``--load`` if given)."""
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
            shards, options = tier.checkpoint_shards(), LoadOptions.of(args)
            resumed = load_checkpoint(args.load, shards, state, args, ctx, options)
        if ctx.is_main:
            print(tier.describe(), flush=True)
        writer = metrics_writer(args, resumed.iteration) if ctx.is_main else None
        rank0_agent = agent if ctx.is_main else None
        if evaluation_on(args):
            eval_engine = config.scheduler_config(args, ctx.dp_size, tokenizer.eos_id, False)
            evaluator = Evaluator(
                ctx, tier, model, tokenizer, rank0_agent, config.eval_config(args), eval_engine
            )
        k = args.iterations_per_collection
        with RolloutSource(
            ctx, tier, model, tokenizer, rank0_agent, config.rollout_config(args),
            config.scheduler_config(args, ctx.dp_size, tokenizer.eos_id), resumed.iteration // k,
            InferenceServerConfig(args.rl_inference_server_host, args.rl_inference_server_port),
            resumed.pipeline, policy_version=resumed.iteration,
        ) as rollouts:  # fmt: skip
            stop_on_signals(rollouts)
            micro_batches = args.global_batch_size // (args.micro_batch_size * ctx.dp_size)
            for iteration in range(resumed.iteration, args.train_iters):
                t0 = time.perf_counter()
                if iteration % k == 0:  # collect (ordered, forced lag), advantages, pi_old
                    collected = rollouts.next_batch()
                    groups, extra = training_groups(args, collected)  # dynamic sampling (if on)
                    batch = build_train_batch(groups, tokenizer.pad_id)
                    collection = Collection(batch, args.global_batch_size, k)
                    collection.prepare(tier, state, step_config, micro_batches)
                j = iteration % k
                result = tier.train_step(  # train step: one optimizer update
                    state, collection.global_batch(j), step_config, reference,
                    collection.caches(j, micro_batches),
                )  # fmt: skip
                rollouts.policy_version = iteration + 1
                elapsed = time.perf_counter() - t0
                metrics = dict(extra)
                if evaluation_due(args, iteration + 1):  # own engine and window
                    metrics.update(evaluator.run(policy_version=iteration + 1))
                if writer is not None:  # log
                    m = step_metrics(
                        iteration, args.rl_forced_lag, collected, result, elapsed, metrics, k
                    )
                    writer.write(m)
                if (iteration + 1) % k == 0 and end_of_collection(args, ctx, iteration + 1,
                                                                  tier, state, rollouts):  # fmt: skip
                    break
    finally:
        if evaluator is not None:
            evaluator.close()
        if writer is not None:
            writer.close()
        shutdown_distributed()


def end_of_collection(args, ctx, iteration: int, tier, state, rollouts) -> bool:
    """Checkpoint (after draining the pipeline) when due; whether ``--exit-interval`` ends the
    run here."""
    exiting = args.exit_interval is not None and iteration % args.exit_interval == 0
    if checkpoint_due(args, iteration) or (exiting and args.save):
        pipeline = rollouts.drain()
        save_checkpoint(args.save, iteration, tier.checkpoint_shards(), state, pipeline, args, ctx)
    return exiting


def evaluation_on(args: argparse.Namespace) -> bool:
    """Whether the run evaluates (``--eval-interval`` or ``--eval-iters`` > 0)."""
    return args.eval_interval is not None or args.eval_iters > 0


def evaluation_due(args: argparse.Namespace, iteration: int) -> bool:
    """Evaluate after ``iteration`` iterations: every ``--eval-interval`` and, with
    ``--eval-iters`` > 0, after the last one."""
    if args.eval_interval is not None and iteration % args.eval_interval == 0:
        return True
    return args.eval_iters > 0 and iteration == args.train_iters


def training_groups(
    args: argparse.Namespace, collected: CollectedBatch
) -> tuple[list[RolloutGroup], dict[str, Any]]:
    """The groups the step trains on, and the dynamic-sampling metrics (every rank alike)."""
    groups = collected.batch.groups
    sampling = config.dynamic_sampling_config(args)
    if sampling is None:
        return groups, {}
    chosen = select_groups(groups, sampling)
    kept = [r.reward for g in chosen.groups for r in g.rollouts if not r.is_placeholder]
    return chosen.groups, {
        "dynamic_sampling_rounds": chosen.rounds_used,
        "dynamic_sampling_dropped_groups": chosen.dropped,
        "dynamic_sampling_generated_groups": len(groups),
        "dynamic_sampling_kept_groups": chosen.kept,
        "dynamic_sampling_kept_reward_mean": sum(kept) / max(len(kept), 1),
    }


def load_agent(args: argparse.Namespace) -> Agent:
    """The env-config's agents; a bad config exits before anything is built."""
    try:
        agent = load_env_config(args.env_config)
    except EnvConfigError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --env-config: {err}") from None
    if evaluation_on(args):
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
    """Log line, JSONL, TensorBoard and wandb outputs of the flags (a resumed run starts at
    first_step)."""
    return MetricsWriter(
        args.train_iters, args.log_interval, args.metrics_file, args.tensorboard_dir, first_step,
        config.wandb_config(args),
    )  # fmt: skip


def stop_on_signals(rollouts: RolloutSource) -> None:
    """SIGTERM/SIGINT end the run at the next safe point with exit status 128 + signum.

    The handler only records the request (an exception raised from a signal handler could land in
    any asyncio task, e.g. an HTTP handler that would swallow it); ``RolloutSource`` raises
    ``SystemExit`` and leaving its context shuts the pipeline down.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, frame: rollouts.request_stop(s))
