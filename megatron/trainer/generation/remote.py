"""``--refit-mode non-collocated``: generation on inference ranks of its own, beside training.

The job's last ranks (``--rl-inference-replicas`` inference replicas) run ``serve_inference``:
a ``RolloutSource`` of their own (agents, forced-lag generator, engine, inference server) on
their own model. The training ranks draw batches through ``RemoteRollouts``, which has
``RolloutSource``'s interface. Training rank 0 and the inference ranks talk over the ``Bridge``;
the schedule is fixed by the step count alone:

* at the start of collection c (step c*k, policy version v = c*k) the trainer sends ``weights``
  with version v, then takes batch c;
* the inference ranks, having finished window c (which produced batch c), receive version v,
  run window c+1 with it (while the trainer trains collection c) and send batch c+1.

So window c generates with the weights of collection c-1's start (version (c-1)*k; version 0
for windows 0 and 1), whatever the timing, and every token keeps that version: the submission
staleness of batch c is exactly L, as collocated, and token staleness is one collection more.
A checkpoint after collection c-1 saves batch c (already generated) and the pipeline as window c
left it (the inference ranks' ``checkpoint_state``); a resume hands batch c to the trainer and
restores the pipeline on the inference ranks, so the run continues as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron.rl.agent.api import Agent
from megatron.rl.inference.protocol import EngineCounters
from megatron.rl.refit.bridge import Bridge
from megatron.rl.refit.transfer import WeightReceiver, WeightSender
from megatron.rl.rollout.generator import PipelineState, RolloutBatch
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import RolloutGroup
from megatron.trainer.errors import InferenceRanksFailed, RefitMismatch
from megatron.trainer.flags.training import Parallelism
from megatron.trainer.generation.rollouts import (
    CollectedBatch,
    PipelineConfig,
    PipelineStart,
    RolloutSource,
    agreed_signal,
)
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import main_rank_value, raise_agreed_failure
from megatron.trainer.runtime.watchdog import Watchdog
from megatron.trainer.tiers import Tier

logger = logging.getLogger(__name__)


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside the CUDA tier's DDP and fp16 wrappers (its parameters, unprefixed)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _gated(model: torch.nn.Module) -> bool:
    """Whether the GPT's MLPs are gated."""
    return bool(getattr(model.config, "gated_linear_unit", False))


