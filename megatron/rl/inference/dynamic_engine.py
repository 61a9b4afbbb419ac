"""megatron-core's ``DynamicInferenceEngine`` behind the trainer's engine protocol (CUDA tier).

The CPU tier's ``LocalInferenceEngine`` is two layers: a scheduler (requests, rollout-key order,
the announced-request barrier, the window target, policy versions, futures) and, under a
``StepGroup``, a ``ModelRunner`` that executes each replica's rows with its own KV cache. The CUDA
tier keeps the scheduler unchanged, so the forced-lag contract and the deterministic schedule are
literally the same code, and replaces the runner:

* ``DynamicEngineRunner`` executes rows with megatron-core's ``DynamicInferenceEngine`` on the
  training model itself (same TP/PP sharding): a request's first row adds it to the engine (prompt
  tokens, token budget, EOS as termination id), every row then advances it by one megatron-core
  step (``async_forward`` + ``async_bookkeep``: dynamic context, paged KV cache via
  ``block_table``, flash attention or ``flash_reference``). It runs on every rank of the replica;
  all ranks see the same rows, so their engines stay in lockstep.
* ``SeededSamplingController`` replaces megatron-core's sampling (one generator for all requests)
  with the trainer's: each request draws the uniform of its token at position p from
  ``token_uniform(seed, p)`` and samples with ``sample_tokens``, so tokens do not depend on batch
  composition, every TP rank draws the same token without a broadcast, and the logprob is the one
  of the tempered policy, as the trainer recomputes it.
* ``WindowedStepGroup`` tells the runner on every rank when a generation window closes; the runner
  then suspends megatron-core's engine (its KV memory is released during the training step) and
  resumes it at the next window (active requests are re-prefilled under the new weights).
* ``DynamicInferenceEngineAdapter`` is the scheduler with one addition: each row carries its
  request's token budget (``BoundedRowWork``) so that megatron-core finishes a request exactly when
  the scheduler does.

Rows the scheduler leaves out of a step (keyed requests outside the window target while unkeyed
requests step) are still advanced by megatron-core, which steps every active request: their
tokens are kept and handed over, in order, when the scheduler asks for them. They are then
recorded with the policy version of that later step. With the trainer's own (keyed) agents this
never happens.

Constructing megatron-core's engine needs CUDA (``build_megatron_engine``); everything else here
is tested on CPU against a stand-in with the same methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import math
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.inference_request import Status
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
    InferenceWrapperConfig,
)
from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine
from megatron.rl.inference.model_runner import RowResult, RowWork, token_uniform
from megatron.rl.inference.sampling import sample_tokens
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models import flash_reference


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
    release_memory_between_windows: bool = True
    """Suspend megatron-core's engine (free its KV memory) while the trainer trains."""

    def tokens_per_step(self) -> int:
        """The resolved ``max_tokens_per_step``."""
        if self.max_tokens_per_step is not None:
            return max(self.max_tokens_per_step, self.max_requests, self.max_seq_len)
        return max(min(self.max_requests * self.max_seq_len, 16384), self.max_seq_len)


@dataclass(frozen=True)
class BoundedRowWork(RowWork):
    """A row that also carries its request's token budget (for megatron-core's bookkeeping)."""

    max_tokens: int = 0
    """The request's ``max_tokens`` (0: unknown, use the rest of ``max_seq_len``)."""


@dataclass(frozen=True)
class RowSampling:
    """How one request samples: its seed and sampling parameters."""

    seed: int
    """The request's sampling seed."""
    temperature: float
    """0 means greedy."""
    top_p: float
    """Nucleus mass; 1 disables."""
    top_k: int
    """0 disables."""


