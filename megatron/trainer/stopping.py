"""When a run saves and stops: the checkpoint between collections (every ``--save-interval``, at
the end, and for a signal with ``--save``), ``--exit-interval``, and SIGTERM/SIGINT, which end
the run at the next safe point with exit status 128 + signum."""

from __future__ import annotations

import signal
import threading
from typing import Protocol

from megatron.trainer.checkpoint.directory import TrainState, save_captured
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.generation.rollouts import RolloutSource
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.watchdog import Watchdog
from megatron.trainer.tiers import Tier


class Run(Protocol):
    """What saving and stopping read of a run (``grpo.Run``)."""

    cfg: RunConfig
    ctx: ParallelContext
    tier: Tier
    state: TrainState

    @property
    def k(self) -> int:
        """Training iterations per collection."""


def end_of_collection(
    run: Run, iteration: int, rollouts: RolloutSource, stop: int, watchdog: Watchdog
) -> bool:
    """Between collections: checkpoint (the pipeline as it stands, ``checkpoint_state``) when due
    or when a signal came with ``--save``, then stop for that signal (``SystemExit(128 +
    signum)``); whether ``--exit-interval`` ends the run here. Mid-collection a signal stops at
    once without ``--save`` and otherwise waits for the collection's end. The save is a phase of
    ``watchdog`` (``Watchdog.phase``)."""
    cfg = run.cfg
    if iteration % run.k:
        if stop and not cfg.checkpointing.save:
            raise_stop(run, iteration, stop)
        return False
    exiting = cfg.training.exit_interval is not None and iteration % cfg.training.exit_interval == 0
    if checkpoint_due(cfg, iteration) or ((exiting or stop) and cfg.checkpointing.save):
        with watchdog.phase(f"the checkpoint save after step {iteration - 1}"):
            shards = run.tier.checkpoint_shards()
            line = save_captured(
                cfg.checkpointing.save,
                iteration,
                shards,
                run.state,
                rollouts.checkpoint_state,
                cfg,
                run.ctx,
            )
        if run.ctx.is_main:
            print(line, flush=True)
    if stop:
        raise_stop(run, iteration, stop)
    return exiting


def raise_stop(run: Run, iteration: int, signum: int) -> None:
    """Say where the run stopped for ``signum`` (rank 0) and exit with 128 + signum."""
    if run.ctx.is_main:
        saved = (
            f", saved iteration {iteration} to {run.cfg.checkpointing.save}"
            if run.cfg.checkpointing.save
            else ""
        )
        name = signal.Signals(signum).name
        print(f"{name}: stopped after step {iteration - 1}{saved}", flush=True)
    raise SystemExit(128 + signum)


def checkpoint_due(cfg: RunConfig, iteration: int) -> bool:
    """Whether to save after ``iteration`` steps: every ``--save-interval`` and at the end."""
    if not cfg.checkpointing.save:
        return False
    return (
        iteration == cfg.training.train_iters
        or iteration % (cfg.checkpointing.save_interval or cfg.training.train_iters) == 0
    )


def stop_on_signals(rollouts: RolloutSource) -> None:
    """SIGTERM/SIGINT end the run at the next safe point with exit status 128 + signum.

    Without ``--save`` the generation window in progress is cancelled and the run stops at once;
    with it the current step finishes and a checkpoint is saved first (``end_of_collection``). The
    handler only records the request (an exception raised from a signal handler could land in
    any asyncio task, e.g. an HTTP handler that would swallow it); the loop (or ``RolloutSource``)
    raises ``SystemExit`` and leaving its context shuts the pipeline down.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, frame: rollouts.request_stop(s))