class RemoteRollouts:
    """The training ranks' side: each step's batch from the inference ranks, and each new
    policy's weights to them (``RolloutSource``'s interface; every training rank)."""

    host = None
    """No event loop here (the watchdog has none to watch)."""

    def __init__(
        self,
        ctx: ParallelContext,
        model: torch.nn.Module,
        start: PipelineStart,
        parallelism: Parallelism,
        watchdog: Watchdog | None = None,
    ) -> None:
        """``parallelism``: ``--rl-delta-refit`` and ``--rl-verify-model-weights-swap``;
        ``watchdog``: its messages name the inference ranks while this waits for them."""
        self.watchdog = watchdog
        delta, verify = parallelism.rl_delta_refit, parallelism.rl_verify_model_weights_swap
        self.ctx, self.bridge = ctx, ctx.bridge
        self.policy_version = start.policy_version
        model = _bare(model)
        self.sender = WeightSender(model, _gated(model), ctx.tp_group, self.bridge, delta, verify)
        self._pending: CollectedBatch | None = None
        """Rank 0: the batch a checkpoint saved, or that ``checkpoint_state`` received."""
        self._outstanding = 0
        """Rank 0: batches the inference ranks owe (one per ``weights`` message)."""
        self._refit: dict[str, float] = {}
        self._stop_signal: int | None = None
        self._closed = False
        blob = (start.kv or {}).get("slots") if ctx.is_main else None
        ready = None if blob is None else blob.get("ready")
        self._pending = None if ready is None else _batch_of(json.loads(ready))
        first_window_needs_weights = not main_rank_value(self._pending is not None)
        failure = None
        try:
            if ctx.is_main:
                kv = None if blob is None else blob.get("inference")
                state = None if start.state is None else start.state.model_dump_json()
                self.bridge.broadcast_object(
                    {
                        "kind": "start",
                        "state": state,
                        "kv": kv,
                        "policy_version": self.policy_version,
                    }
                )
            if first_window_needs_weights:
                self._send_weights()
        except BaseException as exc:  # every training rank stops here
            failure = exc
        raise_agreed_failure(failure)

    def __enter__(self) -> RemoteRollouts:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _waiting(self, what: str) -> contextlib.AbstractContextManager:
        """The block as what the current watchdog phase waits for (named if it times out)."""
        return self.watchdog.waiting_for(what) if self.watchdog else contextlib.nullcontext()

    def _send_weights(self) -> None:
        """Policy ``policy_version`` to the inference ranks: their next window's (collective)."""
        v = self.policy_version

        def announce() -> None:  # training rank 0, after the TP gathers
            self.bridge.broadcast_object({"kind": "weights", "version": v})
            self._outstanding += 1

        with self._waiting(f"waiting for {self.bridge.peers} to take the weights of version {v}"):
            stats = self.sender.send(v, announce)
        self._refit = {
            "refit/seconds": stats.seconds,
            "refit/bytes_sent": float(stats.bytes_sent),
            "refit/changed_share": stats.changed,
            "refit/unchanged_bf16_share": stats.unchanged_bf16,
        }

    def _receive(self, what: str = "a batch") -> dict[str, Any]:
        """The inference ranks' next message (rank 0); their failure raised here."""
        with self._waiting(f"waiting for {what} from {self.bridge.peers}"):
            message = self.bridge.recv_object(Bridge.INFERENCE_LEADER, what)
        if "error" in message:
            raise InferenceRanksFailed(f"{self.bridge.peers} failed: {message['error']}")
        return message

    def next_batch(self) -> CollectedBatch:
        """The next batch on rank 0 (None elsewhere), after sending this policy's weights for
        the inference ranks' next window (collective over the training ranks)."""
        start = time.perf_counter()
        collected, failure = CollectedBatch(None, 0.0, None), None
        try:
            self._send_weights()
            if self.ctx.is_main:
                collected = self._pending or self._collected(self._receive())
                self._pending = None
        except BaseException as exc:  # every training rank stops here
            failure = exc
        raise_agreed_failure(failure)
        return dataclasses.replace(collected, seconds=time.perf_counter() - start)

    def _collected(self, message: dict[str, Any]) -> CollectedBatch:
        self._outstanding -= 1
        self._refit.update(
            {
                "inference/window_seconds": message["seconds"],
                "inference/wait_seconds": message["wait_seconds"],
            }
        )
        return CollectedBatch(message["batch"], message["seconds"], message["engine"])

    def new_policy(self, version: int) -> dict[str, float]:
        """The optimizer step made policy ``version``; the metrics of this collection's refit
        (the first step of a collection only)."""
        self.policy_version = version
        metrics, self._refit = self._refit, {}
        return metrics

    def checkpoint_state(self) -> tuple[PipelineState | None, tuple[dict, dict] | None]:
        """The inference ranks' pipeline as window c left it, their KV caches and batch c
        (collective over the training ranks; rank 0 holds it all)."""
        if not self.ctx.is_main:
            raise_agreed_failure(None)
            return None, None
        state, blob, failure = None, None, None
        try:
            self.bridge.broadcast_object({"kind": "snapshot"})
            if self._pending is None and self._outstanding:
                self._pending = self._collected(self._receive())
            snapshot = self._receive("the pipeline's snapshot")
            state = PipelineState.model_validate_json(snapshot["state"])
            ready = None if self._pending is None else json.dumps(_json_of(self._pending))
            blob = {"inference": snapshot["kv"], "ready": ready}
        except BaseException as exc:
            failure = exc
        raise_agreed_failure(failure)
        inference = self.bridge.size - 1  # the inference ranks beside training rank 0
        return state, (blob, {"world_size": self.ctx.world_size, "inference": inference})

    def request_stop(self, signum: int) -> None:
        """Stop at the end of this step (safe from a signal handler; a step waiting for its
        batch gets it first)."""
        self._stop_signal = signum

    def stop_requested(self) -> int:
        """The signal number any training rank was asked to stop with, else 0 (collective)."""
        return agreed_signal(self.ctx, self._stop_signal)

    def close(self) -> None:
        """Tell the inference ranks to stop (rank 0) after taking the batches they owe;
        idempotent. A broken bridge is logged, not raised (the run's own error comes first)."""
        if self._closed or not self.ctx.is_main or self.bridge.broken:
            return
        self._closed = True
        try:
            self.bridge.broadcast_object({"kind": "stop"})
            while self._outstanding > 0:
                self._outstanding -= 1
                self.bridge.recv_object(Bridge.INFERENCE_LEADER, "the last batch")
            self.bridge.flush()
        except Exception as exc:  # noqa: BLE001 - the inference ranks are gone already
            logger.warning("closing the inference ranks: %s", exc)


