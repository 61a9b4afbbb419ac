"""The GRPO training loop: collect -> advantages -> train step -> log -> checkpoint.

Every rank runs this loop. Rank 0 also owns the rollout pipeline (agents, forced-lag generator,
inference engine, and the inference server when remote environments need it) inside
``RolloutSource``; the other ranks take part in its engine steps. Rank 0 writes each collection's
rollouts to the data plane (``--rl-data-plane``) and every rank fetches only its shard by key.
Flags become typed configs in ``config.py``; the device picks the ``Tier`` that builds the model,
optimizer, engine and checkpoint shards, and the ``Policy`` (``policy.py``) through which the loop
computes pi_old and pi_ref and trains.

Optional pieces, each off by default: dynamic sampling picks the groups a step trains on
(``collection.training_groups``; ``megatron/rl/grpo/filtering.py``), the advantages' baseline and scale and
the overlong reward shaping (``advantages_of``; ``megatron/rl/grpo/advantages/``,
``overlong.py``), loss terms, IS correction, repeated updates and packing shape the step
(``step.py``), and evaluation runs on its own engine between steps (``evaluator.py``).

Each phase of the run (start-up, a step, an evaluation, a checkpoint save, the end) runs in a
``with watchdog.phase(...)`` block (``runtime/watchdog.py``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron.rl.agent.api import Agent
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.dataplane import DataPlane, make_data_plane
from megatron.rl.dataplane.batches import publish_groups
from megatron.rl.grpo.batch import ShapedAdvantages, shaped_advantages
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import RolloutGroup
from megatron.trainer import config
from megatron.trainer.checkpoint.directory import (
    Checkpoint,
    LoadOptions,
    TrainState,
    load_checkpoint,
)
from megatron.trainer.errors import NonFiniteUpdate, UsageError
from megatron.trainer.flags import run_file
from megatron.trainer.flags.rollouts import env_config_problems
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.flags.streaming import forced_lag, logged_lag
from megatron.trainer.generation.evaluator import Evaluator, eval_agents, hold_out_validation
from megatron.trainer.generation.remote import RemoteRollouts
from megatron.trainer.generation.rollouts import CollectedBatch, PipelineStart, RolloutSource
from megatron.trainer.inference_ranks import generate_only
from megatron.trainer.metrics import report
from megatron.trainer.metrics.record import ConstantRewardWarning, MetricsWriter, step_metrics
from megatron.trainer.model.hf_io import save_hf, weight_loader
from megatron.trainer.model.lora import save_lora
from megatron.trainer.model.provider import architecture
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import (
    initialize_distributed,
    main_rank_value,
    raise_agreed_failure,
    shutdown_distributed,
)
from megatron.trainer.runtime.watchdog import Watchdog
from megatron.trainer.stopping import end_of_collection, stop_on_signals
from megatron.trainer.tiers import Tier, select_tier
from megatron.trainer.tiers.reference import build_reference_model
from megatron.trainer.tiers.teacher import build_teacher_model
from megatron.trainer.train.collection import KeyedCollection, training_groups
from megatron.trainer.train.policy import Policy, PolicyConfig
from megatron.trainer.train.seq_logprob_error import apply_seq_logprob_error
from megatron.trainer.train.step import StepConfig, StepResult


@dataclass
class Run:
    """What the loop trains with, built once per process (``build_run``)."""

    cfg: RunConfig
    ctx: ParallelContext
    tier: Tier
    tokenizer: Tokenizer
    step_config: StepConfig
    state: TrainState
    policy: Policy
    """Every forward and update of training goes through it."""
    resumed: Checkpoint
    """Where the run starts (``--load``): iteration 0 and no pipeline for a new run."""
    plane: DataPlane
    """Where each collection's samples live (``--rl-data-plane``)."""

    @property
    def k(self) -> int:
        """Training iterations per collection."""
        return self.cfg.iterations_per_collection

    @property
    def micro_batches(self) -> int:
        """Micro-batches of one global batch on this data-parallel rank."""
        return self.cfg.training.global_batch_size // (
            self.cfg.training.micro_batch_size * self.ctx.dp_size
        )

    def collection(self, collected: CollectedBatch) -> tuple[KeyedCollection, dict[str, Any]]:
        """The collection of a batch (dynamic sampling and advantages on rank 0, which writes its
        samples to the data plane; pi_old; the sequence-level logprob error mask) and its metrics
        (rank 0; collective)."""
        meta, extra, failure = None, {}, None
        if self.ctx.is_main:
            try:
                sampling = config.dynamic_sampling_config(self.cfg)
                groups, extra = training_groups(collected.batch.groups, sampling)
                shaped = advantages_of(self.cfg, groups)
                meta = publish_groups(
                    self.plane,
                    groups,
                    collected.batch.batch_id,
                    advantages=shaped.advantages,
                    masked=shaped.masked,
                )
                extra.update(shaped.metrics)
            except Exception as exc:  # every rank stops here instead of waiting for the meta
                failure = exc
        raise_agreed_failure(failure)
        meta = self.plane.share(meta)
        collection = KeyedCollection(
            self.plane,
            meta,
            self.cfg.training.global_batch_size,
            self.k,
            self.ctx,
            self.tokenizer.pad_id,
        )
        collection.prepare(self.policy, self.step_config)
        error_config = config.seq_logprob_error_config(self.cfg)
        if error_config is not None:  # pi_old vs the engine's logprobs; masks rows above X
            rewarded = collection.rewarded()
            extra.update(apply_seq_logprob_error(collection, rewarded, self.policy, error_config))
        return collection, extra

    def train_step(self, collection: KeyedCollection, iteration: int) -> StepResult:
        """One optimizer update on this rank's shard of iteration ``iteration``'s global batch;
        its logprobs are written back, and the collection's partition cleared after its last."""
        j = iteration % self.k
        batch, caches = collection.global_batch(j), collection.caches(j, self.micro_batches)
        loss = collection.loss(j, self.step_config)
        try:
            (result,) = self.policy.train(batch, loss, caches=caches)
        except NonFiniteUpdate as exc:  # --check-for-nan-in-loss-and-grad: nothing was applied
            raise NonFiniteUpdate(f"step {iteration}: {exc}") from None
        collection.write_back(j, self.step_config, self.cfg.training.micro_batch_size)
        if j == self.k - 1:
            collection.finish()
        return result


