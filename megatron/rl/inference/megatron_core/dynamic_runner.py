"""The CUDA tier's row runner: megatron-core's ``DynamicInferenceEngine`` steps the scheduler's rows.

The scheduler (``scheduler.ContinuousBatchingScheduler``) is the same on both tiers, so the
forced-lag contract and the deterministic schedule are literally the same code; only the row
runner differs:

* ``DynamicEngineRowRunner`` executes rows with megatron-core's ``DynamicInferenceEngine`` on the
  training model itself (same TP/PP sharding): a request's first row adds it to the engine (prompt
  tokens, token budget ``RowWork.max_tokens``, EOS as termination id), every row then advances it
  by one megatron-core step (``async_forward`` + ``async_bookkeep``: dynamic context, paged KV
  cache via ``block_table``, flash attention or ``flash_reference``). It runs on every rank of the
  replica; all ranks see the same rows, so their engines stay in lockstep.
* ``SeededSampler`` (``seeded_sampler.py``) replaces megatron-core's sampling (one generator for
  all requests) with the trainer's: each request draws the uniform of its token at position p
  from ``token_uniform(seed, p)``, so tokens do not depend on batch composition, every TP rank
  draws the same token without a broadcast, and the logprob is the one of the tempered policy,
  as the trainer recomputes it. A runner also scores sequences with a plain forward of the model
  (``scoring.ScoringForward``; none with pipeline parallelism).
* With ``record_routing`` (an MoE model), the controller hands the sampler each request's slice
  of the step's router rows (``split_routes``: the active requests' tokens are packed in request
  order, ``request_query_lengths`` of each), and every ``RowResult`` carries the routes of the
  tokens its row fed: the whole prompt for a request's first token, the previous token after.
* When a generation window closes (``end_window``, called by the ``StepGroup`` on every rank) the
  runner suspends megatron-core's engine (its KV memory is released during the training step) and
  resumes it at the next window (active requests are re-prefilled under the new weights): the
  ``recompute`` KV-cache mode, the default. ``persist`` keeps the cache (no suspend), ``offload``
  (megatron-core 0.17+) moves it to host memory and back (``DynamicEngineConfig.kv_cache_mode``).

Rows the scheduler leaves out of a step (keyed requests outside the window target while unkeyed
requests step) are still advanced by megatron-core, which steps every active request: their
tokens are kept and handed over, in order, when the scheduler asks for them. They are then
recorded with the policy version of that later step. With the trainer's own (keyed) agents this
never happens.

Building megatron-core's engine needs CUDA (``dynamic_engine.build_megatron_engine``); the runner
is tested on CPU against a stand-in with the same methods.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.inference.inference_request import Status
from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams

from megatron.rl.inference.megatron_core.seeded_sampler import RowSampling, SeededSampler
from megatron.rl.inference.protocol import (
    RowResult,
    RowWork,
    ScoreOutput,
    ScoreWork,
)
from megatron.rl.inference.scoring import ScoringForward


@dataclass(frozen=True)
class DynamicEngineConfig:
    """Capacity of megatron-core's dynamic context on one data-parallel replica."""

    max_requests: int = 64
    """Requests decoded at once (the scheduler's ``max_requests`` for this replica)."""
    max_seq_len: int = 128
    """Longest prompt + generation (the context's ``max_sequence_length``)."""
    eos_id: int = 1
    """Termination token id."""
    block_size_tokens: int = 256
    """Tokens per paged KV-cache block; flash-attn 2 needs a multiple of 256."""
    max_tokens_per_step: int | None = None
    """Most tokens in one forward (prefill budget); default: enough for every request's longest
    prompt, capped at 16384 and never below ``max_seq_len``. Chunked prefill is off, so a prompt
    always fits in one step."""
    kv_cache_mode: str = "recompute"
    """What a window's end does with megatron-core's KV cache while the trainer trains
    (``compat.KV_CACHE_MODES``): ``recompute`` frees it (the engine is suspended; requests in
    flight are prefilled again under the new weights at the next window), ``persist`` keeps it
    (the engine is not suspended), ``offload`` (megatron-core 0.17+) moves it to host memory and
    back (suspended, requests continue on their old keys and values)."""
    record_routing: bool = False
    """Give each ``RowResult`` the MoE routes of the tokens its row fed (``routing_replay``);
    a no-op for a model without routers."""

    def tokens_per_step(self) -> int:
        """The resolved ``max_tokens_per_step``."""
        if self.max_tokens_per_step is not None:
            return max(self.max_tokens_per_step, self.max_requests, self.max_seq_len)
        return max(min(self.max_requests * self.max_seq_len, 16384), self.max_seq_len)


