"""Training rollouts: hands each step its batch on every rank; owns the rollout pipeline on rank 0.

Rank 0's ``GenerationHost`` (``generation.py``) runs the agents, the ``GroupedRolloutGenerator``
and the inference engine (plus the inference server when remote environments need it) in its
event loop. ``next_batch`` opens a generation window until the generator hands over the next
ordered batch (on rank 0: it goes to the data plane from there, and each rank fetches only its
shard by key, ``megatron/rl/dataplane``); the other ranks execute the window's engine steps
meanwhile. When an agent needs the inference server, rank 0 starts it before the first window
and prints its line (``endpoint_line``: the bound URL and where the key came from) after
the run's header. ``checkpoint_state`` is what a checkpoint saves: the pipeline as it stands, nothing
generated for it, and each rank's KV cache of the requests in flight; on a tier whose engine
cannot save its cache it is ``drain``, a window that first finishes every submitted batch.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.rl.agent.api import Agent
from megatron.rl.auth import listen_problem
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.protocol import EngineCounters, SlotSnapshotRunner
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.inference.step_group import GenerationAborted
from megatron.rl.rollout.faults import FailureBudget
from megatron.rl.rollout.generator import (
    PipelineState,
    RolloutBatch,
    RolloutConfig,
)
from megatron.rl.rollout.group_stream import rollout_generator
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.server.limits import ServerLimits
from megatron.rl.tokenizer import Tokenizer
from megatron.trainer.checkpoint import inflight
from megatron.trainer.generation.host import GenerationHost
from megatron.trainer.generation.refit import InferenceCopy
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import main_rank_value, raise_agreed_failure
from megatron.trainer.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InferenceServerConfig:
    """Where rank 0 serves its engine to remote environments (only when an agent needs it)."""

    host: str = "127.0.0.1"
    """Interface to bind; remote environments on other hosts need 0.0.0.0 or a routable one."""
    port: int = 0
    """Port to bind (0: a free one)."""
    api_key: str | None = field(default=None, repr=False)
    """The job's shared key, required from clients (``megatron.rl.auth``); None: no key."""
    key_source: str = "none"
    """Where the key came from (``auth.api_key_source``), for the endpoint's line."""
    tool_call_parser: str = "auto"
    """How chat completions read tool calls (``--tool-call-parser``: a parser, auto or none)."""
    limits: ServerLimits = ServerLimits()
    """What one outside request and one client may take (``--rl-max-request-*``)."""


@dataclass(frozen=True)
class PipelineConfig:
    """What the training rollout pipeline runs with (``config.pipeline_config``)."""

    rollout: RolloutConfig
    """What the forced-lag generator submits, and how far ahead."""
    engine: SchedulerConfig
    """The training engine: slots per replica, sequence length, stop tokens, schedule."""
    server: InferenceServerConfig = InferenceServerConfig()
    """Where rank 0 serves its engine to remote environments (only when an agent needs it)."""
    failure_budget: FailureBudget = field(
        default_factory=lambda: FailureBudget(max_fraction=1.0, min_rollouts=0)
    )
    """The limits on failed rollouts per environment; the source counts in a copy of its own."""
    stop_cancels_window: bool = True
    """False when a stop saves a checkpoint first (``--save``): the window in progress then
    finishes and the run stops after that step."""
    inference_tp: int | None = None
    """``--rl-inference-tensor-model-parallel-size``: generate on an inference copy at this TP
    degree, refit after every optimizer step (None: on the trained model itself)."""
    verify_refit: bool = False
    """``--rl-verify-model-weights-swap``: check the copy against the trained weights after every
    refit."""


@dataclass(frozen=True)
class PipelineStart:
    """Where the pipeline starts: a new run's beginning, or what ``--load`` restored."""

    first_batch: int = 0
    """The id of the first batch it generates."""
    policy_version: int = 0
    """The policy version of the first rollouts (the iteration the run resumes at)."""
    state: PipelineState | None = None
    """The checkpointed pipeline (None: a new one)."""
    kv: dict | None = None
    """Each rank's saved KV cache of the requests that were in flight (None: none saved)."""


@dataclass(frozen=True)
class CollectedBatch:
    """A batch as handed to the training step, with how long collecting it took."""

    batch: RolloutBatch | None
    """The batch on rank 0; None on the other ranks (they fetch their rows from the data
    plane)."""
    seconds: float
    engine: EngineCounters | None
    """What the engine did during this collection window (tokens sampled for all batches in
    flight, steps, rows, seconds inside steps); rank 0 only."""