def build_run(cfg: RunConfig, ctx: ParallelContext) -> Run:
    """Tier, tokenizer, model (``--hf-checkpoint``), reference, teacher, optimizer, ``--load``."""
    tier = select_tier(config.tier_config(cfg), ctx)  # CPU or CUDA: model, optimizer, ...
    tokenizer = config.tokenizer(cfg)
    step_config = config.step_config(cfg, tokenizer.vocab_size)
    model = tier.build_model(tokenizer.vocab_size, weight_loader(tier.config.model))
    reference = build_reference_model(  # before --load overwrites the initial weights
        tier, model, tokenizer.vocab_size, step_config.needs_reference
    )
    teacher = build_teacher_model(tier, tokenizer.vocab_size)  # --distill-teacher
    state = TrainState(model, *tier.build_optimizer(model))
    policy = tier.build_policy(state, PolicyConfig.of(step_config), reference, teacher)
    resumed = Checkpoint(iteration=0, pipeline=None)
    if cfg.checkpointing.load:
        shards, options = tier.checkpoint_shards(), LoadOptions.of(cfg)
        resumed = load_checkpoint(
            cfg.checkpointing.load, shards, state, cfg, ctx, options, cfg.checkpointing.ckpt_step
        )
    plane = make_data_plane(cfg.rollouts.data_plane, ctx.rank, ctx.world_size, ctx.device)
    return Run(cfg, ctx, tier, tokenizer, step_config, state, policy, resumed, plane)


def train(cfg: RunConfig, missing_kernels: set[str] = frozenset()) -> None:
    """Run GRPO for ``--train-iters`` iterations (resuming from ``--load`` if given).

    ``missing_kernels``: kernel packages megatron-core said are missing (the header names them).
    """
    started = time.monotonic()
    agent = load_agent(cfg)
    ctx = initialize_distributed(cfg)
    if ctx.generates_only:  # --refit-mode non-collocated: an inference rank
        return generate_only(cfg, ctx, agent)
    cfg = dataclasses.replace(cfg, started=main_rank_value(cfg.started))  # one name everywhere
    watchdog = start_watchdog(cfg, ctx)
    writer = evaluator = run = None
    try:
        run = build_run(cfg, ctx)
        print_header(run, agent, missing_kernels)
        writer = metrics_writer(cfg, run.resumed.iteration) if ctx.is_main else None
        evaluator = build_evaluator(run, agent)
        if evaluator is not None:
            watchdog.watch_loop(evaluator.host.loop)
        at_start = {}
        if cfg.evaluation.val_at_start and run.resumed.iteration < cfg.training.train_iters:
            with watchdog.phase("the evaluation before the first step"):  # before any update
                at_start = evaluator.run(policy_version=run.resumed.iteration)
            at_start = {k.replace("eval/", "eval_at_start/", 1): v for k, v in at_start.items()}
        pipeline = watchdog.phase("the rollout pipeline's start or shutdown")
        with pipeline, rollout_source(run, agent, watchdog) as rollouts:  # steps: phases too
            watchdog.watch_loop(rollouts.host and rollouts.host.loop)
            stop_on_signals(rollouts)
            train_steps(run, rollouts, evaluator, writer, at_start, watchdog)
        with watchdog.phase("the end of the run (--save-hf, --save-lora, summary)"):
            save_outputs(run)
            if writer is not None:
                print_summary(run, writer, time.monotonic() - started)
    finally:
        with watchdog.phase("the run's shutdown"):
            if evaluator is not None:
                evaluator.close()
            if writer is not None:
                writer.close()
            if run is not None:
                run.plane.close()
            shutdown_distributed()
        watchdog.close()