def split_routes(
    routes: torch.Tensor, request_ids: list[int], query_lengths: list[int]
) -> dict[int, torch.Tensor]:
    """Request id -> its (query_length, L, k) rows of one packed step's ``routes`` (rows, L, k):
    the requests' tokens lie in request order from row 0 (padding rows after them)."""
    ends = list(itertools.accumulate(query_lengths))
    if ends and ends[-1] > routes.shape[0]:
        raise ValueError(f"routes: {routes.shape[0]} router rows for {ends[-1]} fed tokens")
    starts = [0, *ends[:-1]]
    return {rid: routes[a:b].cpu() for rid, a, b in zip(request_ids, starts, ends)}


def drive(coro: Coroutine) -> Any:
    """Run a coroutine that only yields to the event loop (``asyncio.sleep(0)``) to completion.

    megatron-core's step coroutines await nothing but ``sleep(0)``; driving them here keeps each
    engine step synchronous inside the scheduler's own step, on every rank, without a second
    event loop or thread.
    """
    try:
        while True:
            yielded = coro.send(None)
            if yielded is not None:
                coro.close()
                raise RuntimeError(f"engine step awaited {yielded!r}; it cannot be driven inline")
    except StopIteration as stop:
        return stop.value


@dataclass
class _Slot:
    """The megatron-core request that currently serves one scheduler slot."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: RowSampling
    delivered: int = 0
    """Tokens handed to the scheduler so far."""


@dataclass
class _Outstanding:
    """Per-request state of megatron-core requests the runner has added."""

    ahead: deque = field(default_factory=deque)
    """(token, logprob, routes or None, alternatives) sampled but not yet asked for by the
    scheduler."""
    sampled: int = 0
    """Tokens megatron-core sampled for it so far."""
    live: bool = True
    """Still in megatron-core's engine (not finished)."""
    abandoned: bool = False
    """Its slot was given to another request: outputs are dropped."""