class RolloutSource:
    """Hands each training step its batch on every rank; owns the rollout pipeline on rank 0.

    Use as a context manager: on exit rank 0 cancels the generator, the engine and the agents
    and closes its event loop.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        tier: Tier,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        agent: Agent | None,
        config: PipelineConfig,
        start: PipelineStart = PipelineStart(),
    ) -> None:
        self.ctx = ctx
        self.stop_cancels_window = config.stop_cancels_window
        """False when a stop saves a checkpoint first: the window in progress then finishes and
        the run stops after that step (``stop_requested``)."""
        self.failure_budget = dataclasses.replace(config.failure_budget)  # fresh counts
        self.policy_version = start.policy_version
        self.copy = None
        """The inference copy of a collocated refit (None: generation on ``model`` itself)."""
        if config.inference_tp is not None:
            vocab, tp, verify = tokenizer.vocab_size, config.inference_tp, config.verify_refit
            self.copy = InferenceCopy(ctx, tier, model, vocab, tp, verify)
            model = self.copy.model
        layout = None if self.copy is None else self.copy.layout
        self.host = GenerationHost(
            ctx,
            tier,
            model,
            config.engine,
            tokenizer.vocab_size,
            lambda: self.policy_version,
            layout,
        )
        self.exact_checkpoints = isinstance(self.host.steps.runner, SlotSnapshotRunner)
        """Checkpoints save the requests in flight (else they ``drain`` the pipeline first)."""
        self.layout = inflight.layout(ctx, config.engine.max_requests, layout)
        resume_from = self._restore_kv(start.state, start.kv)
        self._server: EmbeddedServer | None = None
        self._stop_signal: int | None = None
        if ctx.is_main:
            if agent is None:
                raise ValueError("rank 0 needs the agent")
            self.agent = agent
            self.tokenizer = tokenizer
            self.server_config = config.server
            self.engine = self.host.engine
            self.inference = LocalInferenceInterface(self.engine, tokenizer)
            self.generator = rollout_generator(
                agent,
                self.inference,
                config.rollout,
                lambda: self.policy_version,
                first_batch_id=start.first_batch,
                scheduler=self.engine,
                resume_from=resume_from,
            )
        failure = None
        if ctx.is_main:
            try:
                self.host.run(self._start)
            except BaseException as exc:  # stop the other ranks too before raising it here
                failure = exc
                self.close()
        raise_agreed_failure(failure)

    async def _start(self) -> None:
        if self.agent.requires_inference_server:
            cfg = self.server_config
            app = create_inference_app(
                self.inference,
                self.tokenizer,
                api_key=cfg.api_key,
                tool_call_parser=cfg.tool_call_parser,
                limits=dataclasses.replace(cfg.limits, engine_slots=self.engine.outside_capacity),
            )
            refused = listen_problem(
                cfg.host, cfg.api_key is not None, "--rl-inference-server-host", "--rl-api-key-file"
            )
            if refused:
                raise SystemExit(refused)
            try:
                self._server = await EmbeddedServer.start(app, cfg.host, cfg.port)
            except OSError as exc:
                raise SystemExit(
                    f"--rl-inference-server-host/--rl-inference-server-port: cannot listen on "
                    f"{cfg.host}:{cfg.port}: {exc.strerror or exc}"
                ) from None
            self.inference.base_url = self._server.url
            print(endpoint_line(self._server.url, cfg.key_source), flush=True)
        await self.agent.astart()
        self.generator.start()

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def next_batch(self) -> CollectedBatch:
        """The next batch, in order, on rank 0 (collective: the other ranks run the window).

        Raises ``SystemExit(128 + signum)`` when ``request_stop`` cancelled the window.
        """
        start = time.perf_counter()
        if not self.ctx.is_main:
            self._window(None)
            return CollectedBatch(None, time.perf_counter() - start, None)
        before = copy.copy(self.engine.counters)
        batch = self._window(self._next_checked_batch)
        spent = self.engine.counters - before
        return CollectedBatch(batch, time.perf_counter() - start, spent)

    async def _next_checked_batch(self) -> RolloutBatch:
        """The next batch, after the failure budget's check (inside the window, so that a
        failure aborts the other ranks' windows instead of leaving them waiting)."""
        batch = await self.generator.next_batch()
        self.failure_budget.check(batch.batch_id, batch.groups, self.generator.faults)
        return batch

    def new_policy(self, version: int) -> dict[str, float]:
        """The optimizer step made policy ``version`` (every rank): later tokens carry it, and an
        inference copy is refit from the new weights here, before the next window (collective);
        its ``refit/*`` metrics, empty without a copy."""
        self.policy_version = version
        return {} if self.copy is None else self.copy.refit_metrics(version)

    def _restore_kv(self, state: PipelineState | None, saved: dict | None) -> PipelineState | None:
        """Put each rank's saved KV slots back (collective); where the saved layout does not fit,
        rank 0's pipeline forgets the engine's work and its unfinished groups are generated
        anew (said on rank 0)."""
        if not self.exact_checkpoints:
            return state
        fits = inflight.restorable(saved, self.layout, self.ctx.device)
        if fits:
            self.host.steps.runner.import_slots(saved["slots"])
            return state
        if state is not None and state.engine is not None:
            was = saved["layout"] if saved is not None else "unknown"
            logger.warning(
                "resume: the saved generation in flight (%d requests) fits the layout %s, not "
                "this run's %s: the unfinished groups of batches %d..%d are generated anew at "
                "this policy version (the run is not the uninterrupted one from here)",
                len(state.engine.in_flight),
                was,
                self.layout,
                state.next_batch_id,
                state.submitted - 1,
            )
            return state.model_copy(update={"engine": None})
        return state

    def checkpoint_state(self) -> tuple[PipelineState | None, tuple[dict, dict] | None]:
        """What a checkpoint saves of the pipeline (collective): rank 0's ``PipelineState`` and
        this rank's KV cache slots of the requests in flight with their layout. Nothing is
        generated for it where the runners can save their slots; elsewhere ``drain`` (no
        slots)."""
        if not self.exact_checkpoints:
            return self.drain(), None
        state, failure = None, None
        if self.ctx.is_main:
            try:
                state = self.host.run(self.generator.snapshot)
            except BaseException as exc:  # every rank stops here instead of waiting below
                failure = exc
        raise_agreed_failure(failure)
        positions = main_rank_value(state.engine.cached_positions() if state else None)
        slots = self.host.steps.runner.export_slots(positions[self.host.steps.dp_rank])
        return state, (slots, self.layout)

    def drain(self) -> PipelineState | None:
        """Finish every submitted batch and return the pipeline state (collective).

        Called before a checkpoint; returns the state on rank 0 and ``None`` elsewhere. Tokens
        generated here belong to the current policy version, as in any window.
        """
        return self._window(self.generator.drain if self.ctx.is_main else None)

    def _window(self, work):
        try:
            return self.host.window(work)
        except (asyncio.CancelledError, GenerationAborted):
            if self._stop_signal is not None:  # cancelled by request_stop (here or on rank 0)
                raise SystemExit(128 + self._stop_signal) from None
            raise

    def request_stop(self, signum: int) -> None:
        """Stop at the next safe point (safe to call from a signal handler).

        With ``stop_cancels_window`` a generation window in progress is cancelled and the
        running ``next_batch`` raises ``SystemExit(128 + signum)`` on every rank; otherwise the
        loop sees the request at the end of the step (``stop_requested``).
        """
        self._stop_signal = signum
        if self.ctx.is_main and self.stop_cancels_window:
            self.host.cancel()

    def stop_requested(self) -> int:
        """The signal number any rank was asked to stop with, else 0 (collective: every rank
        decides alike, at the end of each step)."""
        return agreed_signal(self.ctx, self._stop_signal)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel and await every task of the pipeline (rank 0); idempotent, never hangs."""
        if self.ctx.is_main:
            self.host.close(self._shutdown, timeout_s)

    async def _shutdown(self) -> None:
        await self.generator.aclose()
        await self.engine.aclose()  # fails queued remote requests: their handlers answer at once
        if self._server is not None:
            await self._server.stop()
        await self.agent.aclose()


def agreed_signal(ctx: ParallelContext, signum: int | None) -> int:
    """The largest of every rank's ``signum`` (None: 0), on every rank (collective)."""
    value = torch.tensor([signum or 0], device=ctx.device)  # nccl on CUDA
    if ctx.world_size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def endpoint_line(url: str, key_source: str) -> str:
    """The line of the trainer's inference server: its OpenAI base URL (the bound port) and where
    the job's key came from (``auth.api_key_source``; never the key itself)."""
    if key_source == "none":
        return f"endpoint     {url}/v1 (OpenAI-style; no key)"
    return f"endpoint     {url}/v1 (OpenAI-style; bearer key from {key_source})"