def train_steps(
    run: Run,
    rollouts: RolloutSource,
    evaluator: Evaluator | None,
    writer: MetricsWriter | None,
    at_start: dict[str, Any],
    watchdog: Watchdog,
) -> None:
    """The steps from ``run.resumed`` to ``--train-iters`` (or ``--exit-interval``, or a signal),
    each a phase of ``watchdog``: collect, train, evaluate, log, checkpoint. ``at_start``: the
    ``--val-at-start`` metrics, logged with the first step."""
    cfg = run.cfg
    constant_rewards = ConstantRewardWarning() if run.ctx.is_main else None
    for iteration in range(run.resumed.iteration, cfg.training.train_iters):
        with watchdog.phase(f"step {iteration}"):  # after a collective: every rank alike
            t0 = time.perf_counter()
            if iteration % run.k == 0:  # collect (ordered, forced lag) -> advantages, pi_old
                collected = rollouts.next_batch()
                if constant_rewards is not None:  # rank 0: warns in the first batches only
                    for line in constant_rewards.check(collected.batch):
                        print(line, flush=True)
                collection, extra = run.collection(collected)
            result = run.train_step(collection, iteration)  # one optimizer update
            refit = rollouts.new_policy(iteration + 1)  # the inference copy's refit, if any
            elapsed, metrics = time.perf_counter() - t0, {**extra, **at_start, **refit}
            at_start = {}  # the first step's record only
            if evaluation_due(cfg, iteration + 1):  # own engine and window
                with watchdog.phase(f"the evaluation after step {iteration}"):
                    metrics.update(evaluator.run(policy_version=iteration + 1))
            if writer is not None:  # log
                record = step_metrics(
                    iteration, logged_lag(cfg), collected, result, elapsed, metrics, run.k
                )
                writer.write(record)
            stop = rollouts.stop_requested()  # a signal on any rank (collective)
            if end_of_collection(run, iteration + 1, rollouts, stop, watchdog):
                return  # --exit-interval


def save_outputs(run: Run) -> None:
    """``--save-hf`` (the policy as a Hugging Face directory) and ``--save-lora`` (the adapters
    as a PEFT directory); collective."""
    cfg, spec = run.cfg, run.tier.config.model
    if cfg.model.save_hf is not None:
        arch = architecture(spec, run.tokenizer.vocab_size)
        rows = cfg.hf.vocab_size if cfg.hf else run.tokenizer.vocab_size
        save_hf(spec, run.state.model, arch, rows, run.ctx)
    if cfg.lora.save_lora is not None:
        save_lora(cfg.lora.save_lora, run.state.model, spec, run.ctx)


def print_summary(run: Run, writer: MetricsWriter, seconds: float) -> None:
    """The curves' plot and the run's summary (rank 0)."""
    cfg = run.cfg
    path = report.plot_file(cfg)
    plot = report.write_curves(writer.records, path) if path else None
    print(report.summary(writer.records, forced_lag(cfg), seconds, cfg, plot), flush=True)


def start_watchdog(cfg: RunConfig, ctx: ParallelContext) -> Watchdog:
    """The watchdog of ``--watchdog-timeout-minutes`` (off at 0), watching start-up. Its stacks
    files go next to ``--metrics-file``, else into ``runs/`` (as the curves' default)."""
    directory = Path(cfg.logging.metrics_file).parent if cfg.logging.metrics_file else Path("runs")
    minutes = cfg.training.watchdog_timeout_minutes
    watchdog = Watchdog(minutes * 60, directory, cfg.started, ctx.rank)
    watchdog.start("start-up (model build and load)")
    return watchdog