class SeededSampler:
    """Samples the next token of each active request from the request's own seeded uniforms.

    Shared by the runner (which registers each request's ``RowSampling``) and the controller
    (which calls ``sample`` inside megatron-core's step); ``take`` hands the runner what the last
    step sampled.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.requests: dict[int, RowSampling] = {}
        self._last: list[tuple[int, int, float]] = []

    def sample(
        self, logits: torch.Tensor, request_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Tokens (n,) int64 on ``logits``' device for the n active requests.

        ``logits`` (n, V_padded) are full-vocabulary logits at each request's last fed token;
        ``positions[i]`` is the position of the token being sampled for request i.
        """
        logits = logits.float().clone()
        logits[:, self.vocab_size :] = float("-inf")  # padded embedding rows are never sampled
        params = [self.requests[r] for r in request_ids]
        dev = logits.device
        tokens, logprobs = sample_tokens(
            logits,
            temperature=torch.tensor([p.temperature for p in params], device=dev),
            top_p=torch.tensor([p.top_p for p in params], device=dev),
            top_k=torch.tensor([p.top_k for p in params], device=dev),
            uniforms=torch.tensor(
                [token_uniform(p.seed, pos) for p, pos in zip(params, positions)], device=dev
            ),
        )
        self._last = list(zip(request_ids, tokens.tolist(), logprobs.tolist()))
        return tokens

    def take(self) -> list[tuple[int, int, float]]:
        """(request id, token, logprob) of every request the last step sampled, then forget."""
        last, self._last = self._last, []
        return last


class SeededSamplingController(TextGenerationController):
    """megatron-core's controller with the trainer's per-request seeded sampling."""

    def __init__(self, inference_wrapped_model, tokenizer, sampler: SeededSampler, pp_group=None):
        super().__init__(inference_wrapped_model, tokenizer, pp_group=pp_group)
        self.sampler = sampler

    def _dynamic_step_sample_bookkeeping(self) -> None:
        """Nothing to prepare: parameters are looked up per request in ``sample``."""

    def _dynamic_step_sample_logits(self, logits: torch.Tensor) -> None:
        """Sample every active request's next token into megatron-core's token buffer."""
        context = self.inference_wrapped_model.inference_context
        active = slice(context.paused_request_count, context.total_request_count)
        count = active.stop - active.start
        if context.materialize_only_last_token_logits:
            last = logits.squeeze(0)[:count]
        else:
            last = context.last_token_logits(logits)[:count]
        request_ids = context.request_ids[active].tolist()
        positions = (
            context.request_kv_length_offsets[active] + context.request_query_lengths[active]
        ).tolist()
        self._sampled_tokens_cuda[:count] = self.sampler.sample(last, request_ids, positions)


class _NoTextTokenizer:
    """megatron-core wants a tokenizer to detokenize finished requests; the trainer's inference
    interface detokenizes itself, so this one returns empty text."""

    def __init__(self, eos_id: int) -> None:
        self.eod = eos_id

    def detokenize(self, tokens: list[int], **kwargs) -> str:
        """No text (never used by the trainer)."""
        return ""

    def tokenize(self, text: str, **kwargs) -> list[int]:
        """Text prompts never reach the engine: requests arrive as token ids."""
        raise NotImplementedError("the dynamic engine adapter takes token ids, not text")


class _DetachedLoop:
    """Stands in for the asyncio loop of megatron-core's engine.

    The runner steps the engine directly (``async_forward``/``async_bookkeep``) instead of running
    its serving loop, so the engine's wake-up notifications have nobody to wake: they are closed
    instead of piling up on a loop that never runs. Request futures are plain
    ``concurrent.futures.Future`` objects (only ever resolved, never awaited).
    """

    def call_soon_threadsafe(self, callback: Callable, *args: Any) -> None:
        """Drop the notification (closing a coroutine argument so it never warns)."""
        for arg in args:
            if asyncio.iscoroutine(arg):
                arg.close()

    def create_task(self, coro: Coroutine) -> None:
        """Never schedules anything (see ``call_soon_threadsafe``)."""
        coro.close()

    def create_future(self) -> concurrent.futures.Future:
        """A future megatron-core resolves when a request finishes."""
        return concurrent.futures.Future()