def _json_of(collected: CollectedBatch) -> dict[str, Any]:
    batch = collected.batch
    return {
        "batch_id": batch.batch_id,
        "groups": [g.model_dump(mode="json") for g in batch.groups],
        "in_flight": batch.in_flight,
        "queue_depth": batch.queue_depth,
        "seconds": collected.seconds,
        "engine": None if collected.engine is None else dataclasses.asdict(collected.engine),
    }


def _batch_of(saved: dict[str, Any]) -> CollectedBatch:
    groups = [RolloutGroup.model_validate(g) for g in saved["groups"]]
    batch = RolloutBatch(saved["batch_id"], groups, saved["in_flight"], saved["queue_depth"])
    engine = None if saved["engine"] is None else EngineCounters(**saved["engine"])
    return CollectedBatch(batch, saved["seconds"], engine)


def serve_inference(
    ctx: ParallelContext,
    tier: Tier,
    tokenizer: Tokenizer,
    agent: Agent | None,
    config: PipelineConfig,
) -> None:
    """An inference rank's whole run: build the model, then answer the trainer's messages
    until it says stop (every inference rank; rank 0 runs the pipeline and sends the batches).

    It consumes ``start`` (the pipeline to resume), ``weights`` (a refit, then one generation
    window whose batch goes back), ``snapshot`` (the pipeline for a checkpoint) and ``stop``;
    it waits on the bridge between windows, and only the trainer unblocks it. After a failure
    each later request is answered with the error, so the trainer raises it and says stop.
    SIGTERM/SIGINT are left to the training ranks, which say stop.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    bridge = ctx.bridge
    model = tier.build_model(tokenizer.vocab_size)
    model.requires_grad_(False)
    receiver = WeightReceiver(_bare(model), _gated(_bare(model)), ctx.tp_group, bridge)
    begin = bridge.broadcast_object(None)
    state = None if begin["state"] is None else PipelineState.model_validate_json(begin["state"])
    kv = None
    saved = begin["kv"][ctx.rank] if begin["kv"] and ctx.rank < len(begin["kv"]) else None
    if saved is not None:  # None: a tier that drains its engine before a save
        kv = {"slots": saved[0], "layout": saved[1]}
    start = PipelineStart(
        first_batch=0 if state is None else state.next_batch_id,
        policy_version=begin["policy_version"],
        state=state,
        kv=kv,
    )
    source, error = None, None
    try:
        source = RolloutSource(ctx, tier, model, tokenizer, agent, config, start)
    except BaseException as exc:  # noqa: BLE001 - answered to the trainer below
        error = f"{type(exc).__name__}: {exc}"
    try:
        _answer(ctx, bridge, receiver, source, error)
    finally:
        if source is not None:
            source.close()


def _answer(
    ctx: ParallelContext,
    bridge: Bridge,
    receiver: WeightReceiver,
    source: RolloutSource | None,
    error: str | None,
) -> None:
    """The message loop of ``serve_inference``."""
    waited = time.perf_counter()
    while True:
        message = bridge.broadcast_object(None)
        kind = message["kind"]
        if kind == "stop":
            bridge.flush()
            return
        reply: dict[str, Any] | None = None
        try:
            if kind == "weights":
                version, bad = receiver.receive()
                if bad and error is None:
                    raise RefitMismatch(
                        f"--rl-verify-model-weights-swap: after the refit for policy version "
                        f"{version}, the inference ranks' weights differ from the trained ones "
                        f"in {', '.join(bad)}"
                    )
                if error is None:
                    reply = _window(source, version, time.perf_counter() - waited)
            elif kind == "snapshot" and error is None:
                reply = _snapshot(ctx, source)
        except BaseException as exc:  # noqa: BLE001 - answered to the trainer
            error = error or f"{type(exc).__name__}: {exc}"
        if ctx.is_main:
            bridge.send_object({"error": error} if error is not None else reply, Bridge.TRAINER)
        waited = time.perf_counter()


def _window(source: RolloutSource, version: int, wait_seconds: float) -> dict[str, Any]:
    """One generation window at policy ``version``: its batch, for the trainer."""
    source.new_policy(version)
    collected = source.next_batch()
    return {
        "batch": collected.batch,
        "engine": collected.engine,
        "seconds": collected.seconds,
        "wait_seconds": wait_seconds,
    }


def _snapshot(ctx: ParallelContext, source: RolloutSource) -> dict[str, Any] | None:
    """The pipeline's state and every inference rank's KV slots, gathered on rank 0."""
    state, kv = source.checkpoint_state()
    slots = [None] * ctx.world_size if ctx.is_main else None
    if ctx.world_size > 1:
        dist.gather_object(kv, slots, dst=0)
    else:
        slots = [kv]
    if not ctx.is_main:
        return None
    return {"state": state.model_dump_json(), "kv": slots}