class DynamicEngineRowRunner:
    """A ``protocol.RowRunner`` over megatron-core's dynamic engine (one data-parallel replica).

    ``engine`` is a ``SteppedDynamicInferenceEngine`` (or a stand-in with ``add_request``,
    ``async_forward``, ``async_bookkeep``, ``suspend``, ``resume``, ``requests``,
    ``waiting_request_ids`` and ``stop_word_finished_request_ids``) whose controller samples with
    ``sampler``.
    """

    def __init__(
        self,
        engine: Any,
        sampler: SeededSampler,
        config: DynamicEngineConfig,
        scoring: ScoringForward | None = None,
    ) -> None:
        self.engine = engine
        self.sampler = sampler
        self.config = config
        self.scoring = scoring
        """Plain forwards of the model that score sequences (None: this runner cannot score,
        e.g. a pipeline stage holds only part of the model)."""
        self._ids = itertools.count()
        self._slots: dict[int, _Slot] = {}
        self._requests: dict[int, _Outstanding] = {}
        self._suspended = False
        self.steps = 0
        """megatron-core steps run (a counter for tests and benchmarks)."""

    # ----------------------------------------------------------------- RowRunner

    def run(self, rows: list[RowWork]) -> list[RowResult]:
        """Advance each row's request and return the token of every row that has one."""
        if not rows:
            return []
        named = sorted({r.adapter for r in rows if r.adapter is not None})
        if named:
            raise ValueError(
                f"LoRA adapters {named} per request are served by the cpu backend only: "
                "megatron-core's engine steps every request with the model's own adapters"
            )
        if self._suspended:
            self.engine.resume()
            self._suspended = False
        request_ids = [self._bind(row) for row in rows]
        for rid in request_ids:
            state = self._requests[rid]
            if not state.ahead and not state.live:
                raise RuntimeError(
                    f"dynamic engine: request {rid} finished in megatron-core before the "
                    "scheduler finished it (token budget or EOS disagree)"
                )
        if any(not self._requests[rid].ahead for rid in request_ids):
            self._step(request_ids)
        results = []
        for row, rid in zip(rows, request_ids):
            ahead = self._requests[rid].ahead
            if ahead:
                token, logprob, routes, top = ahead.popleft()
                self._slots[row.slot].delivered += 1
                results.append(RowResult(row.slot, token, logprob, routes, top))
        self._forget_finished()
        return results

    def end_window(self, idle: bool = False) -> None:
        """The generation window closed on this rank: suspend megatron-core's engine, which
        frees or offloads its KV memory by ``config.kv_cache_mode`` (``persist``: nothing to do;
        ``idle`` changes nothing here)."""
        if self.config.kv_cache_mode != "persist" and not self._suspended:
            self.engine.suspend()
            self._suspended = True

    def score(self, jobs: list[ScoreWork]) -> list[ScoreOutput]:
        """A plain forward of each job's tokens, beside megatron-core's engine (its KV cache and
        requests are untouched)."""
        if self.scoring is None:
            raise RuntimeError(
                "dynamic engine: scoring needs the whole model on each rank of a replica "
                "(no pipeline parallelism)"
            )
        return self.scoring(jobs)

    # ----------------------------------------------------------------- internals

    def _bind(self, row: RowWork) -> int:
        """The megatron-core request serving ``row``, added to the engine on its first row."""
        slot = self._slots.get(row.slot)
        sampling = RowSampling(row.seed, row.temperature, row.top_p, row.top_k, row.top_logprobs)
        if row.start == 0:  # a request's first row: its whole prompt
            same = (
                slot is not None
                and slot.delivered == 0
                and slot.prompt == tuple(row.tokens)
                and slot.sampling == sampling
            )
            if same:  # still waiting for its first token
                return slot.request_id
            if slot is not None:
                self._abandon(slot.request_id)
            return self._add(row, sampling)
        if slot is None:
            raise RuntimeError(f"dynamic engine: slot {row.slot} continues no known request")
        expected = len(slot.prompt) + slot.delivered - 1
        if row.start != expected:
            raise RuntimeError(
                f"dynamic engine: slot {row.slot} feeds position {row.start}, its request is at "
                f"{expected}"
            )
        return slot.request_id

    def _add(self, row: RowWork, sampling: RowSampling) -> int:
        rid = next(self._ids)
        budget = row.max_tokens or self.config.max_seq_len - len(row.tokens)
        self.sampler.requests[rid] = sampling
        self.engine.add_request(
            rid,
            list(row.tokens),
            MegatronSamplingParams(
                num_tokens_to_generate=budget,
                termination_id=-1 if row.ignore_eos else self.config.eos_id,  # -1: no token
                return_log_probs=False,
            ),
        )
        self._slots[row.slot] = _Slot(rid, tuple(row.tokens), sampling)
        self._requests[rid] = _Outstanding()
        return rid

    def _abandon(self, rid: int) -> None:
        """The scheduler gave this request's slot away (it was cancelled): drop it."""
        state = self._requests[rid]
        state.abandoned = True
        state.ahead.clear()
        if not state.live:
            return
        if rid in self.engine.waiting_request_ids:  # never scheduled: just forget it
            self.engine.waiting_request_ids.remove(rid)
            self.engine.requests.pop(rid, None)
            self.sampler.requests.pop(rid, None)
            state.live = False
        else:  # active: megatron-core finishes it at its next step (the stop-word path)
            self.engine.stop_word_finished_request_ids.add(rid)

    def _step(self, wanted: list[int]) -> None:
        forward = drive(self.engine.async_forward())
        self.steps += 1
        sampled = self.sampler.take() if forward[0] is not None else []
        routes = self.sampler.take_routes()
        for rid, token, logprob, top in sampled:
            state = self._requests.get(rid)
            if state is not None and not state.abandoned:
                fed = self._fed_routes(routes.get(rid), first=state.sampled == 0)
                state.ahead.append((token, logprob, fed, top))
                state.sampled += 1
        finished = drive(self.engine.async_bookkeep(*forward))["finished_request_records"]
        for record in finished:
            rid = record.request_id
            state = self._requests.get(rid)
            self.sampler.requests.pop(rid, None)
            if state is None:
                continue
            state.live = False
            if record[-1].status == Status.FAILED and not state.abandoned:
                raise RuntimeError(f"dynamic engine: megatron-core failed request {rid}")
        if not sampled and not any(self._requests[rid].ahead for rid in wanted):
            raise RuntimeError(
                "dynamic engine: megatron-core could not schedule any waiting request (KV-cache "
                "buffer or max_tokens_per_step too small for the prompts)"
            )

    @staticmethod
    def _fed_routes(routes: torch.Tensor | None, first: bool) -> torch.Tensor | None:
        """The routes of the tokens the scheduler's row fed for this token: all of a prefill
        for a request's first token, else the last one (a request re-prefilled after a suspend
        feeds its whole sequence again; the row fed only its previous token)."""
        if routes is None or first:
            return routes
        return routes[-1:]  # (1, L, k)

    def _forget_finished(self) -> None:
        bound = {s.request_id for s in self._slots.values()}
        for rid in [
            r
            for r, s in self._requests.items()
            if not s.live and not s.ahead and (s.abandoned or r not in bound)
        ]:
            del self._requests[rid]