class SteppedDynamicInferenceEngine(DynamicInferenceEngine):
    """megatron-core's ``DynamicInferenceEngine``, stepped by ``DynamicEngineRunner``."""

    def reset(self) -> None:
        """Reset as megatron-core does, on the detached loop."""
        self._loop = _DetachedLoop()
        super().reset()

    def resume(self) -> None:
        """Resume as megatron-core does, then point the controller at the new request metadata.

        megatron-core 0.16's ``resume`` reallocates the context's request-metadata tensors, but the
        controller keeps references to the GPU-resident ones it bound at construction
        (``termination_id``): it would compare sampled tokens against the freed tensors' stale or
        never-written values and finish requests on arbitrary tokens.
        """
        was_suspended = self.is_suspended
        super().resume()
        if was_suspended:
            metadata = self.controller._request_metadata
            for label, _, on_gpu in self.context.request_metadata_types:
                if on_gpu:
                    metadata[label] = self.context.request_metadata[label]


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
    """(token, logprob) sampled but not yet asked for by the scheduler."""
    live: bool = True
    """Still in megatron-core's engine (not finished)."""
    abandoned: bool = False
    """Its slot was given to another request: outputs are dropped."""


class DynamicEngineRunner:
    """A ``RowRunner`` over megatron-core's dynamic engine (one data-parallel replica).

    ``engine`` is a ``SteppedDynamicInferenceEngine`` (or a stand-in with ``add_request``,
    ``async_forward``, ``async_bookkeep``, ``suspend``, ``resume``, ``requests``,
    ``waiting_request_ids`` and ``stop_word_finished_request_ids``) whose controller samples with
    ``sampler``.
    """

    def __init__(self, engine: Any, sampler: SeededSampler, config: DynamicEngineConfig) -> None:
        self.engine = engine
        self.sampler = sampler
        self.config = config
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
                token, logprob = ahead.popleft()
                self._slots[row.slot].delivered += 1
                results.append(RowResult(slot=row.slot, token=token, logprob=logprob))
        self._forget_finished()
        return results

    def end_window(self) -> None:
        """The generation window closed (every rank): release megatron-core's KV memory."""
        if self.config.release_memory_between_windows and not self._suspended:
            self.engine.suspend()
            self._suspended = True

    # ----------------------------------------------------------------- internals

    def _bind(self, row: RowWork) -> int:
        """The megatron-core request serving ``row``, added to the engine on its first row."""
        slot = self._slots.get(row.slot)
        sampling = RowSampling(row.seed, row.temperature, row.top_p, row.top_k)
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
        budget = getattr(row, "max_tokens", 0) or self.config.max_seq_len - len(row.tokens)
        self.sampler.requests[rid] = sampling
        self.engine.add_request(
            rid,
            list(row.tokens),
            MegatronSamplingParams(
                num_tokens_to_generate=budget,
                termination_id=self.config.eos_id,
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
        for rid, token, logprob in sampled:
            state = self._requests.get(rid)
            if state is not None and not state.abandoned:
                state.ahead.append((token, logprob))
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

    def _forget_finished(self) -> None:
        bound = {s.request_id for s in self._slots.values()}
        for rid in [
            r
            for r, s in self._requests.items()
            if not s.live and not s.ahead and (s.abandoned or r not in bound)
        ]:
            del self._requests[rid]


class WindowedStepGroup(StepGroup):
    """A ``StepGroup`` whose ranks tell their ``DynamicEngineRunner`` when a window closes."""

    runner: DynamicEngineRunner

    def follow(self) -> None:
        """Execute rank 0's plans until it stops the window, then close the window here."""
        try:
            super().follow()
        finally:
            self.runner.end_window()

    def stop_followers(self) -> None:
        """End the window on every rank (rank 0 only)."""
        super().stop_followers()
        self.runner.end_window()

    def abort_followers(self, reason: str) -> None:
        """Make followers raise, and close the window here (rank 0 only)."""
        super().abort_followers(reason)
        self.runner.end_window()


class DynamicInferenceEngineAdapter(LocalInferenceEngine):
    """The engine protocol (``megatron.rl.inference.protocol.InferenceEngine``) over megatron-core.

    Scheduling is ``LocalInferenceEngine``'s, unchanged; steps go to ``WindowedStepGroup`` ranks
    running ``DynamicEngineRunner``. Each row carries its request's token budget.
    """

    def __init__(
        self,
        steps: WindowedStepGroup,
        config: LocalEngineConfig,
        policy_version: Callable[[], int],
    ) -> None:
        if not isinstance(steps.runner, DynamicEngineRunner):
            raise TypeError("DynamicInferenceEngineAdapter needs a DynamicEngineRunner step group")
        super().__init__(steps, config, policy_version)

    def _plan(self) -> list[list[RowWork]]:
        plan = super()._plan()
        return [
            [
                BoundedRowWork(
                    **vars(row),
                    max_tokens=self._active[(replica, row.slot)].sampling.max_tokens,
                )
                for row in rows
            ]
            for replica, rows in enumerate(plan)
        ]


# --------------------------------------------------------------------- construction (CUDA)


def attention_backend_name() -> str:
    """Which attention kernels megatron-core's dynamic engine uses here (before or after
    ``build_megatron_engine`` installs the reference where flash-attn is missing)."""
    from megatron.core.transformer import attention

    if flash_reference.reference_in_use():
        return "flash_reference (PyTorch)"
    if attention.HAVE_FA3:
        return "flash-attn 3"
    if attention.flash_attn_varlen_func is not None:
        return "flash-attn 2"
    return "flash_reference (PyTorch)"


def build_megatron_engine(
    model: torch.nn.Module,
    config: DynamicEngineConfig,
    vocab_size: int,
    padded_vocab_size: int,
    sampler: SeededSampler,
) -> SteppedDynamicInferenceEngine:
    """megatron-core's dynamic engine over ``model`` (this rank's shard; CUDA only).

    Installs ``flash_reference`` when neither flash-attn nor FA3 is importable. The KV buffer is
    sized for ``max_requests`` requests of ``max_seq_len`` tokens, so requests are never paused or
    evicted for lack of blocks.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import attention
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    if not torch.cuda.is_available():
        raise RuntimeError("megatron-core's DynamicInferenceEngine needs a CUDA device")
    if importlib.util.find_spec("einops") is None or attention.rearrange is None:
        raise RuntimeError("megatron-core's dynamic inference needs einops: pip install einops")
    flash_reference.install_into_megatron_core()
    mc = get_model_config(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    kv_heads = mc.num_query_groups or mc.num_attention_heads
    layers = len(get_attr_wrapped_model(model, "decoder").layers)  # on this pipeline stage
    dtype = mc.params_dtype
    block_bytes = dtype.itemsize * 2 * layers * config.block_size_tokens * kv_heads // tp
    block_bytes *= mc.kv_channels
    blocks = config.max_requests * math.ceil(config.max_seq_len / config.block_size_tokens) + 4
    context = DynamicInferenceContext(
        params_dtype=dtype,
        num_layers=layers,
        kv_channels=mc.kv_channels,
        num_attention_heads=kv_heads,
        max_sequence_length=config.max_seq_len,
        buffer_size_gb=blocks * block_bytes / 1024**3,
        max_requests=config.max_requests,
        max_tokens=config.tokens_per_step(),
        block_size_tokens=config.block_size_tokens,
        materialize_only_last_token_logits=True,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
    )
    wrapped = GPTInferenceWrapper(
        model,
        InferenceWrapperConfig(
            hidden_size=mc.hidden_size,
            params_dtype=dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=padded_vocab_size,
            inference_max_requests=config.max_requests,
            inference_max_seq_length=config.max_seq_len,
        ),
        context,
    )
    wrapped.prep_model_for_inference()
    controller = SeededSamplingController(wrapped, _NoTextTokenizer(config.eos_id), sampler)
    return SteppedDynamicInferenceEngine(
        controller, context, random_seed=0, enable_chunked_prefill=False
    )


def build_dynamic_step_group(
    model: torch.nn.Module,
    config: DynamicEngineConfig,
    vocab_size: int,
    padded_vocab_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    is_replica_leader: bool = True,
) -> WindowedStepGroup:
    """The step group of this rank: megatron-core's engine on its shard of ``model``."""
    sampler = SeededSampler(vocab_size)
    engine = build_megatron_engine(model, config, vocab_size, padded_vocab_size, sampler)
    runner = DynamicEngineRunner(engine, sampler, config)
    return WindowedStepGroup(runner, dp_rank, dp_size, is_replica_leader)