def print_header(run: Run, agent: Agent, missing_kernels: set[str]) -> None:
    """What runs, where it writes (rank 0; counting the parameters is collective)."""
    parameters = report.parameter_count(run.state.model, run.ctx.tp_group)
    trainable = report.parameter_count(run.state.model, run.ctx.tp_group, trainable=True)
    if run.ctx.is_main:
        arch = architecture(run.tier.config.model, run.tokenizer.vocab_size)
        text = report.header(
            run.cfg,
            arch,
            parameters,
            run.tokenizer,
            agent,
            run.tier.describe(),
            missing_kernels,
            report.plot_file(run.cfg),
            trainable,
        )
        print(text, flush=True)


def build_evaluator(run: Run, agent: Agent) -> Evaluator | None:
    """The evaluation engine of ``--eval-interval`` / ``--eval-iters`` (None when off)."""
    if not run.cfg.evaluation.requested:
        return None
    cfg, ctx = run.cfg, run.ctx
    dump = cfg.evaluation.val_dump_dir
    return Evaluator(
        ctx,
        run.tier,
        run.state.model,
        run.tokenizer,
        agent if ctx.is_main else None,
        config.eval_config(cfg, run.tokenizer),
        config.scheduler_config(cfg, ctx.dp_size, run.tokenizer, training=False),
        None if dump is None else Path(dump),
    )


def rollout_source(run: Run, agent: Agent, watchdog: Watchdog) -> RolloutSource | RemoteRollouts:
    """The rollout pipeline, continuing ``run.resumed`` (``--refit-mode non-collocated``: the
    inference ranks', through ``RemoteRollouts``)."""
    ctx, resumed = run.ctx, run.resumed
    start = PipelineStart(
        first_batch=resumed.iteration // run.k,
        policy_version=resumed.iteration,
        state=resumed.pipeline,
        kv=resumed.inflight_kv,
    )
    if run.cfg.inference_ranks:
        return RemoteRollouts(ctx, run.state.model, start, run.cfg.parallelism, watchdog)
    pipeline = config.pipeline_config(run.cfg, ctx.dp_size, run.tokenizer)
    agent_here = agent if ctx.is_main else None
    return RolloutSource(ctx, run.tier, run.state.model, run.tokenizer, agent_here, pipeline, start)


def evaluation_due(cfg: RunConfig, iteration: int) -> bool:
    """Evaluate after ``iteration`` iterations: every ``--eval-interval`` and, with
    ``--eval-iters`` > 0 or ``--val-at-end``, after the last one."""
    if cfg.evaluation.interval is not None and iteration % cfg.evaluation.interval == 0:
        return True
    return (
        cfg.evaluation.iters > 0 or cfg.evaluation.val_at_end
    ) and iteration == cfg.training.train_iters


def advantages_of(cfg: RunConfig, groups: list[RolloutGroup]) -> ShapedAdvantages:
    """The advantages of ``--adv-estimator`` / ``--scale-rewards`` after the overlong reward
    shaping (``--overlong-buffer-len``, ``--mask-truncated-completions``), with their metrics
    (rank 0); GRPO's own advantages without shaping log no metrics (the default run's log)."""
    estimator, overlong = config.advantage_config(cfg), config.overlong_config(cfg)
    shaped = shaped_advantages(groups, estimator, overlong)
    if estimator.is_grpo and overlong is None:
        return replace(shaped, metrics={})
    return shaped


def load_agent(cfg: RunConfig) -> Agent:
    """The env-config's agents; a bad config, or one the flags do not fit, exits with status 2
    (``UsageError``) before anything is built."""
    try:
        agent = load_env_config(cfg.rollouts.env_config)
    except EnvConfigError as err:
        raise UsageError(f"pretrain_grpo.py: error: --env-config: {err}") from None
    errors = env_config_problems(cfg.rollouts.env_config, cfg.model.seq_length, agent)
    if errors:
        raise UsageError("pretrain_grpo.py: error: invalid arguments:\n  " + "\n  ".join(errors))
    if cfg.evaluation.requested:
        eval_agents(agent)  # refuses remote environments on every rank, before any collective
    if cfg.evaluation.val_split_fraction > 0:  # the same split on every rank (data alone)
        hold_out_validation(agent, cfg.evaluation.val_split_fraction)
    return agent


def metrics_writer(cfg: RunConfig, first_step: int) -> MetricsWriter:
    """Log line, JSONL, TensorBoard and wandb outputs of the flags (a resumed run starts at
    first_step); the run's resolved options go next to the JSONL (``flags/run_file.py``)."""
    log = cfg.logging
    if log.metrics_file is not None:
        run_file.write(run_file.resolved(cfg), run_file.next_to_metrics(log.metrics_file))
    return MetricsWriter(
        cfg.training.train_iters,
        cfg.training.log_interval,
        log.metrics_file,
        log.tensorboard_dir,
        first_step,
        config.wandb_config(cfg),
    )
